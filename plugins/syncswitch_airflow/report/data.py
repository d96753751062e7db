"""A run folder as data: its segments, events, straggler windows, and the summary of numbers."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from syncswitch import storage
from syncswitch.costs import run_ledger
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch.plan import protocol_of
from syncswitch.protocols import Protocol

log = logging.getLogger(__name__)

COMPLETE = "complete"
INCOMPLETE = "incomplete"
NOT_STARTED = "not_started"
_SEGMENT_DIR_RE = re.compile(r"^seg-(\d+)-([a-z]+)$")


# --- reading the run folder -------------------------------------------------------------------


@dataclass
class SegmentView:
    """One segment as the report sees it: its result.json if written, else what its events show."""

    index: int
    protocol: str
    origin: str = "plan"
    until_step: float | None = None
    protocol_args: dict[str, Any] | None = None  # the plan entry's (result.json has them too)
    result: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.result is not None:
            return COMPLETE
        return INCOMPLETE if self.events else NOT_STARTED

    @property
    def label(self) -> str:
        suffix = "" if self.status == COMPLETE else f" ({self.status.replace('_', ' ')})"
        return f"seg {self.index} {self.protocol.upper()}{suffix}"

    def _events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def chief_steps(self) -> list[dict[str, Any]]:
        return [e for e in self._events("step") if e.get("loss") is not None]

    @property
    def _segment_end(self) -> dict[str, Any]:
        ends = self._events("segment_end")
        return ends[-1] if ends else {}

    def _from_result(self, key: str) -> Any:
        """A SegmentResult field, falling back to the chief's segment_end event (same meaning)."""
        if self.result is not None and self.result.get(key) is not None:
            return self.result[key]
        return self._segment_end.get(key)

    @property
    def starts(self) -> list[dict[str, Any]]:
        """The chief's segment_start event of each attempt, in time order (as every event list). More
        than one: an attempt failed and a retry resumed the segment from its latest checkpoint."""
        return self._events("segment_start")

    @property
    def resumed_at(self) -> list[float]:
        """The steps that retries resumed from (none when the first attempt finished)."""
        return [s["start_step"] for s in self.starts[1:] if s.get("start_step") is not None]

    @property
    def start_step(self) -> float | None:
        # The hand-off: the first attempt's start. A retry's result.json starts where it resumed.
        starts = self.starts
        if starts and starts[0].get("start_step") is not None:
            return starts[0]["start_step"]
        value = self._from_result("start_step")
        if value is not None:
            return value
        steps = self.chief_steps
        return steps[0]["global_step"] if steps else None

    @property
    def end_step(self) -> float | None:
        value = self._from_result("end_step")
        if value is None:
            value = self._segment_end.get("global_step")
        if value is None and self.chief_steps:
            value = self.chief_steps[-1]["global_step"]
        return value

    @property
    def steps(self) -> float | None:
        if self.start_step is None or self.end_step is None:
            return None
        return self.end_step - self.start_step

    @property
    def started_at(self) -> float | None:
        # The earlier of the finishing attempt's launch and the first event: after a retry, the
        # failed attempt's events come first.
        return _earliest(
            self._from_result("started_at"), self.events[0].get("wall_time") if self.events else None
        )

    @property
    def first_step_at(self) -> float | None:
        first_event = self.chief_steps[0].get("wall_time") if self.chief_steps else None
        return _earliest(self._from_result("first_step_at"), first_event)

    @property
    def ended_at(self) -> float | None:
        """When the segment ended; for an incomplete one, its last sign of life."""
        value = self._from_result("ended_at")
        if value is None:
            value = self._segment_end.get("wall_time")
        if value is None and self.events:
            value = self.events[-1].get("wall_time")
        return value

    @property
    def seconds(self) -> float | None:
        value = self._from_result("seconds")
        if value is None and len(self.chief_steps) >= 2:
            value = self.chief_steps[-1]["wall_time"] - self.chief_steps[0]["wall_time"]
        return value

    @property
    def examples_per_sec(self) -> float | None:
        value = self._from_result("examples_per_sec")
        if value is not None:
            return value
        # Incomplete segment: progress in samples over the time its steps spanned.
        steps = [s for s in self.chief_steps if s.get("samples") is not None]
        if len(steps) >= 2 and steps[-1]["wall_time"] > steps[0]["wall_time"]:
            return (steps[-1]["samples"] - steps[0]["samples"]) / (
                steps[-1]["wall_time"] - steps[0]["wall_time"]
            )
        return None

    @property
    def settings(self) -> Protocol | None:
        """The protocol with its settings (SSP's s, local SGD's H, the compression); None where the
        plan and result name settings that no switch order spells (a folder of a newer version)."""
        args = self.protocol_args or self._from_result("protocol_args")
        try:
            return protocol_of({"protocol": self.protocol, "protocol_args": args})
        except ValueError:
            return None

    @property
    def reason(self) -> str | None:
        value = self._from_result("reason")
        if value is None and self.status == INCOMPLETE:
            return "no result.json: the segment failed, was killed or is still running"
        return value

    def to_summary(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "index": self.index,
            "protocol": self.protocol,
            "protocol_token": settings.token if settings else self.protocol,
            "protocol_label": settings.label if settings else self.protocol.upper(),
            "origin": self.origin,
            "status": self.status,
            "start_step": self.start_step,
            "end_step": self.end_step,
            "until_step": self.until_step,
            "steps": self.steps,
            "started_at": self.started_at,
            "first_step_at": self.first_step_at,
            "ended_at": self.ended_at,
            "seconds": self.seconds,
            "examples_per_sec": self.examples_per_sec,
            "bytes_per_worker_step": self._from_result("bytes_per_worker_step"),
            "stopped_early": self._from_result("stopped_early"),
            "reason": self.reason,
            "test_accuracy": (self.result or {}).get("test_accuracy"),
            "test_loss": (self.result or {}).get("test_loss"),
            "startup": (self.result or {}).get("startup"),
            "attempts": len(self.starts) or (1 if self.result is not None else 0),
            "resumed_at": self.resumed_at,
        }


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


