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

import json
import logging
import os
import tempfile
from typing import Any

from syncswitch import storage
from syncswitch.layout import RunLayout, join
from syncswitch.plan import step_text

from syncswitch_airflow.report.data import (
    COMPLETE,
    INCOMPLETE,
    NOT_STARTED,
    RunData,
    SegmentView,
    cluster_summary,
    load_run,
    summarize,
)
from syncswitch_airflow.report.page import REPORT_CSS, fmt, html_table, render_html
from syncswitch_airflow.report.plots import IMAGE_FILES, new_figure, render_plots

log = logging.getLogger(__name__)

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

    The report task runs beside teardown, before the run's outcome is decided; the finalize task knows
    the outcome and the final cost. Plots do not change, so only the two text files are rewritten. None if
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
    total, training = fmt(summary.get("total_seconds"), 1), fmt(summary.get("training_seconds"), 1)
    lines = [
        f"final accuracy {fmt(summary.get('final_accuracy'), 4)} after "
        f"{step_text(summary.get('steps_done'))} of {step_text(summary.get('workload_steps'))} steps",
        f"total {total} s, training {training} s, "
        f"{fmt(summary.get('examples_per_sec'), 1)} examples/s overall",
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
    steps = f"{step_text(s['start_step'])}-{step_text(s['end_step'])}"
    resumed = s.get("resumed_at") or []
    retries = (
        f", resumed at step {', '.join(step_text(r) for r in resumed)} after a failed attempt"
        if resumed
        else ""
    )
    return (
        f"segment {s['index']} {s['protocol_label']} steps {steps}: {fmt(s['seconds'], 1)} s, "
        f"{fmt(s['examples_per_sec'], 1)} examples/s, accuracy {fmt(s['test_accuracy'], 4)}{retries}{status}"
    )


def _gap_line(g: dict[str, Any]) -> str:
    protocols = f"{g['from_protocol'].upper()}->{g['to_protocol'].upper()}"
    handoff = f", hand-off {fmt(g['handoff_seconds'], 1)} s" if g.get("handoff_seconds") is not None else ""
    split = f" ({fmt(g['startup'], 1)})" if g.get("startup") else ""
    return (
        f"switch {g['from_segment']}->{g['to_segment']} ({protocols}): gap {fmt(g['seconds'], 1)} s"
        f"{handoff}{split}"
    )


__all__ = [
    "COMPLETE",
    "IMAGE_FILES",
    "INCOMPLETE",
    "NOT_STARTED",
    "REPORT_CSS",
    "RunData",
    "SegmentView",
    "build_report",
    "cluster_summary",
    "format_summary_lines",
    "html_table",
    "load_run",
    "new_figure",
    "refresh_status",
    "render_html",
    "render_plots",
    "summarize",
    "summary_json",
]
