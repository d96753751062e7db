"""What a segment reports while it trains, each piece a class of its own:

    ProgressFile    the chief's latest step, loss and rate, for the launcher's progress lines
    ChiefReporter   the chief's rate-limited ``step`` events, TensorBoard scalars, the progress file
                    and the segment's result
    WorkerTimer     every worker's ``worker_step`` events: step, compute and wait times
    StepBook        what both loops do after each call or closure of k steps: timings, progress and
                    the finite-loss check

syncswitch.trainer's SegmentSession puts them together for a segment's loop.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from syncswitch import storage
from syncswitch.context import NodeContext
from syncswitch.events import EventWriter
from syncswitch.peers import PeerProbe

LOG_INTERVAL_SECONDS = 1.0
WORKER_EVENT_INTERVAL_SECONDS = 0.25


class ProgressFile:
    """A small local file the chief writes and the launcher reads to show progress without parsing
    events: the chief's latest step, loss and rate."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, "progress.json")

    def write(self, **fields: Any) -> None:
        storage.write_json(self.path, fields)

    def read(self) -> dict[str, Any] | None:
        """The latest progress; None before the chief's first write."""
        return storage.read_json(self.path, default=None)

    def clear(self) -> None:
        storage.delete(self.path)


class ChiefReporter:
    """Rate-limited `step` events, the progress file and the segment result, written by the chief."""

    def __init__(self, ctx: NodeContext, events: EventWriter, global_batch: int, start_samples: int) -> None:
        self.ctx, self.events, self.global_batch = ctx, events, global_batch
        self.progress = ProgressFile(ctx.work_dir)
        self.start_samples = start_samples
        self.started = time.time()
        self.first_step_at: float | None = None
        self._last_emit = 0.0
        self._unreported: dict[str, Any] | None = None
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
            # Kept, so that the segment's last step is an event (finish), however short the segment.
            self._unreported = dict(
                samples=samples, updates=updates, loss=loss, lr=lr, momentum=momentum, step_time=step_time
            )
            return
        self._unreported = None
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
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self._unreported is not None:
            self.step(**self._unreported, force=True)
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
            # This process's retries of bucket calls (the Airflow side reports them as a metric).
            "bucket_retries": storage.retry_count(),
            **(extra or {}),
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
        scores = {k: v for k, v in (evaluation or {}).items() if k.startswith("test_")}
        if scores:
            self.events.emit("eval", global_step=result["end_step"], **scores)
            self.tensorboard.scalars(result["end_step"], **scores)
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


class WorkerTimer:
    """Per-worker `worker_step` events (the straggler detector's input), averaged over
    WORKER_EVENT_INTERVAL_SECONDS, with the bytes sent per step and, where ``clock_leads`` (SSP),
    the largest clock lead of the window's steps."""

    def __init__(
        self, events: EventWriter, worker: int, probe: PeerProbe | None = None, *, clock_leads: bool = False
    ) -> None:
        self.events, self.worker, self.probe = events, worker, probe
        self.clock_leads = clock_leads
        self._steps: list[tuple[float, float, float, float]] = []
        self._max_lead = 0
        self._last_emit = time.monotonic()
        self._global_step = 0.0

    def record(
        self,
        *,
        global_step: float,
        step_time: float,
        compute_time: float,
        wait_time: float | None = None,
        bytes_sent: float = 0.0,
        clock_lead: float = 0.0,
    ) -> None:
        wait = max(step_time - compute_time, 0.0) if wait_time is None else wait_time
        self._steps.append((step_time, compute_time, wait, bytes_sent))
        self._max_lead = max(self._max_lead, int(clock_lead))
        self._global_step = global_step
        if time.monotonic() - self._last_emit >= WORKER_EVENT_INTERVAL_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self._steps:
            return
        count = len(self._steps)
        step_time, compute_time, wait_time, bytes_sent = (
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
            bytes_sent=bytes_sent,
            **({"clock_lead": self._max_lead} if self.clock_leads else {}),
            **({"peer_rtt": self.probe.rtt} if self.probe is not None and self.probe.rtt is not None else {}),
        )
        self._steps.clear()
        self._max_lead = 0
        self._last_emit = time.monotonic()


class StepBook:
    """What every loop does after each call or closure of k steps: the worker's per-step timings, the
    chief's rate-limited step event (with the LR and momentum of the last step), the bytes sent, and
    the finite-loss check. ``records`` holds one row per step (trainer.RECORD_COLUMNS: loss, own
    seconds, step seconds, bytes sent, clock lead)."""

    def __init__(
        self,
        schedule_at: Callable[[float], tuple[float, float]],
        global_batch: int,
        reporter: ChiefReporter | None,
    ) -> None:
        """``schedule_at(step)``: the LR and momentum at a global step (``Schedule.at``)."""
        self.schedule_at, self.global_batch, self.reporter = schedule_at, global_batch, reporter
        self.rows, self.bytes_sent = 0, 0.0

    @property
    def bytes_per_step(self) -> float:
        """Bytes a worker sent per optimizer step of its own (a BSP-equivalent step, or an ASP
        update: one per worker per step either way), over the steps this node saw."""
        return self.bytes_sent / self.rows if self.rows else 0.0

    def after_steps(
        self, records: Any, timer: WorkerTimer, *, samples: int, updates: int, samples_per_step: int
    ) -> None:
        """``samples`` and ``updates`` count up to the last of the steps; each step is
        ``samples_per_step`` samples (a BSP step is the global batch, an ASP update one worker's)."""
        last_step = samples / self.global_batch
        step = samples_per_step / self.global_batch
        for j, (_loss, own, took, sent, lead) in enumerate(records):
            global_step = last_step - (len(records) - 1 - j) * step
            timer.record(
                global_step=global_step,
                step_time=float(took),
                compute_time=float(own),
                bytes_sent=float(sent),
                clock_lead=float(lead),
            )
            self.rows += 1
            self.bytes_sent += float(sent)
        loss = float(records[-1][0])
        if self.reporter is not None:
            lr, momentum = self.schedule_at(last_step - step)
            step_time = float(records[-1][2])
            self.reporter.step(
                samples=samples, updates=updates, loss=loss, lr=lr, momentum=momentum, step_time=step_time
            )
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {last_step:g}")