@dataclass
class RunData:
    """Everything the report draws and summarises, read once from the run folder."""

    layout: RunLayout
    state: dict[str, Any]
    segments: list[SegmentView]
    events: list[dict[str, Any]]
    straggler_windows: list[dict[str, Any]]
    node_logs: list[str] = field(default_factory=list)  # every log under the run's logs/ folder

    @property
    def started_segments(self) -> list[SegmentView]:
        return [s for s in self.segments if s.status != NOT_STARTED]

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return list(self.state.get("decisions") or [])

    @property
    def run_start(self) -> float:
        """Time zero of the time axes: the first segment's start (or the earliest event)."""
        candidates = [s.started_at for s in self.started_segments if s.started_at is not None]
        candidates += [e["wall_time"] for e in self.events[:1] if "wall_time" in e]
        return min(candidates) if candidates else 0.0

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def chief_steps(self) -> list[dict[str, Any]]:
        return [s for seg in self.started_segments for s in seg.chief_steps]

    def seconds_to_accuracy(self, target: float) -> float | None:
        """Training seconds from the first step to the first checkpoint evaluation at ``target`` or
        better, the evaluations' own seconds (in their events) taken out; None if never reached.

        Needs eval events with ``seconds``, i.e. a job run with evaluate_checkpoints."""
        firsts = [s.first_step_at for s in self.started_segments if s.first_step_at is not None]
        if not firsts:
            return None
        evals = sorted(
            (e for e in self.of_kind("eval") if "seconds" in e and e.get("test_accuracy") is not None),
            key=lambda e: e["wall_time"],
        )
        spent_evaluating = 0.0
        for event in evals:
            if event["test_accuracy"] >= target:
                return event["wall_time"] - event["seconds"] - spent_evaluating - min(firsts)
            spent_evaluating += event["seconds"]
        return None

    def step_at(self, wall_time: float) -> float | None:
        """The global step at a wall time, interpolated on the chief's step events."""
        import numpy as np

        points = sorted((s["wall_time"], s["global_step"]) for s in self.chief_steps)
        if not points:
            return None
        times, steps = zip(*points, strict=True)
        return float(np.interp(wall_time, times, steps))


def load_run(run_dir: str) -> RunData:
    layout = RunLayout(run_dir)
    state = storage.read_json(layout.state, default={}) or {}
    events = read_events(layout.metrics)
    segments = _collect_segments(layout, state, events)
    windows = _straggler_windows(state, events)
    return RunData(layout, state, segments, events, windows, storage.list_files(layout.logs, suffix=".log"))


