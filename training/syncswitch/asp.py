"""The ASP training loop: ParameterServerStrategy + ClusterCoordinator. SSP is this loop with the
clock gate of syncswitch.ssp inside its closures.

The coordinator (the chief) schedules closures; a closure runs ``count`` optimizer steps on whichever
worker takes it, in a graph loop (as TensorFlow's parameter-server tutorial and tf_keras'
``steps_per_execution`` do). Each inner step reads the variables from the parameter servers afresh,
computes its gradient and applies it there at once (the optimizer's update runs on the parameter
server), so ASP semantics are those of one step per closure. A closure takes one packed input (its
first global update number and its step count) and returns one packed output (the worker, the steps
it ran, and each step's record: syncswitch.trainer.RECORD_COLUMNS), so a closure of k steps pays the
coordinator's dispatch and fetch round trips once instead of k times. An SSP closure may run fewer
steps than it was given (its worker reached the staleness bound); the rest is scheduled again.

Book-keeping (AspLoop) is in optimizer updates: an update is one worker's batch, 1/N of a BSP-equivalent
step. The global step lives on the coordinator (Keras' optimizer counter loses increments under ASP),
and so does each step's update number, Adam's bias-correction count (``Schedule``).
A closure is never scheduled past the segment target or the next checkpoint boundary, so segments end
exactly on target and checkpoints capture a drained state; an early stop rounds up to a whole step.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from syncswitch import storage
from syncswitch.context import NodeContext
from syncswitch.events import EventWriter
from syncswitch.exchange import gradient_exchange
from syncswitch.reporting import WorkerTimer
from syncswitch.spec import SegmentSpec
from syncswitch.ssp import ClockGate, LeadTally
from syncswitch.trainer import (
    CLOCK_LEAD,
    RECORD_WIDTH,
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

# A closure lost with its worker is rescheduled; this many in one segment means something else is
# wrong (every worker keeps failing), and the error is raised instead.
MAX_LOST_CLOSURES = 1000
# The watchdog allows a stalled closure at least this many times its expected length.
WATCHDOG_CLOSURE_MULTIPLE = 20
# Copying a finished closure's output back is one more RPC, which can fail in transit while the
# closure's updates stand; the copy (a read) is tried this many times before the error is raised.
FETCH_ATTEMPTS = 3


def run_asp_chief(ctx: NodeContext, problem: Any) -> dict[str, Any] | None:
    """The ParameterServerStrategy coordinator: schedules closures until the segment's target."""
    import tensorflow as tf

    # A worker killed mid-RPC can surface as an UnknownError "Graph execution error"; TF retries it
    # as a worker failure only when asked to (b/216666282 in cluster_coordinator.py).
    os.environ.setdefault("TF_PS_HANDLE_UNKNOWN_ERROR", "1")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    training = build_and_restore(ctx, strategy, problem)
    state, restored, _signature = training
    spec, batch = ctx.spec, ctx.hp.batch_size
    protocol = spec.segment_protocol
    gate, tally = None, None
    if protocol.name == "ssp":
        with strategy.scope():  # before the first closure, as every variable
            gate = ClockGate(spec.num_workers, protocol.staleness)
        tally = LeadTally(protocol.staleness)
    loop = AspLoop(spec, batch, spec.num_workers * batch, restored["samples"], restored["updates"])
    schedule = Schedule(
        spec,
        ctx.hp,
        restored["samples"] / loop.global_batch,
        start_updates=restored["updates"],
        updates_per_step=loop.global_batch // batch,
    )
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn(ctx, problem, restored["samples"])))
    worker_steps = _compile_worker_steps(
        strategy,
        state,
        schedule,
        WorkerSteps(restored["samples"], batch, loop.global_batch),
        gradient_exchange(protocol, state["flat"]),
        gate,
    )
    closure_timing = ClosureTiming()
    with (
        SegmentSession(ctx, training, schedule, loop.global_batch, reports=True) as session,
        contextlib.closing(Watchdog(ctx, session.events)) as watchdog,
    ):
        timers = {
            w: WorkerTimer(session.events, w, clock_leads=gate is not None) for w in range(spec.num_workers)
        }
        sizer = ClosureSizer(ctx, session.events, watchdog)
        while True:
            if session.stop_requested:
                loop.request_stop()  # may finish the loop at once, when nothing is in flight
            if loop.finished:
                break
            while (closure := loop.next_closure(sizer.size())) is not None:
                packed = tf.constant([closure.first, closure.count], tf.int64)
                loop.add(schedule_closure(coordinator, worker_steps, (iterator, packed)), closure)
            done = loop.collect()
            if done is None:
                if loop.lost == 1:
                    print(f"[{spec.run_id}] worker lost mid-closure; rescheduling its closures", flush=True)
                continue
            worker, records, cut = done
            if tally is not None:
                tally.add(records[:, CLOCK_LEAD], cut)
            if not len(records):  # an SSP closure whose worker was at the bound: nothing ran
                continue
            sizer.observe(records[:, STEP_SECONDS])
            closure_timing.add(records[:, STEP_SECONDS])
            watchdog.seen(worker)
            session.after_steps(
                records,
                timers[worker],
                samples=loop.done_samples,
                updates=loop.updates,
                samples_per_step=batch,
                checkpoint_due=loop.at_checkpoint_boundary(),
            )
        coordinator.join()
        for timer in timers.values():
            timer.flush()
        ctx.finished_objects.extend([iterator, coordinator, strategy, state, worker_steps])
        stopped_early = loop.stopping and loop.done_samples < loop.until_samples
        extra = {"closure_timing": closure_timing.summary()}
        if tally is not None:
            extra["staleness"] = tally.summary()
        return session.finish(
            samples=loop.done_samples, updates=loop.updates, stopped_early=stopped_early, extra=extra
        )


