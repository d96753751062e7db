"""The training loops of one segment: BSP on MultiWorkerMirroredStrategy, ASP on ParameterServerStrategy.

Both loops share the same model, optimizer, checkpoint and schedule, so a checkpoint written by one
restores bit-identically in the other. Both count progress exactly in samples and stop exactly at the
segment's target (an early stop lands on a whole BSP-equivalent step).

Keras 3 ``fit`` does not work under ParameterServerStrategy, hence custom loops (stack-findings.md).
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from syncswitch import checkpoints, storage
from syncswitch.events import EventWriter
from syncswitch.hparams import HParams, learning_rate_at
from syncswitch.layout import RunLayout
from syncswitch.spec import SegmentSpec, switch_config

LOG_INTERVAL_SECONDS = 1.0
WORKER_EVENT_INTERVAL_SECONDS = 0.25
STOP_POLL_SECONDS = 1.0
KEEP_CHECKPOINTS = 5


@dataclass
class NodeContext:
    """What a training process knows about itself; built by syncswitch.node."""

    spec: SegmentSpec
    role: str
    task: int
    work_dir: str
    data_dir: str  # local folder prepared by the launcher ("" for in-memory problems)
    layout: RunLayout
    hp: HParams
    timings: dict[str, float] = field(default_factory=dict)
    # The distributed iterator, strategy and model of a finished loop. Freeing them tears down
    # prefetch threads and collectives, which took 4.5 s after a segment had ended (time in every
    # switch gap); the node exits with os._exit instead, so holding them here skips that teardown.
    finished_objects: list[Any] = field(default_factory=list)

    @property
    def is_chief(self) -> bool:
        return (self.role, self.task) in (("chief", 0), ("worker", 0) if self.spec.protocol == "bsp" else ())

    def events(self) -> EventWriter:
        return EventWriter(
            self.layout.segment_events(self.spec.index, self.spec.protocol, self.role, self.task),
            run_id=self.spec.run_id,
            segment=self.spec.index,
            protocol=self.spec.protocol,
            role=self.role,
            task=self.task,
        )


class StopSignal:
    """Polls the run folder for this segment's graceful-stop request in a background thread."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.reason: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="stop-signal", daemon=True)
        self._thread.start()

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def _poll(self) -> None:
        while not self._done.wait(STOP_POLL_SECONDS):
            try:
                if storage.exists(self.uri):
                    self.reason = storage.read_text(self.uri, default="").strip() or "stop requested"
                    return
            except Exception:  # noqa: BLE001 - a flaky read must not kill training; try again
                continue

    def close(self) -> None:
        self._done.set()


class Schedule:
    """LR and momentum as pure functions of progress (configuration policy + LR schedule)."""

    def __init__(self, spec: SegmentSpec, hp: HParams, start_step: float) -> None:
        self.spec, self.hp, self.start_step = spec, hp, start_step

    def at(self, step: float) -> tuple[float, float]:
        cfg = switch_config(
            self.spec.protocol,
            self.hp,
            self.spec.num_workers,
            self.spec.momentum_rule,
            self.spec.momentum_ramp_steps,
            step - self.start_step,
        )
        lr = learning_rate_at(self.hp, step, self.spec.total_steps) * cfg.learning_rate_scale
        return lr, cfg.momentum


class ProgressFile:
    """A small local file the launcher reads to show progress without parsing events."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, "progress.json")

    def write(self, **fields: Any) -> None:
        storage.write_json(self.path, fields)


# ---- model, optimizer, checkpoint -----------------------------------------------------------------


def build_training_state(ctx: NodeContext, problem: Any) -> dict[str, Any]:
    """Model, optimizer (all slots built: PSS needs every variable before the first schedule) and
    a checkpoint object. Call under the strategy's scope."""
    import tensorflow as tf

    from syncswitch.models import build_model
    from syncswitch.optim import SwitchableSGD

    model = build_model(ctx.hp, problem)
    optimizer = SwitchableSGD(nesterov=ctx.hp.optimizer_momentum_nesterov)
    optimizer.build(model.trainable_variables)
    samples = tf.Variable(0, dtype=tf.int64, trainable=False, name="samples")
    updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="updates")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, samples=samples, updates=updates)
    return {"model": model, "optimizer": optimizer, "checkpoint": checkpoint}


