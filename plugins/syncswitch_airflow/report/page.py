"""The per-run report's page, ``index.html``: tables of the summary, and the plots."""

from __future__ import annotations

import html
import json
from typing import Any

from syncswitch.plan import step_text
from syncswitch.protocols import family

from syncswitch_airflow.report.plots import IMAGE_FILES

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


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(v, digits)}" for k, v in value.items()) or "-"
    return str(value)


class _Steps(str):
    """A step count as people read it (``plan.step_text``), right-aligned as the other numbers."""


def _steps(value: float | None) -> _Steps:
    return _Steps(step_text(value))


def _cell(value: Any, digits: int = 2) -> str:
    number = isinstance(value, int | float | _Steps) and not isinstance(value, bool)
    css = ' class="num"' if number else ""
    return f"<td{css}>{html.escape(fmt(value, digits))}</td>"


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
        "Node logs": _node_log_tables(summary, summary.get("run_start")),
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
        "steps done / workload": _Steps(
            f"{step_text(summary['steps_done'])} / {step_text(summary['workload_steps'])}"
        ),
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


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _segment_table(segments: list[dict[str, Any]]) -> str:
    rows = [
        {
            "#": s["index"],
            "protocol": s["protocol_label"],
            "origin": s["origin"],
            "status": s["status"].replace("_", " "),
            "steps": _steps(s["steps"]),
            "from step": _steps(s["start_step"]),
            "to step": _steps(s["end_step"]),
            "seconds": s["seconds"],
            "examples/s": s["examples_per_sec"],
            # What a worker hands to the network per step, as the segment counted it.
            "bytes / worker / step": _whole(s["bytes_per_worker_step"]),
            "stopped early": s["stopped_early"],
            "reason": s["reason"],
            "test accuracy": _accuracy(s["test_accuracy"]),
            "start-up (s)": s["startup"],
            # Resumed by a retry from the segment's own checkpoint: at these steps.
            "attempts": s["attempts"]
            if not s["resumed_at"]
            else f"{s['attempts']} (resumed at {', '.join(step_text(r) for r in s['resumed_at'])})",
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


def _node_log_tables(summary: dict[str, Any], run_start: float | None) -> str:
    """A link to every node's log, by segment, and each failed try with the node that failed first."""
    logs, failures = summary.get("node_logs") or [], summary.get("segment_failures") or []
    if not logs and not failures:
        return '<p class="note">No node log in the run folder yet (logs/).</p>'
    parts = []
    if logs:
        rows = "".join(
            f"<tr><td>{html.escape(entry['segment'])}</td><td>{_links(entry['logs'])}</td></tr>"
            for entry in logs
        )
        parts.append(f"<table><tr><th>segment</th><th>logs</th></tr>{rows}</table>")
    if failures:
        rows = [
            [
                _since_run_start(f["time"], run_start),
                f"{f['segment']} ({f['protocol']})",
                f["node"] or "-",
                f["host"] or "-",
                "lost" if f["lost"] else f["exit_code"],
                f["global_step"],
                f["reason"],
            ]
            for f in failures
        ]
        headers = ["time since run start (s)", "segment", "failed first", "host", "exit", "at step", "reason"]
        parts.append(html_table(headers, rows))
    return "\n".join(parts)


def _links(targets: dict[str, str]) -> str:
    return " ".join(
        f'<a href="{html.escape(href)}">{html.escape(name)}</a>' for name, href in targets.items()
    )


def _cost_tables(cost: dict[str, Any] | None) -> str:
    if not cost:
        return '<p class="note">No VMs: this cluster had no per-second price.</p>'
    currency = cost["currency"]
    shown = list(cost["per_protocol"])  # BSP, ASP, and any other protocol the run used
    overview = html_table(
        [
            "total",
            "same VMs on-demand",
            "saved",
            "saved (%)",
            *(family(p).title for p in shown),
            "outside segments",
        ],
        [
            [
                cost["total"],
                cost["on_demand_total"],
                cost["savings"],
                100 * cost["savings_fraction"],
                *(cost["per_protocol"].get(p) for p in shown),
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
