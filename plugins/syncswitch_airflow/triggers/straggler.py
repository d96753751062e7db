"""StragglerTrigger: watch one running segment's per-worker timings on the triggerer.

Every ``poll_interval`` seconds it reads the new lines of the segment's event files
(``metrics/seg-ii-proto/*.jsonl``, through the one event reader ``syncswitch.events.EventTail``), feeds
the ``worker_step`` events to a :class:`~syncswitch_airflow.detector.StragglerDetector`, and either
ends the watcher task itself (``end_from_trigger``: no worker process is started to close it, and the
next slot waits for it) with a TaskSuccessEvent whose XCom says why:

    {"status": "segment_ended"}        the segment's result.json exists (checked every 0.5 s)
    {"status": "segment_task_ended", "task_state": ...}
                                       the segment's own Airflow task finished without a result
                                       (failed for good, skipped, marked failed by hand)

or hands the end back to the sensor on a worker when the segment was the plan's last one:

    {"status": "plan_ended"}           the sensor skips every later slot's tasks in one request (they
                                       would otherwise start, only to skip themselves)

or hands a verdict back to the sensor, whose policy decides on the worker:

    {"status": "verdict", "change": "raised" | "cleared" | "ongoing", "verdict": Verdict.to_dict()}
                                       the detector raised or cleared; "ongoing" every ``recheck_seconds``
                                       of event time while a straggler lasts (0 = never)

The watcher has no timeouts of its own: it lives exactly as long as the segment task it watches
(asked through the task SDK's execution API every ``task_check_seconds`` while its steps come, every
second when a poll brought none: it has failed, or starts, or evaluates). A segment task that waits
for a retry (``up_for_retry``) is still alive: its retry relaunches the segment. Storage reads block,
so they run in a thread, with the bucket connection's credentials (``BucketHook.in_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

# Triggers are not in airflow.sdk (3.3): airflow.triggers.base is their public home.
from airflow.triggers.base import TaskSuccessEvent, TriggerEvent
from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.events import EventTail
from syncswitch.layout import RunLayout
from syncswitch.state import read_state

from syncswitch_airflow.detector import DetectorConfig, StragglerDetector, Verdict
from syncswitch_airflow.hooks.bucket import BucketHook
from syncswitch_airflow.triggers.base import FieldsTrigger

END_CHECK_SECONDS = 0.5
# How often the segment task's state is asked for while a poll brought no step timings (the segment
# starts, evaluates, or has failed: a failed segment's teardown waits for this watcher). Each ask is
# an execution API call, CPU of the triggerer's, so while steps come it is asked every
# ``task_check_seconds`` instead.
QUIET_TASK_CHECK_SECONDS = 1.0
# Task states after which a segment task will not run again in this DAG run (no retry pending).
FINISHED_TASK_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")


class WatchStatus(StrEnum):
    """The ``status`` of what a watch hands back (the trigger's event, the sensor's XCom)."""

    SEGMENT_ENDED = "segment_ended"
    PLAN_ENDED = "plan_ended"  # the segment ended, and it was the plan's last
    SEGMENT_TASK_ENDED = "segment_task_ended"
    VERDICT = "verdict"
    PLAN_CHANGED = "plan_changed"  # the sensor's: a switch in an earlier slot moved the plan
    NOT_WATCHED = "not_watched"  # the sensor's: run one task at a time, it cannot watch


def task_state(dag_id: str, run_id: str, task_id: str) -> str | None:
    """The state of one task instance of this DAG run, from the execution API (None if unknown)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    states = RuntimeTaskInstance.get_task_states(dag_id=dag_id, task_ids=[task_id], run_ids=[run_id])
    return (states.get(run_id) or {}).get(task_id)


def is_last_entry(layout: RunLayout, index: int) -> bool:
    """True if plan entry ``index`` is the plan's last. Once that segment has ended the plan is final:
    only its own watcher switches online, and a switch after the segment's result is refused."""
    state = read_state(layout) or {}
    return bool(state.get("plan")) and plans.entry(state["plan"], index + 1) is None


