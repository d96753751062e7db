"""SegmentTrigger: waits on the triggerer for one detached training segment to end.

It polls the run folder (``result.json``; the chief's ``step`` events through the one event reader,
``syncswitch.events.EventTail``) and the cluster backend (is the launcher still alive?) and fires exactly
one event:

    {"status": "success", "result": <result.json>}
    {"status": "failed", "reason": "...", "exit_code": int | None, "log_tail": "..."}

Storage and ``/proc`` reads run in a thread (``asyncio.to_thread``) so the triggerer's event loop is
never blocked. Progress goes to the task log every ``log_seconds``. A segment whose step stops moving
is failed by the rule of ``syncswitch.stall`` (the launcher applies it first; the trigger only when the
launcher itself hangs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from syncswitch import storage
from syncswitch.events import EventTail
from syncswitch.layout import RunLayout
from syncswitch.stall import DEFAULT_STALL_SECONDS, TRIGGER_GRACE_SECONDS, StallWatch

from syncswitch_airflow.backends import get_backend
from syncswitch_airflow.backends.base import EXITED, UNKNOWN, Handle

# How long a launcher may be unknown to the backend before the segment counts as lost (the launch
# record is written right after the process starts, so this only covers a wiped work folder).
_UNKNOWN_GRACE_S = 30.0


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


def read_result(run_dir: str, index: int, protocol: str) -> dict[str, Any] | None:
    """The segment's result.json, or None while it has not been written."""
    return storage.read_json(RunLayout(run_dir).segment_result(index, protocol), default={}) or None


class SegmentTrigger(BaseTrigger):
    """Fires when segment ``index`` of the run in ``run_dir`` ends, fails, or stalls."""

    def __init__(
        self,
        run_dir: str,
        index: int,
        protocol: str,
        until_step: float,
        handle: Handle,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        stall_grace_seconds: float = TRIGGER_GRACE_SECONDS,
        poll_seconds: float = 0.5,
        progress_seconds: float = 2.0,
        log_seconds: float = 30.0,
    ) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.index = index
        self.protocol = protocol
        self.until_step = until_step
        self.handle = handle
        self.stall_seconds = stall_seconds
        self.stall_grace_seconds = stall_grace_seconds
        self.poll_seconds = poll_seconds
        self.progress_seconds = progress_seconds
        self.log_seconds = log_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "run_dir": self.run_dir,
                "index": self.index,
                "protocol": self.protocol,
                "until_step": self.until_step,
                "handle": self.handle,
                "stall_seconds": self.stall_seconds,
                "stall_grace_seconds": self.stall_grace_seconds,
                "poll_seconds": self.poll_seconds,
                "progress_seconds": self.progress_seconds,
                "log_seconds": self.log_seconds,
            },
        )

    @property
    def label(self) -> str:
        return f"run {self.handle.get('run')} segment {self.index} ({self.protocol})"

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(self.handle["backend"])
        tail = EventTail(RunLayout(self.run_dir).segment_metrics(self.index, self.protocol))
        stall = StallWatch(self.stall_seconds)
        progress: Progress | None = None
        started = time.monotonic()
        next_look = next_log = started
        while True:
            result = await self._from_bucket(read_result, self.run_dir, self.index, self.protocol)
            if result is not None:
                yield TriggerEvent({"status": "success", "result": result})
                return
            status = await asyncio.to_thread(backend.segment_status, self.handle, self.index)
            lost = status.state == EXITED or (
                status.state == UNKNOWN and time.monotonic() - started > _UNKNOWN_GRACE_S
            )
            if lost:
                yield await self._launcher_gone(backend, status.exit_code)
                return
            now = time.monotonic()
            if now >= next_look:
                next_look = now + self.progress_seconds
                steps = await self._from_bucket(tail.read_new, "step") or []
                if steps:
                    progress = Progress.from_event(steps[-1])
                stall.observe(progress.global_step if progress else None)
                if now >= next_log:
                    next_log = now + self.log_seconds
                    self._log_progress(progress, now - started)
                reason = stall.stalled(grace=self.stall_grace_seconds)
                if reason:
                    yield await self._failed(backend, reason, exit_code=None)
                    return
            await asyncio.sleep(self.poll_seconds)

    async def _from_bucket(self, read: Any, *args: Any) -> Any:
        """``read(*args)`` in a thread; None while the bucket stays unreachable past its retry limit
        (the launcher, which needs the bucket too, decides whether the segment survives that)."""
        try:
            return await asyncio.to_thread(read, *args)
        except storage.BucketUnavailable as exc:
            self.log.warning("%s: %s; still watching", self.label, exc)
            return None

    async def _launcher_gone(self, backend: Any, exit_code: int | None) -> TriggerEvent:
        # The chief writes result.json before the launcher exits; read once more to close the race.
        result = await self._from_bucket(read_result, self.run_dir, self.index, self.protocol)
        if result is not None:
            return TriggerEvent({"status": "success", "result": result})
        how = f"exited with code {exit_code}" if exit_code is not None else "vanished without an exit code"
        return await self._failed(backend, f"the launcher {how} before writing result.json", exit_code)

    async def _failed(self, backend: Any, reason: str, exit_code: int | None) -> TriggerEvent:
        log_tail = await asyncio.to_thread(backend.segment_log_tail, self.handle, self.index)
        return TriggerEvent(
            {"status": "failed", "reason": reason, "exit_code": exit_code, "log_tail": log_tail}
        )

    def _log_progress(self, progress: Progress | None, elapsed: float) -> None:
        if progress is None:
            self.log.info("%s: waiting for the first step (%.0f s so far)", self.label, elapsed)
            return
        rate = f"{progress.examples_per_sec:.0f} examples/s" if progress.examples_per_sec else "rate n/a"
        self.log.info(
            "%s: step %.1f / %s, %s", self.label, progress.global_step, _fmt_step(self.until_step), rate
        )


def _fmt_step(step: float) -> str:
    return f"{step:g}"