def _dataset_fn(ctx: NodeContext, problem: Any, start_samples: int) -> Any:
    """Each worker's shard of the training data (by its index), reshuffled by where the segment starts."""
    import tensorflow as tf

    def dataset_fn() -> Any:
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return problem.train_dataset(
            ctx.data_dir,
            batch_size=ctx.hp.batch_size,
            shard_index=worker,
            num_shards=ctx.spec.num_workers,
            seed=ctx.spec.seed + start_samples,
        )

    return dataset_fn


@dataclass(frozen=True)
class WorkerSteps:
    """Where a segment's updates start, in samples, and the batches that convert updates to steps."""

    start_samples: int
    batch: int
    global_batch: int


def _compile_worker_steps(
    strategy: Any,
    state: dict[str, Any],
    schedule: Schedule,
    units: WorkerSteps,
    exchange: Any,
    gate: ClockGate | None,
) -> Any:
    """The graph function of one closure: ``closure`` = [first update (segment-relative), count];
    returns [worker, steps run, then per step its record (trainer.RECORD_COLUMNS: the own seconds
    are input and forward/backward, the step seconds hold the parameter-server round trips)]. Every
    step runs, except under an SSP ``gate``, which ends the closure at the first step its worker may
    not start."""
    import tensorflow as tf

    def mean_loss(outputs: Any, labels: Any) -> Any:
        return tf.reduce_mean(state["loss"](outputs, labels))

    after_update = gate.after_update if gate is not None else None
    replica_step = replica_step_fn(state["flat"], mean_loss, exchange, after_update)

    def run_step(x: Any, y: Any, config: Any, started: Any) -> Any:
        loss, own, sent, lead = strategy.run(replica_step, args=(x, y, config, started))
        return tf.stack([loss, tf.cast(own, tf.float32), sent]), lead

    @tf.function(autograph=False)  # see timed_steps
    def worker_steps(iterator: Any, closure: Any) -> Any:
        first, count = closure[0], tf.cast(closure[1], tf.int32)

        def step_at(j: Any) -> Any:  # progress in BSP steps: an update is of this worker's batch only
            update = tf.cast(first + tf.cast(j, tf.int64), tf.float64)
            return (units.start_samples + update * units.batch) / units.global_batch

        records = timed_steps(iterator, count, schedule, step_at, run_step, gate)
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        head = tf.cast(tf.stack([tf.cast(worker, tf.int32), tf.shape(records)[0]]), tf.float32)
        return tf.concat([head, tf.reshape(records, [-1])], 0)

    return worker_steps