def _collect_segments(
    layout: RunLayout, state: dict[str, Any], events: list[dict[str, Any]]
) -> list[SegmentView]:
    """Union of the plan, the metrics folders and state["segments"], in index order."""
    views: dict[tuple[int, str], SegmentView] = {}
    for entry in state.get("plan") or []:
        key = (int(entry["index"]), entry["protocol"])
        views[key] = SegmentView(
            *key,
            origin=entry.get("origin", "plan"),
            until_step=entry.get("until_step"),
            protocol_args=entry.get("protocol_args"),
        )
    for name in storage.list_dirs(layout.metrics):
        match = _SEGMENT_DIR_RE.match(name)
        if match:
            key = (int(match.group(1)), match.group(2))
            views.setdefault(key, SegmentView(*key))
    for result in (state.get("segments") or {}).values():
        key = (int(result["index"]), result["protocol"])
        views.setdefault(key, SegmentView(*key))
    for (index, protocol), view in views.items():
        # result.json is the chief's own record; state.json's copy is the fallback.
        # read_json raises for a missing object when default is None, so ask for {} and map it back.
        view.result = storage.read_json(layout.segment_result(index, protocol), default={}) or None
        if view.result is None:
            stored = (state.get("segments") or {}).get(str(index))
            if stored and stored.get("protocol") == protocol:
                view.result = stored
        view.events = [e for e in events if e.get("segment") == index and e.get("protocol") == protocol]
    return sorted(views.values(), key=lambda v: (v.index, v.started_at or 0.0))


