"""The per-run report: PNG plots, ``summary.json`` and a small ``index.html`` in ``<run>/report/``.

``build_report(run_dir)`` reads one run folder (local or ``gs://``) through ``syncswitch.storage``:
``state.json`` (plan, decisions, job), every segment's ``result.json`` and all JSON-lines events, and
writes into ``RunLayout(run_dir).report``:

    loss_vs_step.png, loss_vs_time.png   chief training loss, segments shaded by protocol
    accuracy.png                         test accuracy from eval events, vs step and vs time
    throughput.png                       examples/s per segment and over time
    worker_step_times.png                per-worker step / compute time (where stragglers show)
    summary.json                         the numbers (see ``summarize``)
    index.html                           the tables and the plots

A segment without ``result.json`` (failed, killed, or still running) is reported from its events and
marked ``incomplete``; a planned segment with no events at all is ``not_started``. Plots with no data
(e.g. no eval events) are left out and listed under ``images_skipped``.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from syncswitch import storage
from syncswitch.costs import run_ledger
from syncswitch.events import read_events
from syncswitch.layout import RunLayout, join

log = logging.getLogger(__name__)

COMPLETE = "complete"
INCOMPLETE = "incomplete"
NOT_STARTED = "not_started"

PROTOCOL_COLORS = {"bsp": "#1f77b4", "asp": "#ff7f0e"}
STRAGGLER_COLOR = "#d62728"
GAP_COLOR = "#7f7f7f"
DECISION_COLOR = "#9467bd"
# No red (stragglers), purple (decisions), blue or orange (protocols) among the worker colours.
WORKER_COLORS = ("#2ca02c", "#8c564b", "#17becf", "#e377c2", "#bcbd22", "#393b79", "#637939", "#843c39")

IMAGE_FILES = {
    "loss_vs_step": "loss_vs_step.png",
    "loss_vs_time": "loss_vs_time.png",
    "accuracy": "accuracy.png",
    "throughput": "throughput.png",
    "worker_step_times": "worker_step_times.png",
}
_SEGMENT_DIR_RE = re.compile(r"^seg-(\d+)-([a-z]+)$")
_DPI = 110


# --- reading the run folder -------------------------------------------------------------------


@dataclass
class SegmentView:
    """One segment as the report sees it: its result.json if written, else what its events show."""

    index: int
    protocol: str
    origin: str = "plan"
    until_step: float | None = None
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
    def start_step(self) -> float | None:
        value = self._from_result("start_step")
        if value is not None:
            return value
        starts = self._events("segment_start")
        if starts and starts[0].get("start_step") is not None:
            return starts[0]["start_step"]
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
        value = self._from_result("started_at")
        if value is None and self.events:
            value = self.events[0].get("wall_time")
        return value

    @property
    def first_step_at(self) -> float | None:
        value = self._from_result("first_step_at")
        if value is None and self.chief_steps:
            value = self.chief_steps[0].get("wall_time")
        return value

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
    def reason(self) -> str | None:
        value = self._from_result("reason")
        if value is None and self.status == INCOMPLETE:
            return "no result.json: the segment failed, was killed or is still running"
        return value

    def to_summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "protocol": self.protocol,
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
            "stopped_early": self._from_result("stopped_early"),
            "reason": self.reason,
            "test_accuracy": (self.result or {}).get("test_accuracy"),
            "test_loss": (self.result or {}).get("test_loss"),
            "startup": (self.result or {}).get("startup"),
        }


@dataclass
class RunData:
    """Everything the report draws and summarises, read once from the run folder."""

    layout: RunLayout
    state: dict[str, Any]
    segments: list[SegmentView]
    events: list[dict[str, Any]]
    straggler_windows: list[dict[str, Any]]

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
    return RunData(layout, state, segments, events, windows)


def _collect_segments(
    layout: RunLayout, state: dict[str, Any], events: list[dict[str, Any]]
) -> list[SegmentView]:
    """Union of the plan, the metrics folders and state["segments"], in index order."""
    views: dict[tuple[int, str], SegmentView] = {}
    for entry in state.get("plan") or []:
        key = (int(entry["index"]), entry["protocol"])
        views[key] = SegmentView(*key, origin=entry.get("origin", "plan"), until_step=entry.get("until_step"))
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


# --- plots ------------------------------------------------------------------------------------------


def new_figure(rows: int = 1, height: float = 4.8, cols: int = 1):  # noqa: ANN201 - matplotlib types
    """A figure on the Agg canvas, without pyplot's global figure registry (safe in any process);
    ``rows`` x ``cols`` axes, 11 inches wide, ``height`` inches per row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, height * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(rows * cols)]
    return fig, axes


