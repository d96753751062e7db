"""The comparison report of several runs (a sweep): accuracy, time and time-to-accuracy per config.

Each run is read through the per-run report's model (syncswitch_airflow.report), so a number here
means what it means in a run's own report. Runs with the same label are repeats of one config; the
report shows their mean and standard deviation, times normalised to the baseline config's mean, and
the paper's reference rows (if given) beside ours:

    <out_dir>/comparison.html   tables and plots
    <out_dir>/comparison.json   the same numbers
    <out_dir>/*.png             accuracy and time per config, accuracy over training time per run
"""

from __future__ import annotations

import html
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from syncswitch import storage
from syncswitch.layout import join

from syncswitch_airflow.report import REPORT_CSS, html_table, load_run, new_figure, summarize

log = logging.getLogger(__name__)

IMAGE_FILES = {"accuracy_and_time": "accuracy_and_time.png", "accuracy_over_time": "accuracy_over_time.png"}


@dataclass(frozen=True)
class RunRef:
    """One finished run: the config it belongs to and its run folder."""

    label: str
    run_dir: str


def run_numbers(ref: RunRef, target_accuracy: float | None) -> dict[str, Any]:
    """The numbers of one run that the comparison uses, plus its accuracy curve."""
    data = load_run(ref.run_dir)
    summary = summarize(data)
    evals = sorted(
        (e for e in data.of_kind("eval") if e.get("test_accuracy") is not None), key=lambda e: e["wall_time"]
    )
    return {
        "label": ref.label,
        "run_dir": ref.run_dir,
        "run_id": summary["run_id"],
        "final_accuracy": summary["final_accuracy"],
        "total_seconds": summary["total_seconds"],
        "training_seconds": summary["training_seconds"],
        "examples_per_sec": summary["examples_per_sec"],
        "switch_overhead_seconds": sum(g["seconds"] for g in summary["switch_gaps_seconds"] if g["seconds"]),
        "seconds_to_target": data.seconds_to_accuracy(target_accuracy) if target_accuracy else None,
        "curve": [(e["wall_time"] - data.run_start, e["test_accuracy"]) for e in evals],
    }


def _mean_sd(values: list[float | None]) -> tuple[float | None, float | None, int]:
    present = [float(v) for v in values if v is not None]
    if not present:
        return None, None, 0
    sd = statistics.stdev(present) if len(present) > 1 else 0.0
    return statistics.fmean(present), sd, len(present)


