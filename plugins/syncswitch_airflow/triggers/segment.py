"""SegmentTrigger: waits on the triggerer for one detached training segment to end.

It polls the run folder (``result.json``; the chief's ``step`` events through the one event reader,
``syncswitch.events.EventTail``) and the cluster backend (is the launcher still alive?), and ends the
segment task itself (``end_from_trigger``):

    success   record the SegmentResult in state.json (record_result), launch the plan's next
              entry (launch_next), then TaskSuccessEvent with the task's XCom (the segment summary)
    failure   log the reason and the launcher's log tail, stop whatever of the segment still runs (so
              that a retry starts cleanly from the latest checkpoint), then TaskFailedEvent (Airflow
              turns it into up_for_retry); on the try with no retry left (``last_try``: the job's
              ``segment_retries`` are used up) a "failed" event back to the task instead, which
              fails it for good (Airflow's own retries are the ceiling, not the job's count)

A try that its task launched reads only the events written after the launch (``event_offsets``,
taken by the task just before it): a retry resumes from a checkpoint behind the step its killed try
had logged, and its progress and stall check start from its own steps.

Storage and ``/proc`` reads run in a thread, with the bucket connection's credentials
(``BucketHook.in_thread``), so the triggerer's event loop is never blocked. Progress goes to the task
log every ``log_seconds``. A segment whose step stops moving is failed by the rule of
``syncswitch.stall`` (the launcher applies it first; the trigger only when the launcher itself hangs).

The next segment starts here, not in its own task: between the two segment tasks Airflow needs the
triggerer's next loop, the scheduler's next loop and a task start, which would all add to every
switch gap. Its task finds the segment running and follows it (as a retry
does), and launches it itself where this launch failed. The plan cannot move under the launch: an
online switch is refused once the segment's result is recorded (``syncswitch.state.apply_switch``),
and the next entry is read after that record.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# Triggers are not in airflow.sdk (3.3): airflow.triggers.base is their public home.
from airflow.triggers.base import TaskFailedEvent, TaskSuccessEvent, TriggerEvent
from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.events import EventTail, read_stream
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch.stall import DEFAULT_STALL_SECONDS, TRIGGER_GRACE_SECONDS, StallWatch
from syncswitch.state import (
    State,
    read_state,
    record_fork_servers,
    store_segment_result,
    straggler_reference_time,
)

from syncswitch_airflow import metrics
from syncswitch_airflow.backends import get_backend
from syncswitch_airflow.backends.base import EXITED, UNKNOWN, Handle
from syncswitch_airflow.hooks.bucket import BucketHook
from syncswitch_airflow.triggers.base import FieldsTrigger

# How long a launcher may stay unknown to the backend before the segment counts as lost: a wiped
# work folder (local; the launch record is written right after the process starts), or a chief host
# that SSH cannot reach (hosts).
_UNKNOWN_GRACE_S = 30.0
# A remote backend's status is an SSH login to the chief host (and on gce a Compute Engine list): asked
# every ``status_poll_seconds`` while the segment is young, when a launcher that cannot start dies,
# then less often as it ages, at most this far apart, so a long segment costs a login a minute, not
# one a poll. The bucket's result.json is still read every poll, so an end is seen as fast.
STATUS_POLL_MAX_S = 60.0


def status_interval(base: float, age: float, last_state: str) -> float:
    """Seconds to the next status look of a remote segment watched for ``age`` seconds: ``base`` at
    first and while its launcher is unknown (the lost-launcher grace counts at that pace), then
    ``age`` / 20, up to ``STATUS_POLL_MAX_S``."""
    if last_state == UNKNOWN:
        return base
    return max(base, min(age / 20.0, STATUS_POLL_MAX_S))


@dataclass(frozen=True)
class Progress:
    global_step: float
    examples_per_sec: float | None
    wall_time: float

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Progress:
        return cls(
            global_step=float(event.get("global_step", 0.0)),
            examples_per_sec=event.get("examples_per_sec"),
            wall_time=float(event.get("wall_time", 0.0)),
        )


@dataclass
class SegmentEvents:
    """What the trigger follows in a try's events: the chief's newest step (progress), its first step
    and newest checkpoint (the checkpoint's age), the launcher's lost nodes and its account of a
    failure (``segment_failed``)."""

    progress: Progress | None = None
    first_step_at: float | None = None
    checkpoint_at: float | None = None
    failure: dict[str, Any] | None = None

    def follow(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Take in new events (in wall-time order); returns the ``node_lost`` ones among them."""
        for event in events:
            kind = event.get("event")
            if kind == "step":
                self.progress = Progress.from_event(event)
                self.first_step_at = self.first_step_at or self.progress.wall_time
            elif kind == "checkpoint":
                self.checkpoint_at = float(event.get("wall_time", 0.0)) or self.checkpoint_at
            elif kind == "segment_failed":
                self.failure = event
        return [event for event in events if event.get("event") == "node_lost"]

    def checkpoint_age(self, now: float) -> float | None:
        """Seconds since the newest checkpoint, or since the first step before the segment wrote one
        (it restored the checkpoint the segment before it wrote at its end); None before any step."""
        since = self.checkpoint_at or self.first_step_at
        return None if since is None else now - since


def read_result(run_dir: str, index: int, protocol: str) -> dict[str, Any] | None:
    """The segment's result.json, or None while it has not been written."""
    return storage.read_json(RunLayout(run_dir).segment_result(index, protocol), default={}) or None


def is_finished(result: dict[str, Any], entry: dict[str, Any]) -> bool:
    """A result.json that ends this entry: it reached the target, or it was stopped early on purpose."""
    reached = float(result.get("end_step", -1)) == float(entry["until_step"])
    return reached or bool(result.get("stopped_early"))


def record_result(
    run_dir: str, index: int, result: dict[str, Any], log: Any, dag_id: str = ""
) -> dict[str, Any]:
    """Store a segment's result in state.json (an early stop moves its plan entry's target), log it,
    send its metrics (the first time only), and return the segment task's XCom. Idempotent: a
    restarted trigger may call it again."""
    state, first = store_segment_result(RunLayout(run_dir), index, result)
    if first:
        metrics.segment_recorded(state, index, result, dag_id)
    run_id = state.get("run_id")
    protocol = result.get("protocol")
    rate = result.get("examples_per_sec")
    log.info(
        "run %s: segment %d (%s) ended at step %s in %.1f s (%s examples/s%s)",
        run_id,
        index,
        protocol,
        result.get("end_step"),
        float(result.get("seconds") or 0.0),
        f"{rate:.0f}" if isinstance(rate, int | float) else "n/a",
        ", stopped early: " + str(result.get("reason")) if result.get("stopped_early") else "",
    )
    if result.get("checkpoint"):
        log.info("run %s: segment %d hands off checkpoint %s", run_id, index, result["checkpoint"])
    return {
        key: result.get(key)
        for key in ("index", "protocol", "start_step", "end_step", "seconds", "stopped_early")
    }


def launch_entry(
    run_dir: str, state: State, entry: dict[str, Any], log: Any, job: JobSpec | None = None
) -> dict[str, Any]:
    """Launch plan ``entry`` of the run on its cluster; the backend's launch record. The segment's
    spec comes from the job and the entry alone, whoever launches it (its task, which passes the
    ``job`` it parsed from ``state``, or the trigger of the segment before). Raises ``ClusterError``."""
    protocol, layout = entry["protocol"], RunLayout(run_dir)
    reference = straggler_reference_time(layout, protocol, time.time())
    user_code = state.get("user_code") or {}
    job = job or JobSpec.from_params(state["job"])
    spec = job.segment_spec(entry, state["run_id"], state["run_dir"])
    spec = spec.replace(
        straggler_reference_time=reference,
        usr_code_uri=user_code.get("uri", ""),
        usr_code_digest=user_code.get("digest", ""),
    )
    record = get_backend(state["cluster"]["backend"]).launch_segment(state["cluster"], spec)
    if record.get("fork_servers"):  # started again on new ports for this launch
        record_fork_servers(layout, record["fork_servers"])
    log.info(
        "run %s: segment %d (%s) launched to step %s (pid %s, log %s)",
        state["run_id"],
        entry["index"],
        protocol,
        entry["until_step"],
        record.get("pid"),
        record.get("log"),
    )
    return record


def launch_next(run_dir: str, index: int, protocol: str, log: Any) -> None:
    """Launch the plan entry after segment ``index`` (whose result is recorded), unless there is
    none or it is already running or ended. Never raises: a failure is logged, and the next
    segment's task launches it then.

    A segment that lost a node leaves the next launch to its task: that launch may first repair the
    cluster (a lost host's fork server, a preempted VM's replacement: minutes), or shrink it, and
    this segment's task would wait for it."""
    try:
        _launch_next(run_dir, index, protocol, log)
    except Exception as exc:  # noqa: BLE001 - the next segment's task launches it instead
        run = run_dir.rstrip("/").rsplit("/", 1)[-1]  # the run folder is named after the run
        log.warning("run %s: segment %d not launched ahead of its task (%s); it will be", run, index + 1, exc)


def _launch_next(run_dir: str, index: int, protocol: str, log: Any) -> None:
    layout = RunLayout(run_dir)
    state = read_state(layout) or {}
    entry = plans.entry(state.get("plan", []), index + 1)
    if entry is None or not state.get("cluster"):
        return
    if read_stream(layout.segment_events(index, protocol, "launcher", 0), event="node_lost"):
        run_id = state.get("run_id")
        log.info("run %s: segment %d lost a node; its task launches segment %d", run_id, index, index + 1)
        return
    if get_backend(state["cluster"]["backend"]).segment_status(state["cluster"], index + 1).running:
        return
    if read_result(run_dir, index + 1, entry["protocol"]) is None:
        launch_entry(run_dir, state, entry, log)


def describe_failure(event: dict[str, Any] | None) -> str:
    """A failed try's ``segment_failed`` event, for the task log: the node that failed first, where,
    how, and its last lines; where every node's log is."""
    if event is None:
        return "the launcher named no failed node (it did not get that far, or went with its host)"
    logs = f"every node's log: {event.get('logs')}/"
    if not event.get("node"):
        return f"no node failed; {logs}"
    where = f" on host {event['host']}" if event.get("host") else ""
    code = event.get("exit_code")
    if event.get("lost"):
        how = "its host or fork server stopped answering"
    elif isinstance(code, int) and code < 0:
        how = f"killed by signal {-code}"
    else:
        how = f"exited with {code}"
    step = event.get("global_step")
    at = f" at step {plans.step_text(step)}" if step is not None else ""
    lines = [str(line) for line in event.get("last_lines") or []]
    tail = "\n".join(f"  | {line}" for line in lines) or "  (its log is empty)"
    return (
        f"the node that failed first: {event['node']}{where} ({how}){at}; "
        f"its last {len(lines)} line{'' if len(lines) == 1 else 's'}:\n"
        f"{tail}\nits log: {event.get('log')}; {logs}"
    )


class SegmentTrigger(FieldsTrigger):
    """Fires when segment ``index`` of the run in ``run_dir`` ends, fails, or stalls."""

    def __init__(
        self,
        run_dir: str,
        index: int,
        protocol: str,
        until_step: float,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        stall_grace_seconds: float = TRIGGER_GRACE_SECONDS,
        poll_seconds: float = 0.25,
        progress_seconds: float = 2.0,
        log_seconds: float = 30.0,
        last_try: bool = False,
        event_offsets: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.bucket = BucketHook()
        self.run_dir = run_dir
        self.index = index
        self.protocol = protocol
        self.until_step = until_step
        # The cluster's handle, read from state.json when the trigger runs: an identifier in its
        # kwargs (run_dir), not a snapshot that a later launch (a moved fork server) would outdate.
        self.handle: Handle = {}
        self.tags: dict[str, Any] = {}  # the metrics' (dag, job, segment), known once it runs
        self._tail: EventTail | None = None  # this try's events, read as it runs
        self._seen = SegmentEvents()
        self.stall_seconds = stall_seconds
        self.stall_grace_seconds = stall_grace_seconds
        self.poll_seconds = poll_seconds
        self.progress_seconds = progress_seconds
        self.log_seconds = log_seconds
        self.last_try = last_try
        # Where this try's events begin in the segment's event files (an earlier, killed try's
        # steps come before), so that its progress and stall check start from this try's own.
        self.event_offsets = event_offsets or {}

    @property
    def label(self) -> str:
        return f"run {posixpath.basename(self.run_dir)} segment {self.index} ({self.protocol})"

    async def run(self) -> AsyncIterator[TriggerEvent]:
        state = await self._state()
        self.handle = state["cluster"]
        self.tags = self._metric_tags(state)
        backend = get_backend(self.handle["backend"])
        folder = RunLayout(self.run_dir).segment_metrics(self.index, self.protocol)
        self._tail = tail = EventTail(folder, self.event_offsets)
        stall = StallWatch(self.stall_seconds)
        seen = self._seen
        started = time.monotonic()
        next_look = next_log = next_status = started
        unknown_since: float | None = None
        remote_poll = getattr(backend, "status_poll_seconds", 0.0)  # none: a local look, cheap
        while True:
            result = await self._from_bucket(read_result, self.run_dir, self.index, self.protocol)
            if result is not None:
                yield await self._succeeded(result)
                return
            now = time.monotonic()
            if now >= next_status:
                status = await self.bucket.in_thread(backend.segment_status, self.handle, self.index)
                age = now - started
                next_status = now + (status_interval(remote_poll, age, status.state) if remote_poll else 0.0)
                unknown_since = (unknown_since or now) if status.state == UNKNOWN else None
                lost = status.state == EXITED or (
                    unknown_since is not None and now - unknown_since > _UNKNOWN_GRACE_S
                )
                if lost:
                    yield await self._launcher_gone(backend, status.exit_code)
                    return
            now = time.monotonic()
            if now >= next_look:
                next_look = now + self.progress_seconds
                events = await self._from_bucket(tail.read_new) or []
                # In a thread: a process's first metric has Airflow's Stats read its table of metric names.
                await asyncio.to_thread(self._follow, seen, events)
                stall.observe(seen.progress.global_step if seen.progress else None)
                if now >= next_log:
                    next_log = now + self.log_seconds
                    self._log_progress(seen.progress, now - started)
                reason = stall.stalled(grace=self.stall_grace_seconds)
                if reason:
                    yield await self._failed(backend, reason)
                    return
            await asyncio.sleep(self.poll_seconds)

    def _follow(self, seen: SegmentEvents, events: list[dict[str, Any]]) -> None:
        """Take in a look's new events: each lost node and the checkpoint's age go out as metrics."""
        for lost in seen.follow(events):
            metrics.node_lost(lost, **self.tags)
        age = seen.checkpoint_age(time.time())
        if age is not None:
            metrics.checkpoint_age(age, **self.tags)

    def _metric_tags(self, state: State) -> dict[str, Any]:
        ti = getattr(self, "task_instance", None)
        return {
            "dag_id": getattr(ti, "dag_id", None),
            "job_name": state.get("job_name"),
            "protocol": self.protocol,
            "segment": self.index,
            "backend": state.get("cluster", {}).get("backend"),
        }

    async def _state(self) -> State:
        """The run's state.json, waiting out a bucket outage."""
        waited = False
        while (state := await self._from_bucket(read_state, RunLayout(self.run_dir))) is None:
            if not waited:
                self.log.warning(
                    "%s: no state.json readable in %s yet; waiting for it", self.label, self.run_dir
                )
                waited = True
            await asyncio.sleep(max(self.poll_seconds, 1.0))
        return state

    async def _from_bucket(self, read: Any, *args: Any) -> Any:
        """``read(*args)`` in a thread; None while the bucket stays unreachable past its retry limit
        (the launcher, which needs the bucket too, decides whether the segment survives that)."""
        try:
            return await self.bucket.in_thread(read, *args)
        except storage.BucketUnavailable as exc:
            self.log.warning("%s: %s; still watching", self.label, exc)
            return None

    async def _succeeded(self, result: dict[str, Any]) -> TriggerEvent:
        try:
            summary = await self.bucket.in_thread(
                record_result, self.run_dir, self.index, result, self.log, self.tags.get("dag_id") or ""
            )
        except Exception as exc:  # noqa: BLE001 - the task must end either way, with the reason logged
            self.log.error("%s: cannot record its result: %s", self.label, exc)
            return self._failure()
        await self.bucket.in_thread(launch_next, self.run_dir, self.index, self.protocol, self.log)
        return TaskSuccessEvent(xcoms={"return_value": summary})

    async def _launcher_gone(self, backend: Any, exit_code: int | None) -> TriggerEvent:
        # The chief writes result.json before the launcher exits; read once more to close the race.
        result = await self._from_bucket(read_result, self.run_dir, self.index, self.protocol)
        if result is not None:
            return await self._succeeded(result)
        how = f"exited with code {exit_code}" if exit_code is not None else "vanished without an exit code"
        return await self._failed(backend, f"the launcher {how} before writing result.json")

    async def _failed(self, backend: Any, reason: str) -> TriggerEvent:
        log_tail = await self.bucket.in_thread(backend.segment_log_tail, self.handle, self.index)
        if self._tail is not None:  # the launcher's last events: its lost nodes, its account
            events = await self._from_bucket(self._tail.read_new) or []
            await asyncio.to_thread(self._follow, self._seen, events)
        failure = self._seen.failure
        described = describe_failure(failure)
        self.log.error("%s failed: %s\n%s\nlauncher log tail:\n%s", self.label, reason, described, log_tail)
        await asyncio.to_thread(metrics.segment_failed, (failure or {}).get("node"), **self.tags)
        # Leave nothing running, so that a retry starts cleanly from the latest checkpoint.
        try:
            await self.bucket.in_thread(backend.stop_segment, self.handle, self.index)
        except Exception as exc:  # noqa: BLE001 - teardown_cluster kills whatever is left
            self.log.error("%s: stopping its processes failed: %s", self.label, exc)
        return self._failure()

    def _failure(self) -> TriggerEvent:
        """Airflow retries a TaskFailedEvent up to the task's ``retries``: the last try of the job's
        own count ends on a worker, whose ``execute_complete`` fails the task without a retry."""
        return TriggerEvent("failed") if self.last_try else TaskFailedEvent()

    def _log_progress(self, progress: Progress | None, elapsed: float) -> None:
        if progress is None:
            self.log.info("%s: waiting for the first step (%.0f s so far)", self.label, elapsed)
            return
        rate = f"{progress.examples_per_sec:.0f} examples/s" if progress.examples_per_sec else "rate n/a"
        self.log.info(
            "%s: step %s / %s, %s",
            self.label,
            plans.step_text(progress.global_step),
            plans.step_text(self.until_step),
            rate,
        )