def _x_of(data: RunData, wall_time: float, axis: str) -> float | None:
    return wall_time - data.run_start if axis == "time" else data.step_at(wall_time)


def _segment_span(data: RunData, seg: SegmentView, axis: str) -> tuple[float, float] | None:
    if axis == "step":
        if seg.start_step is None or seg.end_step is None:
            return None
        return seg.start_step, seg.end_step
    begin = seg.first_step_at or seg.started_at
    if begin is None or seg.ended_at is None:
        return None
    return begin - data.run_start, seg.ended_at - data.run_start


def _mark_run(ax, data: RunData, axis: str) -> None:  # noqa: ANN001 - matplotlib Axes
    """Shade segments by protocol, mark boundaries, switch gaps, straggler windows and decisions."""
    top = ax.get_xaxis_transform()  # x in data units, y in axes fraction
    started = data.started_segments
    for i, seg in enumerate(started):
        span = _segment_span(data, seg, axis)
        if span is None:
            continue
        color = PROTOCOL_COLORS.get(seg.protocol, GAP_COLOR)
        hatch = None if seg.status == COMPLETE else "//"
        ax.axvspan(*span, color=color, alpha=0.10, hatch=hatch, lw=0, label=f"{seg.protocol.upper()} segment")
        ax.text(span[0], 0.985, f" {seg.label}", transform=top, va="top", ha="left", fontsize=8, color=color)
        if i > 0:
            ax.axvline(span[0], color="black", ls="--", lw=0.9, label="segment boundary")
        if axis == "time" and i + 1 < len(started):
            ax.axvline(span[1], color="black", ls="--", lw=0.9, label="segment boundary")
    if axis == "time":
        _mark_first_startup(ax, data)
        for prev, nxt in zip(started, started[1:], strict=False):
            if prev.ended_at is not None and nxt.first_step_at is not None:
                ax.axvspan(
                    prev.ended_at - data.run_start,
                    nxt.first_step_at - data.run_start,
                    color=GAP_COLOR,
                    alpha=0.25,
                    lw=0,
                    label="switch gap (no training)",
                )
    _mark_stragglers(ax, data, axis)
    _mark_decisions(ax, data, axis)


def _mark_first_startup(ax, data: RunData) -> None:  # noqa: ANN001
    """The first segment's launch -> first step; later start-ups are inside the switch gaps."""
    started = data.started_segments
    if started and started[0].started_at is not None and started[0].first_step_at is not None:
        ax.axvspan(
            started[0].started_at - data.run_start,
            started[0].first_step_at - data.run_start,
            color=GAP_COLOR,
            alpha=0.12,
            lw=0,
            label="start-up (launch -> first step)",
        )


def _mark_stragglers(ax, data: RunData, axis: str) -> None:  # noqa: ANN001
    top = ax.get_xaxis_transform()
    for window in data.straggler_windows:
        start, end = _x_of(data, window["start"], axis), _x_of(data, window["end"], axis)
        if start is None or end is None:
            continue
        ax.axvspan(
            start,
            end,
            facecolor="none",
            edgecolor=STRAGGLER_COLOR,
            hatch="xx",
            alpha=0.35,
            lw=0.8,
            label="injected straggler window",
        )
        slowdown, delay_ms = window.get("slowdown"), window.get("delay_ms")
        text = f"worker {window['worker']}" + (
            f" +{delay_ms:g} ms" if delay_ms else f" x{slowdown:g}" if slowdown else ""
        )
        ax.text(start, 0.06, f" {text}", transform=top, fontsize=8, color=STRAGGLER_COLOR)