class ClosureTiming:
    """Where a closure's time goes: the steps inside the function (timed on the workers) and
    ClusterCoordinator's own timers, ``closure_execution`` (dispatching and running it from the
    coordinator's worker thread) and ``remote_value_fetch`` (copying its output back)."""

    def __init__(self) -> None:
        from tensorflow.python.distribute.coordinator import metric_utils

        metric_utils.enable_metrics = True  # off by default; a few timers per closure
        self.closures, self.steps, self.in_function = 0, 0, 0.0

    def add(self, step_seconds: np.ndarray) -> None:
        self.closures += 1
        self.steps += len(step_seconds)
        self.in_function += float(step_seconds.sum())

    def summary(self) -> dict[str, float]:
        from tensorflow.python.distribute.coordinator import metric_utils

        timers = {}
        for name in ("closure_execution", "remote_value_fetch"):
            try:
                timers[f"{name}_seconds"] = float(metric_utils.get_metric_summary(name)["sum"])
            except (KeyError, TypeError):
                timers[f"{name}_seconds"] = 0.0
        return {
            "closures": self.closures,
            "steps": self.steps,
            "in_function_seconds": self.in_function,
            **timers,
        }


class ClosureSizer:
    """Steps per closure: 1 while the first closures of every worker time a step, then the size
    ``steps_per_execution`` picks for that step time (or the hparam, if set)."""

    def __init__(self, ctx: NodeContext, events: EventWriter, watchdog: Watchdog) -> None:
        self.ctx, self.events, self.watchdog = ctx, events, watchdog
        self.warmup = WARMUP_EXECUTIONS * ctx.spec.num_workers
        self.step_times: collections.deque[float] = collections.deque(maxlen=64)
        self.seen = 0
        self.chosen: int | None = ctx.hp.steps_per_execution or None

    def observe(self, step_seconds: np.ndarray) -> None:
        self.seen += 1
        if self.seen > self.ctx.spec.num_workers:  # each worker's first closure traces the graph
            self.step_times.extend(float(t) for t in step_seconds)
        if self.chosen is None and self.seen > self.warmup and self.step_times:
            step = statistics.median(self.step_times)
            self.chosen = steps_per_execution(self.ctx.hp, step)
            steps_per_execution_event(self.ctx, self.events, self.chosen, step)
        if self.chosen and self.step_times:
            self.watchdog.allow(WATCHDOG_CLOSURE_MULTIPLE * self.chosen * statistics.median(self.step_times))

    def size(self) -> int:
        return self.chosen or 1


@dataclass(frozen=True)
class Closure:
    first: int  # first update of the closure, counted from the segment's start
    count: int


