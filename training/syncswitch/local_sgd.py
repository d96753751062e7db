"""The local SGD loop: each worker trains a replica of its own; every H steps the replicas are averaged.

Every worker builds the model as variables of its own (no strategy scope: trainer.build_training_state)
and restores the same checkpoint, so the replicas start equal. A call runs up to H steps on this
worker's replica in a graph loop (``trainer.timed_steps``, each update applied locally:
syncswitch.exchange.LocalExchange) on this worker's shard of the data, at the global batch's learning
rate (the configuration policy: spec.switch_config). Where the call ends an averaging period, one
all-reduce (MultiWorkerMirroredStrategy, RING) averages the replica's whole state: the weights, every
optimizer slot (momentum SGD's velocities, Adam's first and second moments) and the batch-norm
statistics. Slots are averaged with the weights so that a checkpoint holds one optimizer state per
weight, as every other protocol's does: with momentum SGD, averaged after every step (H=1), that is
BSP's update (its gradient all-reduce and the momentum update are linear in the gradient); Adam's
update is not linear in the gradient, so local Adam at H=1 is close to BSP's, not equal. Every
replica applies one update per step, so Adam's bias correction counts steps, as BSP's does.

Periods count from the segment's start. A checkpoint, the segment's end and a graceful stop average
too, whatever the period (a checkpoint holds one model); each average is an ``average`` event of the
chief (its step, the steps since the last one, the bytes). Steps per call are sized as BSP's, and
cut at the next average. Worker loss fails the segment, as in BSP: the next average's collective
aborts.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from syncswitch.bsp import BspLoop, checkpoint_due_at, ring_all_reduce_strategy
from syncswitch.context import NodeContext
from syncswitch.exchange import LocalExchange, payload_bytes
from syncswitch.peers import probe_peers_of
from syncswitch.reporting import WorkerTimer
from syncswitch.trainer import (
    RECORD_COLUMNS,
    STEP_SECONDS,
    Schedule,
    SegmentSession,
    build_and_restore,
    replica_step_fn,
    steps_per_execution,
    steps_per_execution_event,
    timed_steps,
)

BYTES_SENT = RECORD_COLUMNS.index("bytes_sent")


def run_local_sgd_worker(ctx: NodeContext, problem: Any) -> dict[str, Any] | None:
    """One local SGD worker (MultiWorkerMirroredStrategy for the averages only). Returns the segment
    result on the chief."""
    strategy = ring_all_reduce_strategy()
    training = build_and_restore(ctx, None, problem)  # this worker's own replica
    state, restored, _signature = training
    loop = LocalSgdLoop(ctx.spec, ctx.hp, restored["samples"], restored["updates"])
    # One update per replica per step, as BSP's: the update numbers (Adam's bias correction) follow
    # the steps, the same on every replica.
    schedule = Schedule(ctx.spec, ctx.hp, loop.samples / loop.global_batch, start_updates=loop.updates)
    iterator = iter(
        problem.train_dataset(
            ctx.data_dir,
            batch_size=ctx.hp.batch_size,
            shard_index=ctx.task,  # a worker's shard, as BSP's input pipeline gives it
            num_shards=ctx.spec.num_workers,
            seed=ctx.spec.seed + loop.samples,
        )
    )
    calls = LocalCalls(strategy, state, schedule)
    with (
        SegmentSession(ctx, training, schedule, loop.global_batch, reports=ctx.is_chief) as session,
        contextlib.closing(probe_peers_of(ctx.task)) as probe,
    ):
        timer = WorkerTimer(session.events, ctx.task, probe=probe)
        stopped_early = False
        while not loop.finished:
            step, count = loop.step, loop.next_count()
            average = loop.averages_after(count)
            vote = 1.0 if session.stop_requested else 0.0
            called = time.perf_counter()
            mine, totals = calls.train(iterator, step, count, vote, loop.last_wall, average)
            records = mine.numpy()
            stop, measured = loop.advance(count, totals.numpy(), time.perf_counter() - called, average)
            if stop and not average:  # every worker saw the vote: all average once more, then stop
                calls.average_only()
                loop.averaged()
                average = True
            if average:
                records[-1, BYTES_SENT] += calls.average_bytes
                if session.reporter is not None:
                    session.events.emit(
                        "average", global_step=loop.step, steps=loop.last_period, bytes=calls.average_bytes
                    )
            if measured is not None and not ctx.hp.steps_per_execution and session.reporter is not None:
                steps_per_execution_event(
                    ctx, session.events, steps_per_execution(ctx.hp, measured), measured
                )
            session.after_steps(
                records,
                timer,
                samples=loop.samples,
                updates=loop.updates,
                samples_per_step=loop.global_batch,
                checkpoint_due=loop.checkpoint_due and not stop,
            )
            if stop:
                stopped_early = not loop.finished
                break
        timer.flush()
        ctx.finished_objects.extend([iterator, strategy, state, calls])
        return session.finish(
            samples=loop.samples,
            updates=loop.updates,
            stopped_early=stopped_early,
            extra={"averaging": {"period": loop.period, "averages": loop.averages}},
        )


class LocalCalls:
    """The compiled calls of a local SGD worker: ``train`` (k local steps, then the average where
    asked, then the all-reduce of the call's losses and votes, as BSP's) and ``average_only``.
    ``average_bytes``: the bytes of the state vector this worker hands to an average."""

    def __init__(self, strategy: Any, state: dict[str, Any], schedule: Schedule) -> None:
        import tensorflow as tf

        flat = state["flat"]
        self.average_bytes = payload_bytes([flat.state_vector()])

        def mean_loss(outputs: Any, labels: Any) -> Any:
            return tf.reduce_mean(state["loss"](outputs, labels))

        replica_step = replica_step_fn(flat, mean_loss, LocalExchange(flat))

        def run_step(x: Any, y: Any, config: Any, started: Any) -> Any:
            loss, own, sent, _ = replica_step(x, y, config, started)
            return tf.stack([tf.cast(loss, tf.float32), tf.cast(own, tf.float32), sent]), tf.constant(0.0)

        def average() -> Any:
            return flat.assign_state_vector(
                strategy.reduce(tf.distribute.ReduceOp.MEAN, flat.state_vector(), axis=None)
            )

        # Two traces, with and without the average: its collective must not sit in a graph branch.
        @tf.function(autograph=False)  # see timed_steps
        def train(
            iterator: Any, first_step: Any, count: Any, stop_vote: Any, last_wall: Any, average_after: bool
        ) -> tuple[Any, Any]:
            def step_at(j: Any) -> Any:
                return first_step + tf.cast(j, tf.float64)

            mine = timed_steps(iterator, count, schedule, step_at, run_step)
            done = [average()] if average_after else []
            votes = tf.stack([stop_vote, tf.reduce_sum(mine[:, STEP_SECONDS]), last_wall])
            with tf.control_dependencies([mine, *done]):
                totals = strategy.reduce(
                    tf.distribute.ReduceOp.SUM, tf.concat([mine[:, 0], votes], 0), axis=None
                )
            return mine, totals

        self._train = train
        self.average_only = tf.function(average, autograph=False)

    def train(
        self, iterator: Any, step: int, count: int, vote: float, last_wall: float, average: bool
    ) -> tuple[Any, Any]:
        import tensorflow as tf

        return self._train(
            iterator,
            tf.constant(float(step), tf.float64),
            tf.constant(count, tf.int32),
            tf.constant(vote, tf.float32),
            tf.constant(last_wall, tf.float32),
            average,
        )


class LocalSgdLoop(BspLoop):
    """BSP's book-keeping (steps per call, checkpoints, stop votes) plus the averaging periods: a call
    never runs past the next average, which comes every ``period`` steps of the segment and at every
    checkpoint and the segment's end."""

    def __init__(self, spec: Any, hp: Any, samples: int, updates: int) -> None:
        super().__init__(spec, hp, samples, updates)
        self.period = spec.segment_protocol.period
        self.since_average = 0
        self.last_period = 0  # steps between the last two averages
        self.averages = 0

    def next_count(self) -> int:
        return min(super().next_count(), self.period - self.since_average)

    def averages_after(self, count: int) -> bool:
        """Whether the call of ``count`` steps from here ends with an average."""
        step = self.step + count
        period_ends = self.since_average + count >= self.period
        return (
            period_ends or step >= self.spec.until_step or checkpoint_due_at(self.spec.ckpt_frequency, step)
        )

    def advance(
        self, count: int, totals: Any, wall_seconds: float, averaged: bool = False
    ) -> tuple[bool, float | None]:
        outcome = super().advance(count, totals, wall_seconds)
        self.since_average += count
        if averaged:
            self.averaged()
        return outcome

    def averaged(self) -> None:
        self.last_period, self.since_average = self.since_average, 0
        self.averages += 1
