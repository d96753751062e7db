"""The per-run report's PNG plots (matplotlib, drawn off-screen), one function per figure."""

from __future__ import annotations

import logging
import os
from typing import Any

from syncswitch_airflow.report.data import COMPLETE, RunData, SegmentView

log = logging.getLogger(__name__)

PROTOCOL_COLORS = {
    "bsp": "#1f77b4",
    "asp": "#ff7f0e",
    "ssp": "#bcbd22",
    "local": "#2ca02c",
    "cbsp": "#17becf",
}
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
_DPI = 110


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
