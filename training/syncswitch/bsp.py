"""The BSP training loop: MultiWorkerMirroredStrategy, every worker in lockstep; worker 0 is the chief.
Compressed BSP is this loop with another gradient exchange (syncswitch.exchange).

Each call of ``train_steps`` runs ``count`` optimizer steps in a graph loop. Per step: the batch, the
LR and momentum of that step (the schedule, in the graph), forward and backward, one gradient
all-reduce (inside the optimizer; compressed BSP's before it), the update. Per call (not per step):
one host sync and one small all-reduce carrying the per-step losses, the graceful-stop vote and the
workers' step time, so every worker agrees on when to stop and on the next call's size. Every worker
also times each step of its own: from the step's start to the end of its backward pass is its own
share; the rest is waiting for its peers in the all-reduce, which singles out a straggler in lockstep.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from syncswitch.context import NodeContext
from syncswitch.exchange import gradient_exchange
from syncswitch.peers import probe_peers_of
from syncswitch.reporting import WorkerTimer
from syncswitch.trainer import (
    STEP_SECONDS,
    WARMUP_EXECUTIONS,
    Schedule,
    SegmentSession,
    build_and_restore,
    replica_step_fn,
    steps_per_execution,
    steps_per_execution_event,
    timed_steps,
)

# A call's wall time at most, when steps per call are automatic: workers report timings once per call.
MAX_CALL_SECONDS = 1.0


def ring_all_reduce_strategy() -> Any:
    """MultiWorkerMirroredStrategy over TF_CONFIG's workers, its collectives by ring (gRPC on CPU)."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def run_bsp_worker(ctx: NodeContext, problem: Any) -> dict[str, Any] | None:
    """One MultiWorkerMirroredStrategy worker. Returns the segment result on the chief."""
    import tensorflow as tf

    strategy = ring_all_reduce_strategy()
    training = build_and_restore(ctx, strategy, problem)
    state, restored, _signature = training
    loop = BspLoop(ctx.spec, ctx.hp, restored["samples"], restored["updates"])
    schedule = Schedule(ctx.spec, ctx.hp, loop.samples / loop.global_batch, start_updates=loop.updates)
    iterator = iter(strategy.distribute_datasets_from_function(_dataset_fn(ctx, problem, loop.samples)))
    exchange = gradient_exchange(ctx.spec.segment_protocol, state["flat"])
    train_steps = _compile_train_steps(strategy, state, schedule, loop.global_batch, exchange)
    # Whose link is slow: each worker's round trip to its peers rides along with its step timings.
    with (
        SegmentSession(ctx, training, schedule, loop.global_batch, reports=ctx.is_chief) as session,
        contextlib.closing(probe_peers_of(ctx.task)) as probe,
    ):
        timer = WorkerTimer(session.events, ctx.task, probe=probe)
        stopped_early = False
        while not loop.finished:
            step, count = loop.step, loop.next_count()
            vote = 1.0 if session.stop_requested else 0.0
            called = time.perf_counter()
            mine, totals = train_steps(
                iterator,
                tf.constant(float(step), tf.float64),
                tf.constant(count, tf.int32),
                tf.constant(vote, tf.float32),
                tf.constant(loop.last_wall, tf.float32),
            )
            stop, measured = loop.advance(count, totals.numpy(), time.perf_counter() - called)
            if measured is not None and not ctx.hp.steps_per_execution and session.reporter is not None:
                steps_per_execution_event(
                    ctx, session.events, steps_per_execution(ctx.hp, measured), measured
                )
            # In lockstep every worker's step time is equal; its own share (the step minus the wait
            # for peers) is what singles out a straggler, whatever slows it. A stopping segment
            # checkpoints once, at its finish.
            session.after_steps(
                mine.numpy(),
                timer,
                samples=loop.samples,
                updates=loop.updates,
                samples_per_step=loop.global_batch,
                checkpoint_due=loop.checkpoint_due and not stop,
            )
            if stop:  # any worker's vote: all of them stop after the same call
                stopped_early = not loop.finished
                break
        timer.flush()
        ctx.finished_objects.extend([iterator, strategy, state, train_steps])
        return session.finish(samples=loop.samples, updates=loop.updates, stopped_early=stopped_early)


def _dataset_fn(ctx: NodeContext, problem: Any, samples: int) -> Any:
    """Each worker's shard of the training data, reshuffled by where the segment starts."""

    def dataset_fn(input_context: Any) -> Any:
        return problem.train_dataset(
            ctx.data_dir,
            batch_size=ctx.hp.batch_size,
            shard_index=input_context.input_pipeline_id,
            num_shards=input_context.num_input_pipelines,
            seed=ctx.spec.seed + samples,
        )

    return dataset_fn