def build_and_restore(ctx: NodeContext, strategy: Any, problem: Any) -> tuple[dict, dict, dict]:
    """Model and optimizer under ``strategy``, restored from the latest checkpoint; records the
    cluster-ready and restored start-up marks. Returns (state, restored, signature)."""
    ctx.timings["cluster_ready"] = time.time()
    signature = checkpoints.signature(ctx.hp, problem)
    with strategy.scope():
        state = build_training_state(ctx, problem)
    restored = restore_latest(ctx, state, signature)
    ctx.timings["restored"] = time.time()
    return state, restored, signature


def weights_digest(state: dict[str, Any]) -> str:
    """SHA-256 over the model weights (BN statistics included) and the optimizer's velocity slots: the
    proof that a handoff between protocols restored bit-identical state."""
    import hashlib

    digest = hashlib.sha256()
    for variable in [*state["model"].weights, *state["optimizer"].momentums]:
        digest.update(variable.numpy().tobytes())
    return digest.hexdigest()


def restore_latest(ctx: NodeContext, state: dict[str, Any], signature: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest complete checkpoint; returns {samples, updates, uri} (zeros if none)."""
    manifest = checkpoints.latest(ctx.layout)
    if manifest is None:
        return {"samples": 0, "updates": 0, "uri": None}
    checkpoints.check_compatible(manifest, signature)
    prefix = checkpoints.fetch(manifest, ctx.work_dir)
    state["checkpoint"].read(prefix).assert_consumed()
    return {
        "samples": int(manifest["samples"]),
        "updates": int(manifest["updates"]),
        "uri": manifest["uri"],
        "digest": manifest.get("digest"),
        "restored_digest": weights_digest(state),
    }


def save(
    ctx: NodeContext,
    state: dict[str, Any],
    signature: dict[str, Any],
    *,
    samples: int,
    updates: int,
    global_batch: int,
    is_writer: bool,
    events: EventWriter | None,
) -> str:
    state["checkpoint"].samples.assign(samples)
    state["checkpoint"].updates.assign(updates)
    extra = {"segment": ctx.spec.index, "protocol": ctx.spec.protocol}
    if is_writer:
        extra["digest"] = weights_digest(state)
    uri, seconds = checkpoints.write(
        state["checkpoint"],
        ctx.layout,
        samples=samples,
        global_step=samples / global_batch,
        updates=updates,
        signature=signature,
        is_writer=is_writer,
        extra=extra,
    )
    if is_writer:
        checkpoints.prune(ctx.layout, KEEP_CHECKPOINTS)
        if events is not None:
            events.emit(
                "checkpoint", global_step=samples / global_batch, samples=samples, uri=uri, seconds=seconds
            )
    return uri


def loss_terms(model: Any, x: Any, y: Any, weight_decay: float) -> tuple[Any, Any]:
    """(per-example cross-entropy, weight-decay term). Call inside a GradientTape."""
    import keras

    from syncswitch.models import regularization_loss

    logits = model(x, training=True)
    per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return per_example, regularization_loss(model, weight_decay)


# ---- reporting ------------------------------------------------------------------------------------


class ChiefReporter:
    """Rate-limited `step` events, the progress file and the segment result, written by the chief."""

    def __init__(self, ctx: NodeContext, events: EventWriter, global_batch: int, start_samples: int) -> None:
        self.ctx, self.events, self.global_batch = ctx, events, global_batch
        self.progress = ProgressFile(ctx.work_dir)
        self.start_samples = start_samples
        self.started = time.time()
        self.first_step_at: float | None = None
        self._last_emit = 0.0
        self._last_samples = start_samples
        self._last_time = time.time()
        from syncswitch.tensorboard import TensorBoardWriter

        self.tensorboard = TensorBoardWriter(ctx.layout, ctx.spec.protocol)

    def step(
        self,
        *,
        samples: int,
        updates: int,
        loss: float,
        lr: float,
        momentum: float,
        step_time: float,
        force: bool = False,
    ) -> None:
        now = time.time()
        if self.first_step_at is None:
            self.first_step_at = now
        if not force and now - self._last_emit < LOG_INTERVAL_SECONDS:
            return
        elapsed = max(now - self._last_time, 1e-9)
        examples_per_sec = (samples - self._last_samples) / elapsed
        global_step = samples / self.global_batch
        self.events.emit(
            "step",
            global_step=global_step,
            samples=samples,
            updates=updates,
            loss=loss,
            examples_per_sec=examples_per_sec,
            step_time=step_time,
            learning_rate=lr,
            momentum=momentum,
        )
        self.tensorboard.scalars(
            global_step, loss=loss, examples_per_sec=examples_per_sec, learning_rate=lr, momentum=momentum
        )
        self.progress.write(
            global_step=global_step,
            until_step=self.ctx.spec.until_step,
            loss=loss,
            examples_per_sec=examples_per_sec,
            time=now,
        )
        self._last_emit, self._last_samples, self._last_time = now, samples, now

    def finish(
        self,
        *,
        samples: int,
        updates: int,
        stopped_early: bool,
        reason: str,
        checkpoint_uri: str,
        start_step: float,
        evaluation: dict[str, float] | None,
    ) -> dict[str, Any]:
        ended = time.time()
        seconds = ended - (self.first_step_at or ended)
        done = samples - self.start_samples
        result = {
            "index": self.ctx.spec.index,
            "protocol": self.ctx.spec.protocol,
            "run_id": self.ctx.spec.run_id,
            "start_step": start_step,
            "end_step": samples / self.global_batch,
            "until_step": self.ctx.spec.until_step,
            "samples": samples,
            "updates": updates,
            "num_workers": self.ctx.spec.num_workers,
            "started_at": self.ctx.timings.get("launch", self.started),
            "first_step_at": self.first_step_at,
            "ended_at": ended,
            "seconds": seconds,
            "examples_per_sec": done / seconds if seconds > 0 else 0.0,
            "stopped_early": stopped_early,
            "reason": reason,
            "checkpoint": checkpoint_uri,
            "startup": self._startup_split(),
            **(evaluation or {}),
        }
        self.events.emit(
            "segment_end",
            global_step=result["end_step"],
            samples=samples,
            updates=updates,
            seconds=seconds,
            examples_per_sec=result["examples_per_sec"],
            stopped_early=stopped_early,
            reason=reason,
        )
        if evaluation:
            self.events.emit("eval", global_step=result["end_step"], **evaluation)
            self.tensorboard.scalars(result["end_step"], **evaluation)
        self.tensorboard.close()
        storage.write_json(
            self.ctx.layout.segment_result(self.ctx.spec.index, self.ctx.spec.protocol), result
        )
        return result

    def _startup_split(self) -> dict[str, float]:
        """Launch -> first step, split into process start, cluster connect, restore, first step."""
        t = self.ctx.timings
        marks = [
            ("process_start", "launch", "imported"),
            ("cluster_connect", "imported", "cluster_ready"),
            ("restore", "cluster_ready", "restored"),
            ("first_step", "restored", "first_step"),
        ]
        if self.first_step_at is not None:
            t = {**t, "first_step": self.first_step_at}
        return {name: t[b] - t[a] for name, a, b in marks if a in t and b in t}


def segment_start_event(
    ctx: NodeContext, events: EventWriter, start_step: float, schedule: Schedule, restored: dict[str, Any]
) -> None:
    """The effective configuration of this segment, and what it restored from (with both digests)."""
    lr, momentum = schedule.at(start_step)
    events.emit(
        "segment_start",
        start_step=start_step,
        restored_from=restored["uri"],
        checkpoint_digest=restored.get("digest"),
        restored_digest=restored.get("restored_digest"),
        until_step=ctx.spec.until_step,
        num_workers=ctx.spec.num_workers,
        batch_per_worker=ctx.hp.batch_size,
        learning_rate=lr,
        momentum=momentum,
        momentum_rule=ctx.spec.momentum_rule,
    )
    print(
        f"[{ctx.spec.run_id}] segment {ctx.spec.index} ({ctx.spec.protocol}) starts at step "
        f"{start_step:g} -> {ctx.spec.until_step}: lr={lr:.5g} momentum={momentum:.4g} "
        f"batch/worker={ctx.hp.batch_size} workers={ctx.spec.num_workers} "
        f"momentum_rule={ctx.spec.momentum_rule}",
        flush=True,
    )


def evaluate_if_asked(ctx: NodeContext, checkpoint_uri: str) -> dict[str, float] | None:
    """{test_accuracy, test_loss} of the segment's final checkpoint when the spec asks for it."""
    if not ctx.spec.evaluate:
        return None
    from syncswitch.evaluate import evaluate_checkpoint_uri

    scores = evaluate_checkpoint_uri(checkpoint_uri, ctx.hp, ctx.spec.problem, ctx.data_dir, ctx.work_dir)
    return {"test_accuracy": scores["test_accuracy"], "test_loss": scores["test_loss"]}


# ---- BSP ------------------------------------------------------------------------------------------


def run_bsp_worker(ctx: NodeContext, problem: Any) -> dict[str, Any] | None:
    """One MultiWorkerMirroredStrategy worker; worker 0 is the chief. Returns the result on the chief."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    state, restored, signature = build_and_restore(ctx, strategy, problem)
    spec, hp = ctx.spec, ctx.hp
    global_batch = spec.num_workers * hp.batch_size
    model, optimizer = state["model"], state["optimizer"]
    samples, updates = restored["samples"], restored["updates"]
    until_samples = spec.until_step * global_batch
    start_step = samples / global_batch
    schedule = Schedule(spec, hp, start_step)

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        return problem.train_dataset(
            ctx.data_dir,
            batch_size=hp.batch_size,
            shard_index=input_context.input_pipeline_id,
            num_shards=input_context.num_input_pipelines,
            seed=spec.seed + samples,
        )

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    replicas = strategy.num_replicas_in_sync

    def step_fn(inputs: Any, lr: Any, momentum: Any, stop_flag: Any) -> tuple[Any, Any, Any]:
        x, y = inputs
        started = tf.timestamp()
        with tf.control_dependencies([started]), tf.GradientTape() as tape:
            per_example, decay = loss_terms(model, x, y, hp.weight_decay)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch) + decay / replicas
        grads = tape.gradient(loss, model.trainable_variables)
        with tf.control_dependencies(grads):
            computed = tf.timestamp()
        optimizer.set_step_hparams(lr, momentum)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss, computed, stop_flag

    @tf.function
    def train_step(iterator: Any, lr: Any, momentum: Any, stop_flag: Any) -> tuple[Any, Any, Any]:
        loss, computed, stop = strategy.run(step_fn, args=(next(iterator), lr, momentum, stop_flag))
        # One all-reduce carries both the loss and the stop vote, so every worker stops at the same step.
        totals = strategy.reduce(tf.distribute.ReduceOp.SUM, tf.stack([loss, stop]), axis=None)
        with tf.control_dependencies([totals]):
            reduced = tf.timestamp()
        # From the end of this worker's backward pass to the end of the step's collectives: time spent
        # waiting for peers. A straggler waits little; its peers wait for it.
        peer_wait = reduced - strategy.experimental_local_results(computed)[0]
        return totals[0], totals[1], peer_wait

    events = ctx.events()
    stop_signal = StopSignal(ctx.layout.stop_request(spec.index)) if ctx.is_chief else None
    reporter = ChiefReporter(ctx, events, global_batch, samples) if ctx.is_chief else None
    if ctx.is_chief:
        segment_start_event(ctx, events, start_step, schedule, restored)
    worker_timer = WorkerTimer(events, ctx.task)
    stopped_early, reason, checkpoint_uri = False, "reached until_step", restored["uri"]

    def checkpoint_now() -> str:  # every worker writes (collective); the chief uploads
        return save(
            ctx,
            state,
            signature,
            samples=samples,
            updates=updates,
            global_batch=global_batch,
            is_writer=ctx.is_chief,
            events=events,
        )

    try:
        while samples < until_samples:
            step = samples / global_batch
            lr, momentum = schedule.at(step)
            vote = 1.0 if stop_signal is not None and stop_signal.requested else 0.0
            began = time.perf_counter()
            loss, stop, peer_wait = train_step(
                iterator,
                tf.constant(lr, tf.float32),
                tf.constant(momentum, tf.float32),
                tf.constant(vote, tf.float32),
            )
            loss = float(loss)
            step_time = time.perf_counter() - began
            samples += global_batch
            updates += 1
            # In lockstep every worker's step time is equal; its own share (the step minus waiting for
            # peers) is what singles out a straggler, whatever slows it (compute, input, a frozen process).
            wait_time = min(float(peer_wait), step_time)
            worker_timer.record(
                global_step=samples / global_batch,
                step_time=step_time,
                compute_time=step_time - wait_time,
                wait_time=wait_time,
            )
            if reporter is not None:
                reporter.step(
                    samples=samples, updates=updates, loss=loss, lr=lr, momentum=momentum, step_time=step_time
                )
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {samples / global_batch:g}")
            if float(stop) > 0:
                stopped_early = True
                reason = (
                    stop_signal.reason if stop_signal is not None and stop_signal.reason else "stop requested"
                )
                break
            if _checkpoint_due(spec, samples // global_batch) and samples < until_samples:
                checkpoint_uri = checkpoint_now()
        if samples != restored["samples"] or checkpoint_uri is None:
            checkpoint_uri = checkpoint_now()
        worker_timer.flush()
        ctx.finished_objects.extend([iterator, strategy, state, train_step])
        if reporter is None:
            return None
        return reporter.finish(
            samples=samples,
            updates=updates,
            stopped_early=stopped_early,
            reason=reason,
            checkpoint_uri=checkpoint_uri,
            start_step=start_step,
            evaluation=evaluate_if_asked(ctx, checkpoint_uri),
        )
    finally:
        if stop_signal is not None:
            stop_signal.close()
        events.close()


def _checkpoint_due(spec: SegmentSpec, step: int) -> bool:
    return spec.ckpt_frequency > 0 and step % spec.ckpt_frequency == 0


class WorkerTimer:
    """Per-worker `worker_step` events (the straggler detector's input), averaged over ~0.25 s."""

    def __init__(self, events: EventWriter, worker: int) -> None:
        self.events, self.worker = events, worker
        self._steps: list[tuple[float, float, float]] = []
        self._last_emit = time.monotonic()
        self._global_step = 0.0

    def record(
        self, *, global_step: float, step_time: float, compute_time: float, wait_time: float | None = None
    ) -> None:
        wait = max(step_time - compute_time, 0.0) if wait_time is None else wait_time
        self._steps.append((step_time, compute_time, wait))
        self._global_step = global_step
        if time.monotonic() - self._last_emit >= WORKER_EVENT_INTERVAL_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self._steps:
            return
        count = len(self._steps)
        step_time, compute_time, wait_time = (
            sum(column) / count for column in zip(*self._steps, strict=True)
        )
        self.events.emit(
            "worker_step",
            worker=self.worker,
            global_step=self._global_step,
            steps=count,
            step_time=step_time,
            compute_time=compute_time,
            wait_time=wait_time,
        )
        self._steps.clear()
        self._last_emit = time.monotonic()


# ---- ASP ------------------------------------------------------------------------------------------


def run_asp_chief(ctx: NodeContext, problem: Any) -> dict[str, Any]:
    """The ParameterServerStrategy coordinator: schedules one closure per worker update, exactly as
    many as the segment's target needs, and keeps the global step itself (Keras' optimizer counter
    loses increments under ASP)."""
    import tensorflow as tf

    # A worker killed mid-RPC can surface as an UnknownError "Graph execution error"; TF retries it
    # as a worker failure only when asked to (b/216666282 in cluster_coordinator.py).
    os.environ.setdefault("TF_PS_HANDLE_UNKNOWN_ERROR", "1")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    state, restored, signature = build_and_restore(ctx, strategy, problem)
    spec, hp = ctx.spec, ctx.hp
    batch, global_batch = hp.batch_size, spec.num_workers * hp.batch_size
    model, optimizer = state["model"], state["optimizer"]
    start_samples, start_updates = restored["samples"], restored["updates"]
    start_step = start_samples / global_batch
    schedule = Schedule(spec, hp, start_step)

    def dataset_fn() -> tf.data.Dataset:
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return problem.train_dataset(
            ctx.data_dir,
            batch_size=batch,
            shard_index=worker,
            num_shards=spec.num_workers,
            seed=spec.seed + start_samples,
        )

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_step(x: Any, y: Any, lr: Any, momentum: Any) -> tuple[Any, ...]:
        started = tf.timestamp()
        with tf.control_dependencies([started]), tf.GradientTape() as tape:
            per_example, decay = loss_terms(model, x, y, hp.weight_decay)
            loss = tf.reduce_mean(per_example) + decay
        grads = tape.gradient(loss, model.trainable_variables)
        with tf.control_dependencies(grads):
            computed = tf.timestamp()
        optimizer.set_step_hparams(lr, momentum)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        finished = tf.timestamp()  # automatic control deps: after the variable updates
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return loss, worker, computed - started, finished - started

    @tf.function
    def worker_step(iterator: Any, lr: Any, momentum: Any) -> tuple[Any, ...]:
        # The Keras optimizer needs a replica context, which strategy.run provides on the worker.
        x, y = next(iterator)
        return strategy.run(replica_step, args=(x, y, lr, momentum))

    events = ctx.events()
    stop_signal = StopSignal(ctx.layout.stop_request(spec.index))
    reporter = ChiefReporter(ctx, events, global_batch, start_samples)
    watchdog = Watchdog(ctx, events)
    segment_start_event(ctx, events, start_step, schedule, restored)
    loop = AspLoop(spec, batch, global_batch, start_samples)
    checkpoint_uri = restored["uri"]
    timers = {w: WorkerTimer(events, w) for w in range(spec.num_workers)}

    def checkpoint_now() -> str:  # only the coordinator writes under PSS
        return save(
            ctx,
            state,
            signature,
            samples=loop.done_samples,
            updates=start_updates + loop.done,
            global_batch=global_batch,
            is_writer=True,
            events=events,
        )

    try:
        while True:
            if stop_signal.requested:
                loop.request_stop()  # may finish the loop at once, when nothing is in flight
            if loop.finished:
                break
            while loop.may_schedule():
                lr, momentum = schedule.at(loop.scheduled_samples / global_batch)
                args = (iterator, tf.constant(lr, tf.float32), tf.constant(momentum, tf.float32))
                loop.add(schedule_closure(coordinator, worker_step, args), lr, momentum)
            collected = loop.collect()
            if collected is None:
                if loop.lost == 1:
                    print(f"[{spec.run_id}] worker lost mid-step; rescheduling its closures", flush=True)
                continue
            loss, worker, compute_time, step_time, lr, momentum = collected
            timers[worker].record(
                global_step=loop.done_samples / global_batch, step_time=step_time, compute_time=compute_time
            )
            watchdog.seen(worker)
            reporter.step(
                samples=loop.done_samples,
                updates=start_updates + loop.done,
                loss=loss,
                lr=lr,
                momentum=momentum,
                step_time=step_time,
            )
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {loop.done_samples / global_batch:g}")
            if loop.at_checkpoint_boundary():
                checkpoint_uri = checkpoint_now()
        coordinator.join()
        if loop.done or checkpoint_uri is None:
            checkpoint_uri = checkpoint_now()
        for timer in timers.values():
            timer.flush()
        ctx.finished_objects.extend([iterator, coordinator, strategy, state, worker_step])
        stopped_early = loop.stopping and loop.done_samples < loop.until_samples
        reason = (stop_signal.reason or "stop requested") if stopped_early else "reached until_step"
        return reporter.finish(
            samples=loop.done_samples,
            updates=start_updates + loop.done,
            stopped_early=stopped_early,
            reason=reason,
            checkpoint_uri=checkpoint_uri,
            start_step=start_step,
            evaluation=evaluate_if_asked(ctx, checkpoint_uri),
        )
    finally:
        stop_signal.close()
        watchdog.close()
        events.close()


class AspLoop:
    """Book-keeping of scheduled and completed ASP closures.

    Never schedules past the segment target or past the next checkpoint boundary, so the segment ends
    exactly on target and checkpoints capture a drained, consistent state. An early stop is rounded up
    to the next whole BSP-equivalent step so a following BSP segment stays on step boundaries.
    """

    def __init__(self, spec: SegmentSpec, batch: int, global_batch: int, start_samples: int) -> None:
        self.batch, self.global_batch = batch, global_batch
        self.start_samples = start_samples
        self.until_samples = spec.until_step * global_batch
        self.limit = max((self.until_samples - start_samples) // batch, 0)
        self.ckpt_updates = spec.ckpt_frequency * spec.num_workers  # closures per checkpoint interval
        self.window = max(4 * spec.num_workers, 8)
        self.scheduled = 0
        self.done = 0
        self.lost = 0  # closures handed back after their worker was lost
        self.stopping = False
        self._inflight: collections.deque = collections.deque()

    @property
    def finished(self) -> bool:
        return self.done >= self.limit

    @property
    def done_samples(self) -> int:
        return self.start_samples + self.done * self.batch

    @property
    def scheduled_samples(self) -> int:
        return self.start_samples + self.scheduled * self.batch

    def _next_boundary(self) -> int:
        if self.ckpt_updates <= 0:
            return self.limit
        done_steps = self.done_samples
        next_ckpt_samples = (
            (done_steps // (self.ckpt_updates * self.batch) + 1) * self.ckpt_updates * self.batch
        )
        return min(self.limit, (next_ckpt_samples - self.start_samples) // self.batch)

    def may_schedule(self) -> bool:
        return self.scheduled < self._next_boundary() and len(self._inflight) < self.window

    def add(self, remote_value: Any, lr: float, momentum: float) -> None:
        self._inflight.append((remote_value, lr, momentum))
        self.scheduled += 1

    def collect(self) -> tuple[float, int, float, float, float, float] | None:
        """Fetch a finished closure, preferring any that is ready so a straggler's closure at the
        head of the queue does not stall bookkeeping of the others.

        Returns None when the closure was lost with a worker: it is handed back to be scheduled
        again, so the segment still ends exactly on target.
        """
        index = next((i for i, (rv, _, _) in enumerate(self._inflight) if _is_ready(rv)), 0)
        remote_value, lr, momentum = self._inflight[index]
        del self._inflight[index]
        try:
            loss, worker, compute_time, step_time = remote_value.fetch()
        except Exception as exc:
            if not is_lost_worker_error(exc) or self.lost >= MAX_LOST_CLOSURES:
                raise
            self.lost += 1
            self.scheduled -= 1
            return None
        self.done += 1
        return float(loss), int(worker), float(compute_time), float(step_time), lr, momentum

    def request_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        # Closures already scheduled will run; round up to a whole BSP-equivalent step. Segments start
        # on step boundaries, so counting closures from the segment start is enough.
        per_step = self.global_batch // self.batch
        self.limit = min(self.limit, -(-self.scheduled // per_step) * per_step)

    def at_checkpoint_boundary(self) -> bool:
        if self.ckpt_updates <= 0 or self.finished or self._inflight:
            return False
        return (self.done_samples // self.batch) % self.ckpt_updates == 0


# A closure lost with its worker is rescheduled; this many in one segment means something else is
# wrong (every worker keeps failing), and the error is raised instead.
MAX_LOST_CLOSURES = 1000


def is_lost_worker_error(exc: BaseException) -> bool:
    """An error that says a closure died with its worker (connection reset, worker gone, closure
    cancelled because of it), not that the step itself is broken.

    ClusterCoordinator retries most of these itself, but a worker killed mid-RPC can surface as an
    UnknownError it does not classify, which would otherwise fail the whole segment; the closures it
    then cancels come back as CancelledError.
    """
    import tensorflow as tf

    message = str(exc)
    if isinstance(exc, tf.errors.CancelledError):
        return True
    if not isinstance(exc, tf.errors.UnknownError | tf.errors.UnavailableError | tf.errors.AbortedError):
        return False
    return "/job:worker" in message and "/job:ps" not in message


def schedule_closure(coordinator: Any, fn: Any, args: tuple) -> Any:
    """coordinator.schedule, once more if it raises the error a lost worker left behind (schedule
    re-raises a failed closure's error once, then clears it)."""
    try:
        return coordinator.schedule(fn, args=args)
    except Exception as exc:
        if not is_lost_worker_error(exc):
            raise
        return coordinator.schedule(fn, args=args)


def _is_ready(remote_value: Any) -> bool:
    # RemoteValue has no public non-blocking readiness check; this event is set when its value (or
    # error) arrives. Without it we fall back to fetching in order.
    event = getattr(remote_value, "_status_available_event", None)
    return event.is_set() if event is not None else True


class Watchdog:
    """Kills ASP workers that make no progress: a frozen worker would hang ``join()`` forever, while a
    dead one is something ParameterServerStrategy handles (its closures re-run elsewhere).

    The coordinator cannot kill processes on other hosts, so it files a kill request in the work
    folder; the node supervisor (the local launcher, or the node agent on a VM) acts on it.
    """

    def __init__(self, ctx: NodeContext, events: EventWriter) -> None:
        self.ctx, self.events = ctx, events
        self.timeout = ctx.spec.watchdog_seconds
        now = time.monotonic()
        self.last_seen = dict.fromkeys(range(ctx.spec.num_workers), now)
        self.killed: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def seen(self, worker: int) -> None:
        self.last_seen[worker] = time.monotonic()

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            now = time.monotonic()
            latest = max(self.last_seen.values())
            for worker, seen in self.last_seen.items():
                # Only while others progress: a cluster-wide stall is not one worker's fault.
                if worker in self.killed or now - seen < self.timeout or now - latest > self.timeout / 2:
                    continue
                self.killed.add(worker)
                reason = f"no completed step for {now - seen:.0f}s while other workers progressed"
                storage.write_text(os.path.join(self.ctx.work_dir, f"kill-worker-{worker}"), reason)
                self.events.emit("watchdog", worker=worker, reason=reason)
                print(
                    f"[{self.ctx.spec.run_id}] watchdog: worker {worker} stalled, asking for kill: {reason}",
                    flush=True,
                )

    def close(self) -> None:
        self._done.set()