def _mark_decisions(ax, data: RunData, axis: str) -> None:  # noqa: ANN001
    top = ax.get_xaxis_transform()
    for decision in data.decisions:
        if decision.get("time") is None:
            continue
        x = _x_of(data, float(decision["time"]), axis)
        if x is None:
            continue
        ax.axvline(x, color=DECISION_COLOR, ls=":", lw=1.3)
        ax.plot(
            [x],
            [0.90],
            marker="v",
            ms=9,
            color=DECISION_COLOR,
            transform=top,
            ls="none",
            label="online decision",
        )
        ax.annotate(
            str(decision.get("action", "?")),
            (x, 0.90),
            xycoords=top,
            xytext=(5, -4),
            textcoords="offset points",
            fontsize=8,
            color=DECISION_COLOR,
            fontweight="bold",
        )


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:  # noqa: ANN001
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # one legend entry per kind of marking
    if unique:
        # Outside the axes, so it never hides data.
        ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


_AXIS_LABELS = {"step": "global step (BSP-equivalent steps)", "time": "wall time since run start (s)"}


def _series_x(data: RunData, events: list[dict[str, Any]], axis: str) -> list[float]:
    if axis == "step":
        return [e["global_step"] for e in events]
    return [e["wall_time"] - data.run_start for e in events]


def plot_loss(data: RunData, path: str, axis: str) -> bool:
    if not data.chief_steps:
        return False
    fig, (ax,) = new_figure()
    for seg in data.started_segments:
        steps = seg.chief_steps
        if steps:
            ax.plot(
                _series_x(data, steps, axis),
                [s["loss"] for s in steps],
                marker="o" if len(steps) < 4 else None,  # a segment of a few events is still seen
                ms=4,
                lw=1.4,
                color=PROTOCOL_COLORS.get(seg.protocol, GAP_COLOR),
                label=f"training loss ({seg.protocol.upper()})",
            )
    _mark_run(ax, data, axis)
    where = "global step" if axis == "step" else "wall time"
    _finish(ax, f"Training loss vs {where}", _AXIS_LABELS[axis], "training loss (cross-entropy)")
    fig.savefig(path)
    return True


def plot_accuracy(data: RunData, path: str) -> bool:
    evals = [e for e in data.of_kind("eval") if e.get("test_accuracy") is not None]
    finals = [s for s in data.segments if (s.result or {}).get("test_accuracy") is not None]
    if not evals and not finals:
        return False
    fig, axes = new_figure(rows=2, height=4.0)
    for ax, axis in zip(axes, ("step", "time"), strict=True):
        for protocol, color in PROTOCOL_COLORS.items():
            points = [e for e in evals if e.get("protocol") == protocol]
            if points:
                ax.plot(
                    _series_x(data, points, axis),
                    [e["test_accuracy"] for e in points],
                    "o-",
                    ms=4,
                    color=color,
                    label=f"test accuracy ({protocol.upper()})",
                )
        for seg in finals:
            x = seg.end_step if axis == "step" else (seg.ended_at or data.run_start) - data.run_start
            ax.plot(
                [x],
                [seg.result["test_accuracy"]],
                marker="*",
                ms=14,
                mfc="none",  # hollow, so the eval point underneath stays visible
                mec="black",
                ls="none",
                label="segment-end test accuracy",
            )
        _mark_run(ax, data, axis)
        where = "global step" if axis == "step" else "wall time"
        _finish(ax, f"Test accuracy vs {where}", _AXIS_LABELS[axis], "test accuracy (fraction)")
    fig.savefig(path)
    return True


def plot_throughput(data: RunData, path: str) -> bool:
    bars = [s for s in data.started_segments if s.examples_per_sec is not None]
    rated = [s for s in data.chief_steps if s.get("examples_per_sec") is not None]
    if not bars and not rated:
        return False
    fig, (bar_ax, time_ax) = new_figure(rows=2, height=4.0)
    labels = [s.label for s in bars]
    values = [s.examples_per_sec for s in bars]
    colors = [PROTOCOL_COLORS.get(s.protocol, GAP_COLOR) for s in bars]
    drawn = bar_ax.bar(labels, values, color=colors, width=0.5)
    bar_ax.bar_label(drawn, fmt="%.0f", fontsize=9)
    bar_ax.set_title("Throughput per segment")
    bar_ax.set_ylabel("examples/s")
    bar_ax.set_xlabel("segment")
    bar_ax.grid(True, axis="y", alpha=0.3)
    for seg in data.started_segments:
        points = [s for s in seg.chief_steps if s.get("examples_per_sec") is not None]
        if points:
            time_ax.plot(
                _series_x(data, points, "time"),
                [s["examples_per_sec"] for s in points],
                lw=1.1,
                color=PROTOCOL_COLORS.get(seg.protocol, GAP_COLOR),
                label=f"examples/s ({seg.protocol.upper()})",
            )
    _mark_run(time_ax, data, "time")
    time_ax.set_ylim(bottom=0)
    _finish(time_ax, "Throughput over time (chief step events)", _AXIS_LABELS["time"], "examples/s")
    fig.savefig(path)
    return True