class AspLoop:
    """Book-keeping of scheduled and completed ASP closures, in optimizer updates."""

    def __init__(
        self, spec: SegmentSpec, batch: int, global_batch: int, start_samples: int, start_updates: int = 0
    ) -> None:
        self.batch, self.global_batch = batch, global_batch
        self.start_samples, self.start_updates = start_samples, start_updates
        self.until_samples = spec.until_step * global_batch
        self.limit = max((self.until_samples - start_samples) // batch, 0)
        self.ckpt_updates = spec.ckpt_frequency * spec.num_workers  # updates per checkpoint interval
        self.window = 2 * spec.num_workers  # closures in flight: one running and one queued per worker
        self.scheduled = 0  # updates handed out (the high-water mark)
        self.done = 0
        self.lost = 0  # closures handed back after their worker was lost
        self.run_id = spec.run_id
        self.stopping = False
        self._inflight: collections.deque = collections.deque()
        self._retry: collections.deque[Closure] = collections.deque()
        # SSP: the rest of closures whose worker was at the bound before its first step, scheduled
        # again once another closure has run a step (a clock moved) or nothing else is in flight.
        self._held: list[Closure] = []

    @property
    def finished(self) -> bool:
        return self.done >= self.limit

    @property
    def done_samples(self) -> int:
        return self.start_samples + self.done * self.batch

    @property
    def updates(self) -> int:
        """Optimizer updates of the whole job so far (the checkpoint's counter)."""
        return self.start_updates + self.done

    def _next_boundary(self) -> int:
        """The update count no closure may cross: the target, or the next checkpoint."""
        if self.ckpt_updates <= 0:
            return self.limit
        interval = self.ckpt_updates * self.batch  # samples between checkpoints
        next_ckpt_samples = (self.done_samples // interval + 1) * interval
        return min(self.limit, (next_ckpt_samples - self.start_samples) // self.batch)

    def next_closure(self, size: int) -> Closure | None:
        """The next closure to schedule (a lost or cut one first, with its own updates), or None."""
        if len(self._inflight) >= self.window:
            return None
        if self._held and not self._inflight:
            self._release_held()
        if self._retry:
            return self._retry.popleft()
        count = min(size, self._next_boundary() - self.scheduled)
        if count <= 0:
            return None
        closure = Closure(self.scheduled, count)
        self.scheduled += count
        return closure

    def add(self, remote_value: Any, closure: Closure) -> None:
        self._inflight.append((remote_value, closure))

    def collect(self) -> tuple[int, np.ndarray, bool] | None:
        """Fetch a finished closure: (worker, per-step records [steps run, RECORD_WIDTH], whether it
        was cut short), preferring any that is ready so a straggler's closure at the head of the
        queue does not stall the others. A closure cut short (SSP's bound) hands its other updates
        back, to be scheduled again with their own update numbers.

        Returns None when the closure was lost with a worker: its updates are handed back to be
        scheduled again, so the segment still ends exactly on target.
        """
        index = next((i for i, (rv, _) in enumerate(self._inflight) if _is_ready(rv)), 0)
        remote_value, closure = self._inflight[index]
        del self._inflight[index]
        try:
            packed = self._fetch(remote_value)
        except Exception as exc:
            if not is_lost_worker_error(exc) or self.lost >= MAX_LOST_CLOSURES:
                raise
            self.lost += 1
            self._retry.append(closure)
            return None
        worker, steps = int(packed[0]), int(packed[1])
        self.done += steps
        cut = steps < closure.count
        if cut:
            rest = Closure(closure.first + steps, closure.count - steps)
            (self._retry if steps else self._held).append(rest)
        if steps:
            self._release_held()
        return worker, packed[2:].reshape(steps, RECORD_WIDTH), cut

    def _fetch(self, remote_value: Any) -> np.ndarray:
        """The closure's packed output, fetched again after an error other than a lost worker's. A
        copy that failed in transit (gRPC's "Unable to parse request": the worker never ran it) can
        succeed on another try, and a closure that failed raises its stored error again at once.
        Scheduling the closure again instead would apply its updates twice."""
        for attempt in range(1, FETCH_ATTEMPTS):
            try:
                return np.asarray(remote_value.fetch())
            except Exception as exc:
                if is_lost_worker_error(exc):
                    raise
                # TF's first line is often only "2 root error(s) found."; the status follows it.
                said = " ".join(str(exc).split())[:300]
                print(
                    f"[{self.run_id}] fetching a closure's output failed ({type(exc).__name__}: {said}); "
                    "fetching again",
                    flush=True,
                )
                time.sleep(0.2 * attempt)
        return np.asarray(remote_value.fetch())

    def _release_held(self) -> None:
        self._retry.extend(self._held)
        self._held.clear()

    def request_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        # Closures already scheduled will run; round up to a whole BSP-equivalent step. Segments start
        # on step boundaries, so counting updates from the segment start is enough.
        per_step = self.global_batch // self.batch
        self.limit = min(self.limit, -(-self.scheduled // per_step) * per_step)

    def at_checkpoint_boundary(self) -> bool:
        if self.ckpt_updates <= 0 or self.finished or self._inflight or self._retry or self._held:
            return False
        return (self.done_samples // self.batch) % self.ckpt_updates == 0


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
    folder; the node supervisor (the local launcher, or the node agent on a VM) acts on it. The limit
    is the spec's ``watchdog_seconds``, or longer when closures are long (``allow``).
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

    def allow(self, seconds: float) -> None:
        """Closures now take long enough that a worker may go ``seconds`` without finishing one."""
        self.timeout = max(self.ctx.spec.watchdog_seconds, seconds)

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            now = time.monotonic()
            latest = max(self.last_seen.values())
            for worker, seen in self.last_seen.items():
                # Only while others progress: a cluster-wide stall is not one worker's fault.
                if worker in self.killed or now - seen < self.timeout or now - latest > self.timeout / 2:
                    continue
                self.killed.add(worker)
                reason = f"no completed closure for {now - seen:.0f}s while other workers progressed"
                storage.write_text(os.path.join(self.ctx.work_dir, f"kill-worker-{worker}"), reason)
                self.events.emit("watchdog", worker=worker, reason=reason)
                print(
                    f"[{self.ctx.spec.run_id}] watchdog: worker {worker} stalled, asking for kill: {reason}",
                    flush=True,
                )

    def close(self) -> None:
        self._done.set()