class StragglerTrigger(FieldsTrigger):
    """Fires once: when segment ``index`` (``protocol``) ends, never starts, stalls, or a verdict changes.

    ``segment_task`` is ``{"dag_id", "run_id", "task_id"}`` of the segment task being watched.
    ``start_after`` ignores worker_step events before that wall time (a re-deferred sensor does not
    re-judge windows it already acted on); ``straggling_since`` / ``straggling_workers`` start the
    detector in the straggling state so that it fires when the straggler clears.
    """

    def __init__(
        self,
        *,
        run_dir: str,
        index: int,
        protocol: str,
        segment_task: dict[str, str],
        poll_interval: float = 2.0,
        task_check_seconds: float = 5.0,
        recheck_seconds: float = 0.0,
        detector: dict[str, Any] | None = None,
        start_after: float | None = None,
        straggling_since: float | None = None,
        straggling_workers: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.bucket = BucketHook()
        self.run_dir = run_dir
        self.index = int(index)
        self.protocol = protocol
        self.segment_task = dict(segment_task)
        self.poll_interval = float(poll_interval)
        self.task_check_seconds = float(task_check_seconds)
        self.recheck_seconds = float(recheck_seconds)
        self.detector = dict(detector or {})
        self.start_after = start_after
        self.straggling_since = straggling_since
        self.straggling_workers = list(straggling_workers or [])
        self._task_checked_at = 0.0  # monotonic time of the last look at the segment task's state

    def _payload(self, status: WatchStatus, **extra: Any) -> dict[str, Any]:
        return {"status": status.value, "index": self.index, "protocol": self.protocol, **extra}

    def _end(self, status: WatchStatus, **extra: Any) -> TaskSuccessEvent:
        return TaskSuccessEvent(xcoms={"return_value": self._payload(status, **extra)})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        layout = RunLayout(self.run_dir)
        tail = EventTail(layout.segment_metrics(self.index, self.protocol))
        result_uri = layout.segment_result(self.index, self.protocol)
        detector = StragglerDetector(
            DetectorConfig.from_dict(self.detector),
            protocol=self.protocol,
            straggling_since=self.straggling_since,
            straggling_workers=self.straggling_workers,
        )
        task_ended: str | None = None
        while True:
            try:
                ended = await self.bucket.in_thread(storage.exists, result_uri)
                records = await self.bucket.in_thread(tail.read_new, "worker_step")
            except storage.BucketUnavailable as exc:
                self.log.warning("segment %d (%s): %s; still watching", self.index, self.protocol, exc)
                continue
            if ended:
                self.log.info("segment %d (%s) ended; stop watching", self.index, self.protocol)
                yield await self._segment_end_event(layout)
                return
            if task_ended is not None:  # and no result came with it
                self.log.info(
                    "segment %d (%s): its task %s is %s; stop watching",
                    self.index,
                    self.protocol,
                    self.segment_task.get("task_id"),
                    task_ended,
                )
                yield self._end(WatchStatus.SEGMENT_TASK_ENDED, task_state=task_ended)
                return
            fired = self._judge(detector, records)
            if fired is not None:
                verdict, change = fired
                self.log.info(
                    "segment %d (%s): straggler %s, workers %s, slowdown %.2f",
                    self.index,
                    self.protocol,
                    change,
                    verdict.workers,
                    verdict.slowdown,
                )
                yield TriggerEvent(
                    self._payload(WatchStatus.VERDICT, change=change, verdict=verdict.to_dict())
                )
                return
            task_ended = await self._wait_for_next_poll(result_uri, steps_came=bool(records))

    async def _segment_end_event(self, layout: RunLayout) -> TriggerEvent:
        """The plan's last segment hands its end back to the sensor, which skips the later slots'
        tasks; any other ends the watcher here. So does the last one where the bucket does not
        answer: the first unused slot's watcher then skips the rest, as it always may."""
        try:
            last = await self.bucket.in_thread(is_last_entry, layout, self.index)
        except storage.BucketUnavailable:
            last = False
        if last:
            return TriggerEvent(self._payload(WatchStatus.PLAN_ENDED))
        return self._end(WatchStatus.SEGMENT_ENDED)

    async def _segment_task_state(self) -> str | None:
        try:
            return await asyncio.to_thread(task_state, **self.segment_task)
        except Exception as exc:  # noqa: BLE001 - an API hiccup must not end the watch; ask again later
            self.log.warning("cannot read the state of %s: %s", self.segment_task.get("task_id"), exc)
            return None

    async def _wait_for_next_poll(self, result_uri: str, *, steps_came: bool) -> str | None:
        """Sleep one poll interval, but look for the segment's end more often: the next segment
        waits for this watcher, so a late "segment_ended" would add to the switch gap; and ask for
        the segment task's state, every ``task_check_seconds`` while steps come, every
        ``QUIET_TASK_CHECK_SECONDS`` when the last poll brought none. Returns the task's state once
        it has finished (the caller looks for a result first: a task that succeeded has one)."""
        check_every = self.task_check_seconds if steps_came else QUIET_TASK_CHECK_SECONDS
        deadline = time.monotonic() + self.poll_interval
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(END_CHECK_SECONDS, left))
            with contextlib.suppress(storage.BucketUnavailable):
                if await self.bucket.in_thread(storage.exists, result_uri):
                    return None
            if time.monotonic() - self._task_checked_at >= check_every:
                self._task_checked_at = time.monotonic()
                state = await self._segment_task_state()
                if state in FINISHED_TASK_STATES:
                    return state
        return None

    def _judge(
        self, detector: StragglerDetector, records: list[dict[str, Any]]
    ) -> tuple[Verdict, str] | None:
        """Feed new records; the verdict and change to fire on, or None to keep watching."""
        fresh = [r for r in records if self.start_after is None or r.get("wall_time", 0.0) > self.start_after]
        for verdict in detector.feed(fresh):
            if verdict.change is not None:
                return verdict, verdict.change
            # A lasting straggler is re-reported so that a policy that declined can weigh it again.
            watched = verdict.window_end - (detector.origin or verdict.window_start)
            if verdict.straggling and self.recheck_seconds > 0 and watched >= self.recheck_seconds:
                return verdict, "ongoing"
        return None