def _worker_of(event: dict[str, Any]) -> int:
    return int(event.get("worker", event.get("task", 0)))


def plot_worker_step_times(data: RunData, path: str) -> bool:
    samples = [e for e in data.of_kind("worker_step") if e.get("step_time") is not None]
    if not samples:
        return False
    fig, (ax,) = new_figure(height=5.2)
    workers = sorted({_worker_of(e) for e in samples})
    steady: list[float] = []
    for worker in workers:
        color = WORKER_COLORS[worker % len(WORKER_COLORS)]
        for seg in data.started_segments:
            mine = [
                e
                for e in seg.events
                if e.get("event") == "worker_step"
                and e.get("step_time") is not None
                and _worker_of(e) == worker
            ]
            if not mine:
                continue
            x = _series_x(data, mine, "time")
            # The first sample of a segment holds its trace and warm-up (seconds, not milliseconds).
            steady += [e["step_time"] for e in mine[1:]]
            ax.plot(
                x, [e["step_time"] for e in mine], lw=1.0, color=color, label=f"worker {worker} step time"
            )
            computed = [
                (xi, e["compute_time"])
                for xi, e in zip(x, mine, strict=True)
                if e.get("compute_time") is not None
            ]
            if computed:
                ax.plot(
                    *zip(*computed, strict=True),
                    lw=0.9,
                    ls=":",
                    color=color,
                    label=f"worker {worker} compute time",
                )
    _mark_run(ax, data, "time")
    ax.set_ylim(bottom=0, top=_steady_top(steady, ax.get_ylim()[1]))
    _finish(ax, "Per-worker step and compute time", _AXIS_LABELS["time"], "seconds per worker step")
    fig.savefig(path)
    return True


def _steady_top(steady: list[float], current: float) -> float:
    """A y-limit that shows the steady steps (and a straggler's slowdown) instead of the start-up spike
    of each segment's first sample: 3x the 95th percentile of the later samples, or the data's top."""
    if len(steady) < 4:
        return current
    import numpy as np

    return min(current, 3.0 * float(np.percentile(steady, 95)))


def render_plots(data: RunData, out_dir: str) -> tuple[list[str], dict[str, str]]:
    """Draw every plot that has data; returns (names drawn, {name: why skipped})."""
    renderers = {
        "loss_vs_step": lambda p: plot_loss(data, p, "step"),
        "loss_vs_time": lambda p: plot_loss(data, p, "time"),
        "accuracy": lambda p: plot_accuracy(data, p),
        "throughput": lambda p: plot_throughput(data, p),
        "worker_step_times": lambda p: plot_worker_step_times(data, p),
    }
    why_empty = {
        "loss_vs_step": "no chief step events",
        "loss_vs_time": "no chief step events",
        "accuracy": "no eval events and no segment test accuracy",
        "throughput": "no throughput recorded",
        "worker_step_times": "no worker_step events",
    }
    drawn, skipped = [], {}
    for name, render in renderers.items():
        if render(os.path.join(out_dir, IMAGE_FILES[name])):
            drawn.append(name)
        else:
            skipped[name] = why_empty[name]
    return drawn, skipped


# --- HTML ---------------------------------------------------------------------------------------------