def config_rows(runs: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One row per label (in first-seen order): mean, sd and count of each number; times / baseline."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    rows = []
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        row: dict[str, Any] = {"label": label, "runs": len(mine)}
        for key in ("final_accuracy", "total_seconds", "examples_per_sec", "switch_overhead_seconds"):
            row[key], row[f"{key}_sd"], _n = _mean_sd([r[key] for r in mine])
        row["seconds_to_target"], row["seconds_to_target_sd"], row["reached_target"] = _mean_sd(
            [r["seconds_to_target"] for r in mine]
        )
        rows.append(row)
    base = next((r for r in rows if r["label"] == baseline), None)
    for row in rows:
        for key in ("total_seconds", "seconds_to_target"):
            ours, theirs = row[key], (base or {}).get(key)
            row[f"{key}_vs_baseline"] = ours / theirs if ours is not None and theirs else None
    return rows


def build_comparison(
    runs: Sequence[RunRef],
    out_dir: str,
    *,
    baseline: str,
    target_accuracy: float | None = None,
    references: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Write comparison.html, comparison.json and the plots into ``out_dir``; return the numbers."""
    measured = [run_numbers(ref, target_accuracy) for ref in runs]
    comparison: dict[str, Any] = {
        "baseline": baseline,
        "target_accuracy": target_accuracy,
        "configs": config_rows(measured, baseline),
        "runs": [{k: v for k, v in r.items() if k != "curve"} for r in measured],
        "references": list(references),
        "report_dir": out_dir,
        "index_html": join(out_dir, "comparison.html"),
    }
    with tempfile.TemporaryDirectory(prefix="syncswitch-compare-") as tmp:
        drawn = _plot(comparison["configs"], measured, target_accuracy, tmp)
        comparison["images"] = {name: join(out_dir, IMAGE_FILES[name]) for name in drawn}
        _write(os.path.join(tmp, "comparison.html"), render_html(comparison))
        _write(os.path.join(tmp, "comparison.json"), json.dumps(comparison, indent=2, default=str) + "\n")
        storage.upload_dir(tmp, out_dir)
    log.info(
        "comparison of %d run(s) in %d config(s) written to %s",
        len(measured),
        len(comparison["configs"]),
        out_dir,
    )
    return comparison


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


# --- plots --------------------------------------------------------------------------------------------


def _plot(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], target: float | None, out_dir: str
) -> list[str]:
    if not rows:
        return []
    drawn = []
    fig, (acc_ax, time_ax) = new_figure(height=4.2, cols=2)
    labels = [r["label"] for r in rows]
    acc = [r["final_accuracy"] or 0.0 for r in rows]
    acc_ax.bar(labels, acc, yerr=[r["final_accuracy_sd"] or 0.0 for r in rows], capsize=4, color="#1f77b4")
    low = min((a for a in acc if a), default=0.0)
    acc_ax.set_ylim(max(0.0, low - 0.05), 1.0)
    acc_ax.set_title("Final test accuracy (mean ± sd over repeats)")
    acc_ax.set_ylabel("test accuracy")
    times = [r["total_seconds_vs_baseline"] or 0.0 for r in rows]
    tta = [r["seconds_to_target_vs_baseline"] or 0.0 for r in rows]
    x = range(len(rows))
    time_ax.bar([i - 0.2 for i in x], times, width=0.4, label="total time", color="#ff7f0e")
    if any(tta):
        time_ax.bar([i + 0.2 for i in x], tta, width=0.4, label=f"time to {target}", color="#2ca02c")
    time_ax.axhline(1.0, color="black", lw=0.8, ls=":")
    time_ax.set_xticks(list(x), labels)
    time_ax.set_title("Time relative to the baseline (lower is faster)")
    time_ax.legend(fontsize=8)
    for ax in (acc_ax, time_ax):
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=20)
    fig.savefig(os.path.join(out_dir, IMAGE_FILES["accuracy_and_time"]))
    drawn.append("accuracy_and_time")

    curves = [r for r in runs if r["curve"]]
    if curves:
        fig, (ax,) = new_figure(height=4.6)
        colors = {label: f"C{i}" for i, label in enumerate(labels)}
        seen = set()
        for r in curves:
            xs, ys = zip(*r["curve"], strict=True)
            label = r["label"] if r["label"] not in seen else None
            seen.add(r["label"])
            ax.plot(xs, ys, "o-", ms=3, lw=1.0, alpha=0.8, color=colors.get(r["label"]), label=label)
        if target:
            ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target}")
        ax.set_title("Test accuracy over wall time (one line per run)")
        ax.set_xlabel("wall time since run start (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.savefig(os.path.join(out_dir, IMAGE_FILES["accuracy_over_time"]))
        drawn.append("accuracy_over_time")
    return drawn


# --- HTML ---------------------------------------------------------------------------------------------


def _num(value: Any, sd: Any = None, digits: int = 2) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return f"{text} ± {sd:.{digits}f}" if sd else text


def render_html(comparison: dict[str, Any]) -> str:
    target = comparison["target_accuracy"]
    head = [
        "config",
        "runs",
        "final accuracy",
        "total time (s)",
        "time / baseline",
        "examples/s",
        "switch overhead (s)",
        f"time to {target} (s)",
        f"time to {target} / baseline",
        "reached",
    ]
    rows = [
        [
            r["label"],
            str(r["runs"]),
            _num(r["final_accuracy"], r["final_accuracy_sd"], 4),
            _num(r["total_seconds"], r["total_seconds_sd"], 1),
            _num(r["total_seconds_vs_baseline"]),
            _num(r["examples_per_sec"], None, 0),
            _num(r["switch_overhead_seconds"], None, 1),
            _num(r["seconds_to_target"], r["seconds_to_target_sd"], 1),
            _num(r["seconds_to_target_vs_baseline"]),
            f"{r['reached_target']}/{r['runs']}",
        ]
        for r in comparison["configs"]
    ]
    parts = [f"<h1>Comparison (baseline: {html.escape(comparison['baseline'])})</h1>", html_table(head, rows)]
    if comparison["references"]:
        keys = list(dict.fromkeys(k for ref in comparison["references"] for k in ref))
        parts += [
            "<h2>Reference results (from the papers)</h2>",
            html_table(keys, [[str(ref.get(k, "")) for k in keys] for ref in comparison["references"]]),
        ]
    for name in comparison.get("images", {}):
        parts.append(f'<figure><img src="{IMAGE_FILES[name]}" alt="{html.escape(name)}"></figure>')
    runs = [
        [
            r["label"],
            str(r["run_id"]),
            _num(r["final_accuracy"], None, 4),
            _num(r["total_seconds"], None, 1),
            _num(r["seconds_to_target"], None, 1),
            str(r["run_dir"]),
        ]
        for r in comparison["runs"]
    ]
    parts += [
        "<h2>Runs</h2>",
        html_table(["config", "run", "accuracy", "total (s)", "to target (s)", "folder"], runs),
    ]
    note = (
        "Times are wall seconds from the first segment's start to the last segment's end. Time to target "
        "counts training seconds from the first step to the first checkpoint evaluation at the target, "
        "without the evaluations' own seconds (runs need evaluate_checkpoints). Switch overhead is the "
        "sum of the gaps between one segment's last step and the next segment's first step."
    )
    body = "\n".join(parts)
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>syncswitch comparison</title>'
        f'<style>{REPORT_CSS}</style></head><body>\n{body}\n<p class="note">{note}</p></body></html>\n'
    )
