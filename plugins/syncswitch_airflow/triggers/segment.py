"""SegmentTrigger: waits on the triggerer for one detached training segment to end.

It polls the run folder (``result.json``, the chief's ``step`` events) and the cluster backend (is the
launcher still alive?) and fires exactly one event:

    {"status": "success", "result": <result.json>}
    {"status": "failed", "reason": "...", "exit_code": int | None, "log_tail": "..."}

Storage and ``/proc`` reads run in a thread (``asyncio.to_thread``) so the triggerer's event loop is
never blocked. Progress goes to the task log at most every ``log_seconds``.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from syncswitch import events, storage
from syncswitch.layout import RunLayout

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


def read_result(run_dir: str, index: int, protocol: str) -> dict[str, Any] | None:
    """The segment's result.json, or None while it has not been written."""
    return storage.read_json(RunLayout(run_dir).segment_result(index, protocol), default={}) or None


def latest_progress(run_dir: str, index: int, protocol: str) -> Progress | None:
    """The chief's latest ``step`` event of the segment, or None before the first step."""
    folder = RunLayout(run_dir).segment_metrics(index, protocol)
    chief_files = [u for u in storage.list_files(folder, suffix=".jsonl") if _is_chief(u)]
    latest: dict[str, Any] | None = None
    for uri in chief_files:
        for record in events.parse_lines(storage.read_text(uri, default="")):
            if record.get("event") == "step" and (
                latest is None or record.get("wall_time", 0) >= latest.get("wall_time", 0)
            ):
                latest = record
    if latest is None:
        return None
    return Progress(
        global_step=float(latest.get("global_step", 0.0)),
        examples_per_sec=latest.get("examples_per_sec"),
        wall_time=float(latest.get("wall_time", 0.0)),
    )


def _is_chief(uri: str) -> bool:
    return posixpath.basename(uri).startswith("chief")


class SegmentTrigger(BaseTrigger):
    """Fires when segment ``index`` of the run in ``run_dir`` ends, fails, or stalls."""

    def __init__(
        self,
        run_dir: str,
        index: int,
        protocol: str,
        until_step: float,
        handle: Handle,
        poll_seconds: float = 0.5,
        log_seconds: float = 10.0,
        stall_seconds: float = 900.0,
    ) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.index = index
        self.protocol = protocol
        self.until_step = until_step
        self.handle = handle
        self.poll_seconds = poll_seconds
        self.log_seconds = log_seconds
        self.stall_seconds = stall_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "run_dir": self.run_dir,
                "index": self.index,
                "protocol": self.protocol,
                "until_step": self.until_step,
                "handle": self.handle,
                "poll_seconds": self.poll_seconds,
                "log_seconds": self.log_seconds,
                "stall_seconds": self.stall_seconds,
            },
        )

    @property
    def label(self) -> str:
        return f"run {self.handle.get('run')} segment {self.index} ({self.protocol})"

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(self.handle["backend"])
        started = time.monotonic()
        last_step: float | None = None
        last_change = started
        next_log = started
        while True:
            result = await asyncio.to_thread(read_result, self.run_dir, self.index, self.protocol)
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
            if now >= next_log:
                next_log = now + self.log_seconds
                progress = await asyncio.to_thread(latest_progress, self.run_dir, self.index, self.protocol)
                step = progress.global_step if progress else None
                if step != last_step:
                    last_step, last_change = step, now
                self._log_progress(progress, now - started)
                if now - last_change > self.stall_seconds:
                    yield TriggerEvent(
                        {
                            "status": "failed",
                            "reason": f"no progress for {self.stall_seconds:.0f} s (at step {last_step})",
                            "exit_code": None,
                            "log_tail": await asyncio.to_thread(
                                backend.segment_log_tail, self.handle, self.index
                            ),
                        }
                    )
                    return
            await asyncio.sleep(self.poll_seconds)

    async def _launcher_gone(self, backend: Any, exit_code: int | None) -> TriggerEvent:
        # The chief writes result.json before the launcher exits; read once more to close the race.
        result = await asyncio.to_thread(read_result, self.run_dir, self.index, self.protocol)
        if result is not None:
            return TriggerEvent({"status": "success", "result": result})
        how = f"exited with code {exit_code}" if exit_code is not None else "vanished without an exit code"
        return TriggerEvent(
            {
                "status": "failed",
                "reason": f"the launcher {how} before writing result.json",
                "exit_code": exit_code,
                "log_tail": await asyncio.to_thread(backend.segment_log_tail, self.handle, self.index),
            }
        )

    def _log_progress(self, progress: Progress | None, elapsed: float) -> None:
        if progress is None:
            self.log.info("%s: starting (%.0f s since launch)", self.label, elapsed)
            return
        rate = f"{progress.examples_per_sec:.0f} examples/s" if progress.examples_per_sec else "rate n/a"
        self.log.info(
            "%s: step %.1f / %s, %s", self.label, progress.global_step, _fmt_step(self.until_step), rate
        )


def _fmt_step(step: float) -> str:
    return f"{step:g}"