REPORT_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.incomplete td, tr.not_started td { background: #fff3e0; }
figure { margin: 1.2em 0; } img { max-width: 100%; border: 1px solid #eee; }
.note { color: #777; }
"""


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v, digits)}" for k, v in value.items()) or "-"
    return str(value)


def _cell(value: Any, digits: int = 2) -> str:
    css = ' class="num"' if isinstance(value, int | float) and not isinstance(value, bool) else ""
    return f"<td{css}>{html.escape(_fmt(value, digits))}</td>"


def html_table(headers: list[str], rows: list[list[Any]], row_classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        css = f' class="{row_classes[i]}"' if row_classes else ""
        body.append(f"<tr{css}>" + "".join(_cell(v) for v in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(summary: dict[str, Any]) -> str:
    title = f"syncswitch report: {summary.get('job_name') or '?'} / {summary.get('run_id') or '?'}"
    sections = {
        "Summary": _overview_table(summary),
        "Model": _model_table(summary),
        "Segments": _segment_table(summary["segments"]),
        "Switch gaps": _gap_table(summary["switch_gaps_seconds"]),
        "Online decisions": _decision_table(summary["online_switches"], summary.get("run_start")),
        "Cluster events": _cluster_event_tables(summary, summary.get("run_start")),
        "Cost": _cost_tables(summary.get("cost")),
        "Plots": _figures(summary["images"], summary["images_skipped"]),
    }
    body = "".join(f"<h2>{html.escape(name)}</h2>\n{content}\n" for name, content in sections.items())
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{REPORT_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
        f'<p class="note">Run folder: {html.escape(str(summary["run_dir"]))}</p>\n{body}</body></html>\n'
    )


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _overview_table(summary: dict[str, Any]) -> str:
    row = {
        "final accuracy": _accuracy(summary["final_accuracy"]),
        "total time (s)": summary["total_seconds"],
        "training time (s)": summary["training_seconds"],
        "examples/s": summary["examples_per_sec"],
        "steps done / workload": f"{_fmt(summary['steps_done'], 1)} / {_fmt(summary['workload_steps'], 1)}",
        "run status": summary["status"],
        "all segments complete": summary["complete"],
    }
    return html_table(list(row), [list(row.values())])


def _model_table(summary: dict[str, Any]) -> str:
    """What was trained (names, user code and its digest) and where the trained model is."""
    model, user_code = summary.get("model") or {}, summary.get("user_code") or {}
    export = summary.get("export")
    row = {
        **{k.replace("_", " "): v for k, v in model.items()},
        "user code": user_code.get("usr_dir") or ", ".join(user_code.get("packages", {})) or "built-in",
        "code digest": user_code.get("digest") or "-",
        "SavedModel": (export or {}).get("saved_model") or "-",
        "Keras file": (export or {}).get("keras") or "-",
    }
    return html_table(list(row), [list(row.values())])


def _segment_table(segments: list[dict[str, Any]]) -> str:
    rows = [
        {
            "#": s["index"],
            "protocol": s["protocol"].upper(),
            "origin": s["origin"],
            "status": s["status"].replace("_", " "),
            "steps": s["steps"],
            "from step": s["start_step"],
            "to step": s["end_step"],
            "seconds": s["seconds"],
            "examples/s": s["examples_per_sec"],
            "stopped early": s["stopped_early"],
            "reason": s["reason"],
            "test accuracy": _accuracy(s["test_accuracy"]),
            "start-up (s)": s["startup"],
        }
        for s in segments
    ]
    if not rows:
        return '<p class="note">No segment was planned or ran.</p>'
    return html_table(list(rows[0]), [list(r.values()) for r in rows], [s["status"] for s in segments])


def _gap_table(gaps: list[dict[str, Any]]) -> str:
    if not gaps:
        return '<p class="note">No switch.</p>'
    rows = [
        [
            f"seg {g['from_segment']} {g['from_protocol'].upper()}",
            f"seg {g['to_segment']} {g['to_protocol'].upper()}",
            g["seconds"],
            g.get("handoff_seconds"),
            g["startup"],
        ]
        for g in gaps
    ]
    headers = ["from", "to", "gap: last step -> first step (s)", "hand-off: result -> launch (s)"]
    return html_table([*headers, "start-up split (s)"], rows)


def _figures(images: dict[str, str], skipped: dict[str, str]) -> str:
    figures = "".join(
        f'<figure><img src="{html.escape(IMAGE_FILES[name])}" alt="{html.escape(name)}">'
        f"<figcaption>{html.escape(name.replace('_', ' '))}</figcaption></figure>"
        for name in images
    )
    if skipped:
        items = "".join(f"<li>{html.escape(n)}: {html.escape(why)}</li>" for n, why in skipped.items())
        figures += f'<p class="note">Not drawn:</p><ul class="note">{items}</ul>'
    return figures


def _since_run_start(at: float | None, run_start: float | None) -> float | None:
    """A table's time column: seconds since the run started, when both times are known."""
    return at - run_start if at is not None and run_start is not None else None


def _decision_table(decisions: list[dict[str, Any]], run_start: float | None) -> str:
    if not decisions:
        return '<p class="note">No online decisions.</p>'
    rows = []
    for d in decisions:
        details = {k: v for k, v in d.items() if k not in ("time", "segment", "action", "reason")}
        rows.append(
            [
                _since_run_start(d.get("time"), run_start),
                d.get("segment"),
                d.get("action"),
                d.get("reason"),
                json.dumps(details, default=str),
            ]
        )
    return html_table(["time since run start (s)", "segment", "action", "reason", "numbers"], rows)


def _cluster_event_tables(summary: dict[str, Any], run_start: float | None) -> str:
    """The run's VMs revoked and replaced, and the nodes lost mid-segment (a host gone, a crash)."""
    events, lost = summary.get("cluster_events") or [], summary.get("lost_nodes") or []
    if not events and not lost:
        return '<p class="note">No node lost, no VM revoked or replaced.</p>'
    parts = []
    if events:
        rows = []
        for e in events:
            details = {k: v for k, v in e.items() if k not in ("time", "kind", "vm")}
            rows.append(
                [
                    _since_run_start(e.get("time"), run_start),
                    e.get("kind"),
                    e.get("vm"),
                    json.dumps(details, default=str),
                ]
            )
        parts.append(html_table(["time since run start (s)", "event", "VM", "details"], rows))
    if lost:
        rows = [
            [
                _since_run_start(n["time"], run_start),
                f"{n['segment']} ({n['protocol']})",
                n["node"],
                n["host"] or "-",
                n["exit_code"],
                n["global_step"],
                n["outcome"],
            ]
            for n in lost
        ]
        headers = ["time since run start (s)", "segment", "node lost", "host", "exit code", "at step", "then"]
        parts.append(html_table(headers, rows))
    return "\n".join(parts)


def _cost_tables(cost: dict[str, Any] | None) -> str:
    if not cost:
        return '<p class="note">No VMs: this cluster had no per-second price.</p>'
    currency = cost["currency"]
    overview = html_table(
        ["total", "same VMs on-demand", "saved", "saved (%)", "BSP", "ASP", "outside segments"],
        [
            [
                cost["total"],
                cost["on_demand_total"],
                cost["savings"],
                100 * cost["savings_fraction"],
                cost["per_protocol"].get("bsp"),
                cost["per_protocol"].get("asp"),
                cost["unattributed"],
            ]
        ],
    )
    segments = html_table(
        ["segment", "protocol", "seconds", f"cost ({currency})"],
        [[s["index"], s["protocol"], s["seconds"], s["cost"]] for s in cost["per_segment"]],
    )
    vms = html_table(
        ["VM", "role", "zone", "machine", "GPUs", "spot", "active s", f"{currency}/h", f"cost ({currency})"],
        [
            [
                v["name"],
                v["role"],
                v["zone"],
                v["machine_type"],
                f"{v['gpu_count']} x {v['gpu_type']}" if v["gpu_type"] else "",
                "spot" if v["spot"] else "on-demand",
                v["active_seconds"],
                v["hourly"],
                v["cost"],
            ]
            for v in cost["per_vm"]
        ],
    )
    table = cost.get("price_table", {})
    source = html.escape(str(table.get("source", "")))
    note = f'<p class="note">Prices: {source} (as of {table.get("as_of")}).</p>'
    return f"<p>Costs in {html.escape(currency)}.</p>\n{overview}\n{segments}\n{vms}\n{note}"


# --- entry points ---------------------------------------------------------------------------------------


def build_report(run_dir: str) -> dict[str, Any]:
    """Write plots, summary.json and index.html into the run's report folder; return the summary."""
    data = load_run(run_dir)
    summary = summarize(data)
    summary["run_start"] = data.run_start
    report_dir = data.layout.report
    with tempfile.TemporaryDirectory(prefix="syncswitch-report-") as tmp:
        drawn, skipped = render_plots(data, tmp)
        summary["report_dir"] = report_dir
        summary["index_html"] = join(report_dir, "index.html")
        summary["images"] = {name: join(report_dir, IMAGE_FILES[name]) for name in drawn}
        summary["images_skipped"] = skipped
        with open(os.path.join(tmp, "index.html"), "w", encoding="utf-8") as f:
            f.write(render_html(summary))
        with open(os.path.join(tmp, "summary.json"), "w", encoding="utf-8") as f:
            f.write(summary_json(summary))
        storage.upload_dir(tmp, report_dir)
    log.info(
        "report for %s written to %s (%d plots, %d skipped)", run_dir, report_dir, len(drawn), len(skipped)
    )
    return summary


def summary_json(summary: dict[str, Any]) -> str:
    """summary.json's text (one format for the report task and the finalize task's correction)."""
    return json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"


def refresh_status(
    run_dir: str, status: str, run_state: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Set the run's final status (and, given its final state, its cluster events and bill) in an
    already written report (summary.json and index.html).

    The report task runs before teardown, while the run is still going; the finalize task knows the
    outcome and the final cost. Plots do not change, so only the two text files are rewritten. None if
    no report exists."""
    report_dir = RunLayout(run_dir).report
    summary = storage.read_json(join(report_dir, "summary.json"), default={}) or None
    if summary is None:
        log.warning("no report under %s: status %s not recorded there", report_dir, status)
        return None
    summary["status"] = status
    if run_state is not None:
        summary.update(cluster_summary(run_state))
    storage.write_text(join(report_dir, "index.html"), render_html(summary))
    storage.write_text(join(report_dir, "summary.json"), summary_json(summary))
    log.info("report %s: run status %s", summary.get("index_html") or report_dir, status)
    return summary


def format_summary_lines(summary: dict[str, Any]) -> list[str]:
    """A few human lines for the DAG run's last log lines and the CLI."""
    total, training = _fmt(summary.get("total_seconds"), 1), _fmt(summary.get("training_seconds"), 1)
    lines = [
        f"final accuracy {_fmt(summary.get('final_accuracy'), 4)} after "
        f"{_fmt(summary.get('steps_done'), 1)} of {_fmt(summary.get('workload_steps'), 1)} steps",
        f"total {total} s, training {training} s, "
        f"{_fmt(summary.get('examples_per_sec'), 1)} examples/s overall",
    ]
    lines += [_segment_line(s) for s in summary.get("segments", [])]
    lines += [_gap_line(g) for g in summary.get("switch_gaps_seconds", [])]
    cost = summary.get("cost")
    if cost:
        lines.append(
            f"cost {cost['total']:.4f} {cost['currency']} ({cost['savings']:.4f} saved against on-demand, "
            f"{100 * cost['savings_fraction']:.1f}%); revocations: "
            f"{sum(1 for e in summary.get('cluster_events', []) if e.get('kind') == 'revoked')}"
        )
    decisions = summary.get("online_switches") or []
    if decisions:
        actions = ", ".join(f"{d.get('action')} in segment {d.get('segment')}" for d in decisions)
        lines.append(f"online decisions: {len(decisions)} ({actions})")
    if (summary.get("user_code") or {}).get("digest"):
        lines.append(f"user code {summary['user_code']['usr_dir']} (digest {summary['user_code']['digest']})")
    if summary.get("export"):
        lines.append(f"exported model: {summary['export']['saved_model']} and {summary['export']['keras']}")
    if summary.get("index_html"):
        lines.append(f"report: {summary['index_html']}")
    return lines


def _segment_line(s: dict[str, Any]) -> str:
    status = "" if s["status"] == COMPLETE else f" [{s['status'].replace('_', ' ')}]"
    steps = f"{_fmt(s['start_step'], 1)}-{_fmt(s['end_step'], 1)}"
    return (
        f"segment {s['index']} {s['protocol'].upper()} steps {steps}: {_fmt(s['seconds'], 1)} s, "
        f"{_fmt(s['examples_per_sec'], 1)} examples/s, accuracy {_fmt(s['test_accuracy'], 4)}{status}"
    )


def _gap_line(g: dict[str, Any]) -> str:
    protocols = f"{g['from_protocol'].upper()}->{g['to_protocol'].upper()}"
    handoff = f", hand-off {_fmt(g['handoff_seconds'], 1)} s" if g.get("handoff_seconds") is not None else ""
    split = f" ({_fmt(g['startup'], 1)})" if g.get("startup") else ""
    return (
        f"switch {g['from_segment']}->{g['to_segment']} ({protocols}): gap {_fmt(g['seconds'], 1)} s"
        f"{handoff}{split}"
    )