def _compile_train_steps(
    strategy: Any, state: dict[str, Any], schedule: Schedule, global_batch: int, exchange: Any
) -> Any:
    """The graph function of one call: ``count`` steps from BSP step ``first_step``. Returns (this
    worker's per-step records (trainer.RECORD_COLUMNS), all-reduced [per-step losses..., stop votes,
    step seconds of all, wall seconds per step of the previous call of all])."""
    import tensorflow as tf

    def average_loss(outputs: Any, labels: Any) -> Any:
        return tf.nn.compute_average_loss(state["loss"](outputs, labels), global_batch_size=global_batch)

    replica_step = replica_step_fn(state["flat"], average_loss, exchange)

    def run_step(x: Any, y: Any, config: Any, started: Any) -> Any:
        loss, own, sent, _ = strategy.run(replica_step, args=(x, y, config, started))
        local = [strategy.experimental_local_results(value)[0] for value in (loss, own, sent)]
        return tf.stack([tf.cast(value, tf.float32) for value in local]), tf.constant(0.0)

    @tf.function(autograph=False)  # see timed_steps
    def train_steps(
        iterator: Any, first_step: Any, count: Any, stop_vote: Any, last_wall: Any
    ) -> tuple[Any, Any]:
        def step_at(j: Any) -> Any:
            return first_step + tf.cast(j, tf.float64)

        mine = timed_steps(iterator, count, schedule, step_at, run_step)
        votes = tf.stack([stop_vote, tf.reduce_sum(mine[:, STEP_SECONDS]), last_wall])
        totals = strategy.reduce(tf.distribute.ReduceOp.SUM, tf.concat([mine[:, 0], votes], 0), axis=None)
        return mine, totals

    return train_steps


class BspLoop:
    """BSP book-keeping in whole steps: where the segment is, how many steps the next call runs (one
    while the graph warms up, then sized on the all-reduced step time, never across a checkpoint
    boundary or the target), and every worker's agreement on when to stop."""

    def __init__(self, spec: Any, hp: Any, samples: int, updates: int) -> None:
        self.spec, self.hp = spec, hp
        self.global_batch = spec.num_workers * hp.batch_size
        self.samples, self.updates = samples, updates
        self.until_samples = spec.until_step * self.global_batch
        self.calls = 0
        self.step_seconds: float | None = None  # in-graph seconds per step, all workers' mean
        self.wall_per_step: float | None = None  # the previous call's wall seconds per step
        self.last_wall = 0.0  # this worker's, sent along with the next call to be all-reduced

    @property
    def step(self) -> int:
        return self.samples // self.global_batch

    @property
    def finished(self) -> bool:
        return self.samples >= self.until_samples

    @property
    def checkpoint_due(self) -> bool:
        return checkpoint_due_at(self.spec.ckpt_frequency, self.step) and not self.finished

    def next_count(self) -> int:
        warming = self.calls < WARMUP_EXECUTIONS + 1
        k = 1 if warming else _steps_per_call(self.hp, self.step_seconds, self.wall_per_step)
        to_checkpoint = _steps_to_checkpoint(self.spec.ckpt_frequency, self.step)
        return min(k, self.spec.until_step - self.step, to_checkpoint)

    def advance(self, count: int, totals: Any, wall_seconds: float) -> tuple[bool, float | None]:
        """Count a call of ``count`` steps from its all-reduced ``totals``. Returns whether any worker
        voted to stop, and the step time when it is measured for the first time (else None)."""
        self.last_wall = wall_seconds / count
        self.calls += 1
        self.samples += count * self.global_batch
        self.updates += count
        first = None
        if self.calls > 2:  # the first call traces the graph; the second reports its wall time
            # Both are all-reduced: every worker takes the same k, or the collectives part.
            measured = float(totals[count + 1]) / (count * self.spec.num_workers)
            self.wall_per_step = float(totals[count + 2]) / self.spec.num_workers
            first = measured if self.step_seconds is None else None
            self.step_seconds = measured
        return totals[count] > 0, first


def _steps_per_call(hp: Any, step_seconds: float | None, wall_per_step: float | None) -> int:
    """Steps per call: sized on the in-graph step time (the per-call overhead is amortized), and
    capped so that a call's wall time stays under MAX_CALL_SECONDS when automatic: each worker's
    timings are reported once per call, and the straggler detector needs them within its windows,
    whatever the in-graph time misses (a slow link's delays, say)."""
    k = steps_per_execution(hp, step_seconds)
    if hp.steps_per_execution or not wall_per_step:
        return k
    return max(1, min(k, int(MAX_CALL_SECONDS / wall_per_step)))


def _steps_to_checkpoint(frequency: int, step: int) -> int:
    """Steps from ``step`` to the next checkpoint boundary (a call never crosses one)."""
    if frequency <= 0:
        return 1 << 30
    return frequency - step % frequency


def checkpoint_due_at(frequency: int, step: int) -> bool:
    """Whether a checkpoint is written at ``step`` (the job's global step) every ``frequency`` steps."""
    return frequency > 0 and step % frequency == 0