def _straggler_windows(state: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Injected slowdown windows in epoch seconds, one per (worker, start, end).

    Taken from ``straggler`` events; several processes may announce the same window. Without any
    event, the job's straggler specs are placed relative to the first BSP segment's start.
    """
    windows: dict[tuple[int, float, float], dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "straggler" and e.get("start") is not None and e.get("end") is not None:
            key = (int(e["worker"]), round(float(e["start"]), 3), round(float(e["end"]), 3))
            windows[key] = {
                "worker": key[0],
                "slowdown": e.get("slowdown"),
                "delay_ms": e.get("delay_ms"),
                "start": key[1],
                "end": key[2],
            }
    reference = (state.get("timings") or {}).get("first_bsp_start")
    if not windows and reference is not None:
        from syncswitch.spec import StragglerSpec

        for text in (state.get("job") or {}).get("stragglers") or []:
            spec = StragglerSpec.parse(text)
            start = reference + spec.start
            windows[(spec.worker, start, start + spec.duration)] = {
                "worker": spec.worker,
                "slowdown": spec.slowdown,
                "delay_ms": spec.delay_ms,
                "start": start,
                "end": start + spec.duration,
            }
    return sorted(windows.values(), key=lambda w: (w["start"], w["worker"]))


# --- the summary ----------------------------------------------------------------------------------


def summarize(data: RunData) -> dict[str, Any]:
    """The numbers of one run; image paths are added by ``build_report``."""
    started = data.started_segments
    per_segment = [s.to_summary() for s in data.segments]
    ends = [s.ended_at for s in started if s.ended_at is not None]
    first_start = started[0].started_at if started else None
    training = [s.seconds for s in started if s.seconds is not None]
    accuracy, accuracy_source = _final_accuracy(data)
    return {
        "run_id": data.state.get("run_id"),
        "job_name": data.state.get("job_name"),
        "run_dir": data.layout.root,
        "status": data.state.get("status"),
        "complete": bool(data.segments) and all(s.status == COMPLETE for s in data.segments),
        "final_accuracy": accuracy,
        "final_accuracy_source": accuracy_source,
        "workload_steps": _workload_steps(data),
        "steps_done": max((s.end_step for s in started if s.end_step is not None), default=None),
        "total_seconds": max(ends) - first_start if ends and first_start is not None else None,
        "training_seconds": sum(training) if training else None,
        "examples_per_sec": _overall_examples_per_sec(started),
        "segments": per_segment,
        "switch_gaps_seconds": _switch_gaps(started),
        "online_switches": data.decisions,
        "straggler_windows": data.straggler_windows,
        "lost_nodes": _lost_nodes(data),
        "node_logs": _node_logs(data),
        "segment_failures": _segment_failures(data),
        # What was trained and where it went: the user code's digest, the exported model.
        "model": {k: data.state.get("job", {}).get(k) for k in ("model", "problem", "hparam_set")},
        "user_code": data.state.get("user_code") or {},
        "export": (data.state.get("final") or {}).get("export"),
        **cluster_summary(data.state),
    }


def _lost_nodes(data: RunData) -> list[dict[str, Any]]:
    """The nodes that ended before their segment (the launcher's ``node_lost`` events)."""
    keys = ("segment", "protocol", "node", "host", "exit_code", "global_step", "outcome")
    return [{"time": e.get("wall_time"), **{k: e.get(k) for k in keys}} for e in data.of_kind("node_lost")]


def _node_logs(data: RunData) -> list[dict[str, Any]]:
    """Each segment's logs (``logs/<segment>/<node>.log``), as links relative to the report's page."""
    by_segment: dict[str, dict[str, str]] = {}
    root = data.layout.logs.rstrip("/") + "/"
    for uri in data.node_logs:
        segment, _, name = uri.removeprefix(root).partition("/")
        if name and "/" not in name:
            by_segment.setdefault(segment, {})[name.removesuffix(".log")] = f"../logs/{segment}/{name}"
    return [
        {"segment": segment, "logs": dict(sorted(logs.items()))}
        for segment, logs in sorted(by_segment.items())
    ]


def _segment_failures(data: RunData) -> list[dict[str, Any]]:
    """The failed tries of segments, each with the node that failed first (``segment_failed``)."""
    keys = ("segment", "protocol", "reason", "node", "host", "exit_code", "lost", "global_step", "log")
    return [
        {"time": e.get("wall_time"), **{k: e.get(k) for k in keys}} for e in data.of_kind("segment_failed")
    ]


def cluster_summary(run_state: dict[str, Any]) -> dict[str, Any]:
    """The cluster's story for the report: its VMs' revocations and replacements, and the bill so far
    (the finalize task refreshes it once every VM has ended)."""
    return {
        "cluster_events": run_state.get("cluster_events", []),
        "cost": run_state.get("cost") or run_ledger(run_state),
    }


def _final_accuracy(data: RunData) -> tuple[float | None, str | None]:
    """The most recent accuracy measurement: an eval event or a segment's final test accuracy."""
    measured: list[tuple[float, float, str]] = []
    for e in data.of_kind("eval"):
        if e.get("test_accuracy") is not None:
            measured.append(
                (e.get("wall_time", 0.0), e["test_accuracy"], f"eval event at step {e.get('global_step')}")
            )
    for seg in data.segments:
        acc = (seg.result or {}).get("test_accuracy")
        if acc is not None:
            measured.append((seg.ended_at or 0.0, acc, f"segment {seg.index} result.json"))
    if not measured:
        return None, None
    _time, acc, source = max(measured, key=lambda m: m[0])
    return acc, source


def _workload_steps(data: RunData) -> float | None:
    # until_step is cumulative, so the plan's largest target is the whole job's workload.
    targets = [s.until_step for s in data.segments if s.until_step is not None]
    if targets:
        return max(targets)
    job = data.state.get("job")
    if job:
        from syncswitch.spec import JobSpec, SpecError

        try:
            return JobSpec.from_params(job).workload
        except SpecError:
            return None
    return None


def _overall_examples_per_sec(segments: list[SegmentView]) -> float | None:
    """Examples over training seconds: each segment's rate weighted by its duration."""
    pairs = [(s.examples_per_sec, s.seconds) for s in segments if s.examples_per_sec and s.seconds]
    seconds = sum(sec for _eps, sec in pairs)
    return sum(eps * sec for eps, sec in pairs) / seconds if seconds else None


def _switch_gaps(segments: list[SegmentView]) -> list[dict[str, Any]]:
    """For each consecutive pair: the last step of one segment to the first step of the next.

    The gap is a hand-off (the previous segment's result to the next launcher's start: the old
    nodes stopped, the next task scheduled, the launcher started) then the next segment's start-up."""
    gaps = []
    for prev, nxt in zip(segments, segments[1:], strict=False):
        seconds = handoff = None
        if prev.ended_at is not None and nxt.first_step_at is not None:
            seconds = nxt.first_step_at - prev.ended_at
        if prev.ended_at is not None and nxt.started_at is not None:
            handoff = nxt.started_at - prev.ended_at
        gaps.append(
            {
                "from_segment": prev.index,
                "to_segment": nxt.index,
                "from_protocol": prev.protocol,
                "to_protocol": nxt.protocol,
                "ended_at": prev.ended_at,
                "first_step_at": nxt.first_step_at,
                "seconds": seconds,
                "handoff_seconds": handoff,
                # The next segment's own account of its start-up (checkpoint write, process start,
                # restore, first step, ...), passed through with whatever keys the chief wrote.
                "startup": (nxt.result or {}).get("startup"),
            }
        )
    return gaps
