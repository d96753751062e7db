"""What the two training loops share: the schedule, the in-graph loop of one execution,
model/optimizer/checkpoint, the graceful-stop signal and ``SegmentSession``, which runs a segment's
book-keeping. The node's context is ``syncswitch.context``; what a segment reports (progress, step
events, per-worker timing, the result) is ``syncswitch.reporting``.

The loops themselves are ``syncswitch.bsp`` (MultiWorkerMirroredStrategy) and ``syncswitch.asp``
(ParameterServerStrategy + ClusterCoordinator). Both use the same model, optimizer, checkpoint and
schedule, so a checkpoint written by one restores bit-identically in the other. Both count progress
exactly in samples and stop exactly at the segment's target (an early stop lands on a whole
BSP-equivalent step). Both run several optimizer steps per ``tf.function`` execution (an ASP closure,
a BSP call): ``steps_per_execution`` below.

Keras 3 ``fit`` does not work under ParameterServerStrategy, hence custom loops (stack-findings.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from syncswitch import checkpoints, storage
from syncswitch.context import NodeContext
from syncswitch.events import EventWriter
from syncswitch.hooks import HookRunner
from syncswitch.hparams import HParams, PythonOps, learning_rate_at
from syncswitch.reporting import ChiefReporter, StepBook, WorkerTimer
from syncswitch.spec import SegmentSpec, examples_per_update, second_moment_scale, switch_config

STOP_POLL_SECONDS = 1.0
KEEP_CHECKPOINTS = 5
# Several optimizer steps run in one tf.function execution (an ASP closure, a BSP call), sized so that
# one execution takes about this long, waits included (steps are timed with them: see timed_steps):
# each execution pays fixed costs (ASP: the coordinator's dispatch and fetch round trips; BSP: a host
# sync and the stop-vote collective), which this amortizes.
TARGET_EXECUTION_SECONDS = 0.33
MAX_STEPS_PER_EXECUTION = 64
# Executions of one step each, per worker, whose timing picks the automatic size.
WARMUP_EXECUTIONS = 2
# The record of one optimizer step, a row of what every step function returns (``timed_steps``): its
# loss, this worker's own seconds (input, forward, backward), the step's seconds (waits included),
# the bytes this worker sent (syncswitch.exchange), and its clock's lead over the slowest worker's
# when it started (SSP's staleness; 0 elsewhere).
RECORD_COLUMNS = ("loss", "own_seconds", "step_seconds", "bytes_sent", "clock_lead")
RECORD_WIDTH = len(RECORD_COLUMNS)
STEP_SECONDS = RECORD_COLUMNS.index("step_seconds")
CLOCK_LEAD = RECORD_COLUMNS.index("clock_lead")


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


class TensorOps:
    """PythonOps (syncswitch.hparams) in TensorFlow: the schedule formula, built into the step graph."""

    @staticmethod
    def cos(value: Any) -> Any:
        import tensorflow as tf

        return tf.cos(value)

    @staticmethod
    def clip(value: Any, low: float, high: float) -> Any:
        import tensorflow as tf

        return tf.clip_by_value(value, low, high)

    @staticmethod
    def where(condition: Any, if_true: Any, if_false: Any) -> Any:
        import tensorflow as tf

        return tf.where(condition, if_true, if_false)


class Schedule:
    """LR and momentum as pure functions of progress (configuration policy + LR schedule): ``at`` in
    Python (for logs), ``tensors`` in a step graph (per optimizer step, inside a multi-step execution).
    Both evaluate the one formula of syncswitch.hparams / syncswitch.spec.

    The segment starts at ``start_step`` with ``start_updates`` optimizer updates done in the job (the
    checkpoint's counters) and applies ``updates_per_step`` updates per BSP-equivalent step (BSP 1,
    ASP N): each step's update number, Adam's bias-correction count, follows from its progress."""

    def __init__(
        self,
        spec: SegmentSpec,
        hp: HParams,
        start_step: float,
        *,
        start_updates: int = 0,
        updates_per_step: int = 1,
    ) -> None:
        self.spec, self.hp, self.start_step = spec, hp, start_step
        self.start_updates, self.updates_per_step = start_updates, updates_per_step

    def _evaluate(self, step: Any, ops: Any) -> tuple[Any, Any]:
        cfg = switch_config(
            self.spec.protocol,
            self.hp,
            self.spec.num_workers,
            self.spec.momentum_rule,
            self.spec.momentum_ramp_steps,
            step - self.start_step,
            ops=ops,
        )
        lr = learning_rate_at(self.hp, step, self.spec.total_steps, ops=ops) * cfg.learning_rate_scale
        return lr, cfg.momentum

    def at(self, step: float) -> tuple[float, float]:
        return self._evaluate(float(step), PythonOps)

    def tensors(self, step: Any) -> Any:
        """The optimizer's StepConfig (syncswitch.optim) as float32 tensors at a float64 ``step``
        tensor: LR and momentum (Adam's beta1), beta2 and epsilon, and the step's update number in
        the job, counted from 1."""
        import tensorflow as tf

        from syncswitch.optim import StepConfig

        lr, momentum = self._evaluate(step, TensorOps)
        done = tf.round((step - self.start_step) * self.updates_per_step)  # exact: progress is in samples
        return StepConfig(
            learning_rate=tf.cast(lr, tf.float32),
            momentum=tf.cast(momentum, tf.float32),
            beta2=tf.constant(self.hp.optimizer_adam_beta2, tf.float32),
            epsilon=tf.constant(self.hp.optimizer_adam_epsilon, tf.float32),
            update=tf.cast(self.start_updates + done + 1.0, tf.float32),
        )


def replica_step_fn(flat: Any, loss_fn: Any, exchange: Any, after_update: Any = None) -> Any:
    """The step every protocol runs on a replica: loss and gradients, their exchange
    (syncswitch.exchange: all-reduced, compressed, or none where the update runs on the parameter
    servers or on a local replica), then the update. Returns the loss, the seconds from ``started``
    to the gradients (this worker's own compute), the bytes sent, and what ``after_update(update
    ops)`` returns once the update is applied (SSP's clock; 0 without it)."""
    import tensorflow as tf

    def replica_step(x: Any, y: Any, config: Any, started: Any) -> tuple[Any, Any, Any, Any]:
        loss, grads, statistics = flat.loss_and_gradients(x, y, loss_fn)
        with tf.control_dependencies(grads):
            computed = tf.timestamp()
        grads, sent = exchange.reduce(grads)
        updates = flat.apply(grads, statistics, config, summed=exchange.summed)
        after = after_update(updates) if after_update is not None else tf.constant(0.0)
        return loss, computed - started, tf.constant(float(sent)), after

    return replica_step


def timed_steps(
    iterator: Any, count: Any, schedule: Schedule, step_at: Any, run_step: Any, gate: Any = None
) -> Any:
    """The in-graph loop of one execution (call it inside a ``tf.function``): ``count`` steps, each
    timed from before it takes its input. ``step_at(j)``: the j-th step's progress for the schedule
    (float64); ``run_step(x, y, config, started)``: its [loss, own seconds, bytes sent] as float32,
    and the gate's value for the next step (SSP's clock lead; 0 without a gate); ``config`` is the
    optimizer's StepConfig of that step (``Schedule.tensors``). With a ``gate`` (syncswitch.ssp), a
    step starts only while ``gate.allows(lead)``; the loop ends at the first that may not, so it may
    run fewer than ``count`` steps. Returns one record per step run (RECORD_COLUMNS), shape [steps
    run, RECORD_WIDTH].

    A step lasts until the next one starts (the last one until the loop has ended): an iteration
    begins only once every stateful op of the one before has run (automatic control dependencies),
    so this holds the update, and with it BSP's all-reduce (the wait for the peers) and ASP's
    parameter-server round trips. No timestamp follows the update inside a step: it would need a
    control dependency on the update, which slows BSP's step; and a step timed to its gradients only
    would leave BSP's waits between the timed steps.

    An explicit ``tf.while_loop``, so that the step functions are traced with ``autograph=False``:
    AutoGraph would rewrite the Python source of every function a step calls (ours, the model's
    layers, the optimizer's) on each node at its first step, the largest share of its tracing.
    Keras 3 layers have no Python control flow on tensors (they also run under JAX), so nothing needs
    it; a user model that does is refused before provisioning by the user-code check, which traces
    its forward and backward pass the same way (syncswitch.check)."""
    import tensorflow as tf

    def step(j: Any, lead: Any, records: Any, starts: Any) -> tuple[Any, Any, Any, Any]:
        started = tf.timestamp()
        with tf.control_dependencies([started]):
            x, y = next(iterator)
        config = schedule.tensors(step_at(j))
        row, next_lead = run_step(x, y, config, started)
        row = tf.concat([row, tf.reshape(lead, [1])], 0)
        return j + 1, next_lead, records.write(j, row), starts.write(j, started)

    def may_step(j: Any, lead: Any, _records: Any, _starts: Any) -> Any:
        return j < count if gate is None else tf.logical_and(j < count, gate.allows(lead))

    first_lead = tf.constant(0.0) if gate is None else gate.first_lead()
    # One step at a time (parallel_iterations=1): each step's timestamps are its own.
    _, _, records, starts = tf.while_loop(
        may_step,
        step,
        (
            tf.constant(0),
            first_lead,
            tf.TensorArray(tf.float32, size=0, dynamic_size=True, element_shape=[RECORD_WIDTH - 1]),
            tf.TensorArray(tf.float64, size=0, dynamic_size=True, element_shape=[]),
        ),
        parallel_iterations=1,
    )
    records, starts = records.stack(), starts.stack()
    with tf.control_dependencies([records, starts]):
        ended = tf.timestamp()
    bounds = tf.concat([starts, tf.reshape(ended, [1])], 0)
    seconds = tf.reshape(tf.cast(bounds[1:] - bounds[:-1], tf.float32), [-1, 1])
    return tf.concat([records[:, :STEP_SECONDS], seconds, records[:, STEP_SECONDS:]], 1)


def steps_per_execution(hp: HParams, step_seconds: float | None) -> int:
    """Optimizer steps per execution: the ``steps_per_execution`` hparam, or (0 = automatic) as many
    as take about TARGET_EXECUTION_SECONDS at the measured time per step (1 until measured)."""
    if hp.steps_per_execution > 0:
        return hp.steps_per_execution
    if not step_seconds or step_seconds <= 0:
        return 1
    return int(min(max(round(TARGET_EXECUTION_SECONDS / step_seconds), 1), MAX_STEPS_PER_EXECUTION))


# ---- model, optimizer, checkpoint -----------------------------------------------------------------


def build_training_state(ctx: NodeContext, problem: Any, strategy: Any) -> dict[str, Any]:
    """The flat model (syncswitch.params: weights, optimizer slots and batch-norm statistics placed by
    ``strategy``, or this process's own without one: a local SGD replica; every variable exists
    before PSS's first schedule) and the checkpoint, which holds the canonical per-variable form: a
    local template model, its optimizer's slots (a velocity, or Adam's two moments, per variable),
    and the progress."""
    import contextlib

    import keras
    import tensorflow as tf

    from syncswitch.models import build_model, decayed_weights, example_loss
    from syncswitch.params import FlatModel
    from syncswitch.protocols import PARAMETER_SERVER

    # The same seed gives the same initial weights, so that runs are comparable and repeatable.
    keras.utils.set_random_seed(ctx.spec.seed)
    template = build_model(ctx.hp, problem)  # outside the strategy: local variables
    on_servers = ctx.spec.segment_protocol.topology == PARAMETER_SERVER
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        flat = FlatModel(
            template,
            groups=ctx.spec.num_ps if on_servers else 1,
            hp=ctx.hp,
            decayed=decayed_weights(template),
        )
    slots = tf.Module(name="optimizer")
    for name, variables in flat.slot_templates().items():  # momentum: optimizer/velocities/<i>
        setattr(slots, name, variables)
    checkpoint = tf.train.Checkpoint(
        model=template,
        optimizer=slots,
        samples=tf.Variable(0, dtype=tf.int64, trainable=False, name="samples"),
        updates=tf.Variable(0, dtype=tf.int64, trainable=False, name="updates"),
    )
    return {
        "flat": flat,
        "template": template,
        "slots": [v for variables in flat.slot_templates().values() for v in variables],
        "checkpoint": checkpoint,
        "loss": example_loss(problem, template),
    }


def build_and_restore(ctx: NodeContext, strategy: Any, problem: Any) -> tuple[dict, dict, dict]:
    """The training state under ``strategy``, restored from the latest checkpoint; records the
    cluster-ready and restored start-up marks. Returns (state, restored, signature)."""
    ctx.timings["cluster_ready"] = time.time()
    signature = checkpoints.signature(ctx.hp, problem)
    state = build_training_state(ctx, problem, strategy)
    restored = restore_latest(ctx, state, signature)
    ctx.timings["restored"] = time.time()
    return state, restored, signature


def weights_digest(state: dict[str, Any]) -> str:
    """SHA-256 over the template's weights (BN statistics included) and optimizer slots, i.e. the
    checkpoint's content: the proof that a handoff between protocols restored bit-identical state
    (taken after a round trip through the training form: ``restore_latest``)."""
    import hashlib

    digest = hashlib.sha256()
    for variable in [*state["template"].weights, *state["slots"]]:
        digest.update(variable.numpy().tobytes())
    return digest.hexdigest()


def update_batch(spec: SegmentSpec, hp: HParams) -> int:
    """Examples in one optimizer update of the segment's protocol (spec.examples_per_update)."""
    return examples_per_update(spec.protocol, hp.batch_size, spec.num_workers)


def restore_latest(ctx: NodeContext, state: dict[str, Any], signature: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest complete checkpoint into the template, then into the flat model; returns
    {samples, updates, uri, digests, second_moment_scale} (zeros if there is none). The digest is of
    the state as restored; the configuration policy's rescaling of Adam's second moment at a switch
    (spec.second_moment_scale) follows it."""
    manifest = checkpoints.latest(ctx.layout)
    if manifest is None:
        return {"samples": 0, "updates": 0, "uri": None}
    checkpoints.check_compatible(manifest, signature)
    checkpoints.check_structure(manifest, state["template"].weights)
    prefix = checkpoints.fetch(manifest, ctx.work_dir)
    state["checkpoint"].read(prefix).assert_consumed()
    state["flat"].from_template()
    # Back from the variables training reads (on the parameter servers, mirrored, or local), so that
    # the digest proves what the protocol trains from, not only what the file held.
    state["flat"].to_template()
    restored_digest = weights_digest(state)
    scale = second_moment_scale(ctx.hp, manifest.get("update_batch"), update_batch(ctx.spec, ctx.hp))
    if scale != 1.0:
        state["flat"].scale_slot("second_moments", scale)
    return {
        "samples": int(manifest["samples"]),
        "updates": int(manifest["updates"]),
        "uri": manifest["uri"],
        "digest": manifest.get("digest"),
        "restored_digest": restored_digest,
        "second_moment_scale": scale,
    }


def save(
    ctx: NodeContext,
    state: dict[str, Any],
    signature: dict[str, Any],
    *,
    samples: int,
    updates: int,
    global_batch: int,
    events: EventWriter | None,
) -> str:
    """Write a checkpoint (the chief only: the checkpoint holds local variables, so other workers
    need not take part) and prune old ones; returns its URI."""
    state["flat"].to_template()
    state["checkpoint"].samples.assign(samples)
    state["checkpoint"].updates.assign(updates)
    extra = {
        "segment": ctx.spec.index,
        "protocol": ctx.spec.protocol,
        "update_batch": update_batch(ctx.spec, ctx.hp),
        "digest": weights_digest(state),
        "structure": checkpoints.structure(state["template"].weights),
    }
    uri, seconds = checkpoints.write(
        state["checkpoint"],
        ctx.layout,
        samples=samples,
        global_step=samples / global_batch,
        updates=updates,
        signature=signature,
        extra=extra,
    )
    checkpoints.prune(ctx.layout, KEEP_CHECKPOINTS)
    if events is not None:
        events.emit(
            "checkpoint", global_step=samples / global_batch, samples=samples, uri=uri, seconds=seconds
        )
    return uri


# ---- segment events and evaluation ---------------------------------------------------------------


def segment_start_event(
    ctx: NodeContext, events: EventWriter, start_step: float, schedule: Schedule, restored: dict[str, Any]
) -> None:
    """The effective configuration of this segment, and what it restored from (with both digests)."""
    lr, momentum = schedule.at(start_step)
    events.emit(
        "segment_start",
        protocol_args=ctx.spec.protocol_args,
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
        optimizer=ctx.hp.optimizer,
        second_moment_scale=restored.get("second_moment_scale", 1.0),
        weight_decay=ctx.hp.weight_decay,
        steps_per_execution=ctx.hp.steps_per_execution,
        **_user_code_fields(ctx),
    )
    k = ctx.hp.steps_per_execution or f"auto (about {TARGET_EXECUTION_SECONDS * 1000:.0f} ms per execution)"
    # Adam's beta1 takes momentum's place, and the momentum rule does not apply to it (switch_config).
    first = f"momentum={momentum:.4g}" if ctx.hp.optimizer == "momentum" else f"beta1={momentum:.4g}"
    rule = ctx.spec.momentum_rule if ctx.hp.optimizer == "momentum" else "n/a"
    print(
        f"[{ctx.spec.run_id}] segment {ctx.spec.index} ({ctx.spec.protocol}) starts at step "
        f"{start_step:g} -> {ctx.spec.until_step}: optimizer {ctx.hp.optimizer}, per optimizer step "
        f"lr={lr:.5g} {first} weight_decay={ctx.hp.weight_decay:g} batch/worker={ctx.hp.batch_size} "
        f"workers={ctx.spec.num_workers} momentum_rule={rule}; steps per execution: {k}",
        flush=True,
    )


def _user_code_fields(ctx: NodeContext) -> dict[str, Any]:
    """Where the job's user code was imported from, for the segment_start event."""
    if not ctx.user_code:
        return {}
    return {"user_code": {"path": ctx.user_code, "digest": ctx.spec.usr_code_digest}}


def steps_per_execution_event(ctx: NodeContext, events: EventWriter, k: int, step_seconds: float) -> None:
    """The automatic steps per execution, once the first steps were timed."""
    events.emit("steps_per_execution", steps=k, step_seconds=step_seconds)
    print(
        f"[{ctx.spec.run_id}] segment {ctx.spec.index} ({ctx.spec.protocol}): {k} optimizer step(s) per "
        f"execution (one step takes {step_seconds * 1000:.1f} ms)",
        flush=True,
    )


def evaluate_checkpointed(
    ctx: NodeContext, state: dict[str, Any], events: EventWriter, samples: int, global_batch: int
) -> dict[str, float] | None:
    """With ``evaluate_checkpoints``: the test accuracy of what was just checkpointed (the template
    model holds it), as an ``eval`` event, so runs have an accuracy-over-time curve. Its seconds are
    in the event: time-to-accuracy figures subtract them. Returns the scores (None when not asked)."""
    if not ctx.spec.evaluate_checkpoints:
        return None
    from syncswitch.evaluate import evaluate_model
    from syncswitch.problems import get_problem

    started = time.monotonic()
    scores = evaluate_model(state["template"], get_problem(ctx.spec.problem), ctx.data_dir)
    events.emit("eval", global_step=samples / global_batch, seconds=time.monotonic() - started, **scores)
    return scores


def evaluate_if_asked(ctx: NodeContext, checkpoint_uri: str) -> dict[str, Any] | None:
    """{test_accuracy, test_loss, ...} of the segment's final checkpoint when the spec asks for it.
    When that checkpoint ends the job's workload, the evaluated model is also exported
    (syncswitch.export) and the result names it under ``export``."""
    if not ctx.spec.evaluate:
        return None
    from syncswitch.evaluate import evaluate_checkpoint_uri

    scores = evaluate_checkpoint_uri(
        checkpoint_uri,
        ctx.hp,
        ctx.spec.problem,
        ctx.data_dir,
        ctx.work_dir,
        export_to=ctx.layout,
        export_from_step=ctx.spec.total_steps,
    )
    return {k: v for k, v in scores.items() if k.startswith("test_") or k.startswith("export")}


class SegmentSession:
    """What a segment's loop does besides stepping, the same under BSP and ASP: its events, the graceful
    stop request, the step book, checkpoints and the segment's result. Only the node that reports (the
    chief: BSP's worker 0, ASP's coordinator) watches for a stop request, writes checkpoints (they hold
    local variables only), calls the job's hooks (syncswitch.hooks) and returns a result; the others
    time their steps.

    A context manager: leaving it closes the stop request's poller and the event writer."""

    def __init__(
        self,
        ctx: NodeContext,
        training: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
        schedule: Schedule,
        global_batch: int,
        *,
        reports: bool,
    ) -> None:
        self.ctx, self.global_batch = ctx, global_batch
        self.state, self.restored, self.signature = training
        self.start_samples = self.restored["samples"]
        self.start_step = self.start_samples / global_batch
        self.checkpoint_uri: str | None = self.restored["uri"]
        self.events = ctx.events()
        self.stop_signal = StopSignal(ctx.layout.stop_request(ctx.spec.index)) if reports else None
        self.reporter = ChiefReporter(ctx, self.events, global_batch, self.start_samples) if reports else None
        self.book = StepBook(schedule.at, global_batch, self.reporter)
        self.hooks = HookRunner(ctx.spec.hooks if reports else (), self.events)
        if reports:
            segment_start_event(ctx, self.events, self.start_step, schedule, self.restored)

    def __enter__(self) -> SegmentSession:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.stop_signal is not None:
            self.stop_signal.close()
        self.events.close()

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None and self.stop_signal.requested

    def after_steps(
        self,
        records: Any,
        timer: WorkerTimer,
        *,
        samples: int,
        updates: int,
        samples_per_step: int,
        checkpoint_due: bool,
    ) -> None:
        """The one step both loops take after each call or closure of k steps: timings, progress and
        the finite-loss check (``StepBook``), then the checkpoint where one is due."""
        self.book.after_steps(
            records, timer, samples=samples, updates=updates, samples_per_step=samples_per_step
        )
        if checkpoint_due:
            self.checkpoint(samples=samples, updates=updates)

    def checkpoint(self, *, samples: int, updates: int) -> None:
        """On the reporting node: the checkpoint, then the hooks told of it, then its evaluation
        (with ``evaluate_checkpoints``) and the hooks told of that."""
        if self.reporter is None:
            return
        self.checkpoint_uri = save(
            self.ctx,
            self.state,
            self.signature,
            samples=samples,
            updates=updates,
            global_batch=self.global_batch,
            events=self.events,
        )
        step = samples // self.global_batch  # checkpoints are at whole steps
        self.hooks.checkpoint(step, self.checkpoint_uri)
        scores = evaluate_checkpointed(self.ctx, self.state, self.events, samples, self.global_batch)
        if scores is not None:
            self.hooks.evaluate(step, scores)

    def finish(
        self, *, samples: int, updates: int, stopped_early: bool, extra: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The segment's last checkpoint (unless nothing trained since the one it restored), then, on
        the reporting node, its result (evaluated when the spec asks for it)."""
        if samples != self.start_samples or self.checkpoint_uri is None:
            self.checkpoint(samples=samples, updates=updates)
        if self.reporter is None or self.checkpoint_uri is None:
            return None
        reason = "reached until_step"
        if stopped_early:
            reason = (self.stop_signal.reason if self.stop_signal else "") or "stop requested"
        evaluation = evaluate_if_asked(self.ctx, self.checkpoint_uri)
        if evaluation is not None:
            self.hooks.evaluate(samples // self.global_batch, evaluation)
        return self.reporter.finish(
            samples=samples,
            updates=updates,
            stopped_early=stopped_early,
            reason=reason,
            checkpoint_uri=self.checkpoint_uri,
            start_step=self.start_step,
            evaluation=evaluation,
            extra={
                "protocol_args": self.ctx.spec.protocol_args,
                "bytes_per_worker_step": self.book.bytes_per_step,
                **(extra or {}),
            },
        )
