"""StragglerTrigger: watch one running segment's per-worker timings on the triggerer.

Every ``poll_interval`` seconds it reads the new lines of the segment's event files
(``metrics/seg-ii-proto/*.jsonl``), feeds the ``worker_step`` events to a
:class:`~syncswitch_airflow.detector.StragglerDetector`, and fires one event:

    {"status": "segment_ended"}   the segment's result.json exists (checked every 0.5 s)
    {"status": "not_started"}     no event and no result within ``start_timeout`` s
    {"status": "stalled"}         events stopped for ``idle_timeout`` s without a result (crashed)
    {"status": "verdict", "change": "raised" | "cleared" | "ongoing", "verdict": Verdict.to_dict()}
                                  the detector raised or cleared; "ongoing" every ``recheck_seconds``
                                  of event time while a straggler lasts (0 = never)

Storage reads block, so they run in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from syncswitch import events, storage
from syncswitch.layout import RunLayout

from syncswitch_airflow.detector import DetectorConfig, StragglerDetector, Verdict

END_CHECK_SECONDS = 0.5

CLASSPATH = "syncswitch_airflow.triggers.straggler.StragglerTrigger"


@dataclass
class EventTail:
    """Reads only the complete lines appended to a folder's ``.jsonl`` files since the last call.

    Local files are read from the last offset; gs:// objects (re-uploaded whole by their writer)
    are downloaded and sliced at it.
    """

    folder: str
    offsets: dict[str, int] = field(default_factory=dict)

    def read_new(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for uri in storage.list_files(self.folder, suffix=".jsonl"):
            chunk = self._read_from(uri, self.offsets.get(uri, 0))
            # A writer may be mid-append: keep a torn last line for the next call.
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[uri] = self.offsets.get(uri, 0) + len(complete)
            records.extend(events.parse_lines(complete.decode("utf-8", errors="replace")))
        records.sort(key=lambda r: r.get("wall_time", 0.0))
        return records

    @staticmethod
    def _read_from(uri: str, offset: int) -> bytes:
        if storage.is_remote(uri):
            return storage.read_bytes(uri)[offset:]
        with open(uri, "rb") as f:
            f.seek(offset)
            return f.read()


class StragglerTrigger(BaseTrigger):
    """Fires once: when segment ``index`` (``protocol``) ends, never starts, stalls, or a verdict changes.

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
        poll_interval: float = 2.0,
        start_timeout: float = 300.0,
        idle_timeout: float = 900.0,
        recheck_seconds: float = 0.0,
        detector: dict[str, Any] | None = None,
        start_after: float | None = None,
        straggling_since: float | None = None,
        straggling_workers: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.index = int(index)
        self.protocol = protocol
        self.poll_interval = float(poll_interval)
        self.start_timeout = float(start_timeout)
        self.idle_timeout = float(idle_timeout)
        self.recheck_seconds = float(recheck_seconds)
        self.detector = dict(detector or {})
        self.start_after = start_after
        self.straggling_since = straggling_since
        self.straggling_workers = list(straggling_workers or [])

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "run_dir": self.run_dir,
                "index": self.index,
                "protocol": self.protocol,
                "poll_interval": self.poll_interval,
                "start_timeout": self.start_timeout,
                "idle_timeout": self.idle_timeout,
                "recheck_seconds": self.recheck_seconds,
                "detector": self.detector,
                "start_after": self.start_after,
                "straggling_since": self.straggling_since,
                "straggling_workers": self.straggling_workers,
            },
        )

    def _payload(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "index": self.index, "protocol": self.protocol, **extra}

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
        started = time.monotonic()
        last_new_event: float | None = None
        while True:
            if await asyncio.to_thread(storage.exists, result_uri):
                self.log.info("segment %d (%s) ended; stop watching", self.index, self.protocol)
                yield TriggerEvent(self._payload("segment_ended"))
                return
            records = await asyncio.to_thread(tail.read_new)
            now = time.monotonic()
            if records:
                last_new_event = now
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
                yield TriggerEvent(self._payload("verdict", change=change, verdict=verdict.to_dict()))
                return
            if last_new_event is None and now - started >= self.start_timeout:
                self.log.info(
                    "segment %d (%s) did not start within %.0f s", self.index, self.protocol, now - started
                )
                yield TriggerEvent(self._payload("not_started", waited=round(now - started, 3)))
                return
            if last_new_event is not None and now - last_new_event >= self.idle_timeout:
                idle = now - last_new_event
                self.log.info("segment %d (%s): no new events for %.0f s", self.index, self.protocol, idle)
                yield TriggerEvent(self._payload("stalled", idle=round(idle, 3)))
                return
            await self._sleep_unless_ended(result_uri)

    async def _sleep_unless_ended(self, result_uri: str) -> None:
        """Sleep one poll interval, but look for the segment's end more often: the next segment
        waits for this watcher, so a late "segment_ended" would add to the switch gap."""
        deadline = time.monotonic() + self.poll_interval
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(END_CHECK_SECONDS, left))
            if await asyncio.to_thread(storage.exists, result_uri):
                return

    def _judge(
        self, detector: StragglerDetector, records: list[dict[str, Any]]
    ) -> tuple[Verdict, str] | None:
        """Feed new records; the verdict and change to fire on, or None to keep watching."""
        fresh = [
            r
            for r in records
            if r.get("event") == "worker_step"
            and (self.start_after is None or r.get("wall_time", 0.0) > self.start_after)
        ]
        for verdict in detector.feed(fresh):
            if verdict.change is not None:
                return verdict, verdict.change
            # A lasting straggler is re-reported so that a policy that declined can weigh it again.
            watched = verdict.window_end - (detector.origin or verdict.window_start)
            if verdict.straggling and self.recheck_seconds > 0 and watched >= self.recheck_seconds:
                return verdict, "ongoing"
        return None
