"""The per-run report, built from a synthetic but realistic run folder (local and gs://).

The run is a "10" job on 2 workers: a BSP segment of 100 steps, a switch, then an ASP segment of 300
steps during which worker 1 is an injected 4x straggler and the online policy decides to stay.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest
from matplotlib import image as mpimg
from syncswitch import storage
from syncswitch.events import EventWriter
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec, StragglerSpec
from syncswitch.state import new_state
from syncswitch_airflow.report import (
    IMAGE_FILES,
    build_report,
    format_summary_lines,
    load_run,
    refresh_status,
    summarize,
)

T0 = 1_700_000_000.0
RUN_ID = "manual__2025-01-01T00_00_00"
GLOBAL_BATCH = 64  # 2 workers x 32
STRAGGLER = {"worker": 1, "slowdown": 4.0, "delay_ms": None, "start": T0 + 60.0, "end": T0 + 75.0}
DECISION = {
    "time": T0 + 63.0,
    "segment": 1,
    "action": "stay",
    "reason": "worker 1 is 3.9x slower than the median, but ASP already tolerates it",
    "slowdown": 3.9,
}
SEG0_STARTUP = {"process_start": 8.0, "restore": 0.0, "first_step": 2.0}
SEG1_STARTUP = {"checkpoint_write": 0.5, "process_start": 11.2, "restore": 0.3, "first_step": 2.5}


@dataclass(frozen=True)
class SegmentTiming:
    """Epoch times of one synthetic segment: launch, first step, last step, end (after checkpoint)."""

    index: int
    protocol: str
    start_step: int
    end_step: int
    started_at: float
    first_step_at: float
    last_step_at: float
    ended_at: float

    @property
    def seconds(self) -> float:
        return self.ended_at - self.first_step_at

    @property
    def examples_per_sec(self) -> float:
        return (self.end_step - self.start_step) * GLOBAL_BATCH / self.seconds


SEG0 = SegmentTiming(0, "bsp", 0, 100, T0, T0 + 10.0, T0 + 29.8, T0 + 30.5)
SEG1 = SegmentTiming(1, "asp", 100, 400, T0 + 31.0, T0 + 45.0, T0 + 99.5, T0 + 100.0)


def _emit_segment(
    layout: RunLayout, seg: SegmentTiming, *, fail_at: float | None = None, announce_straggler: bool = True
) -> None:
    """Chief and worker events of one segment; with ``fail_at`` nothing is emitted after that time."""
    until = fail_at if fail_at is not None else float("inf")
    steps = seg.end_step - seg.start_step
    step_seconds = (seg.last_step_at - seg.first_step_at) / (steps - 1)
    chief = EventWriter(
        layout.segment_events(seg.index, seg.protocol, "chief", 0),
        run_id=RUN_ID,
        segment=seg.index,
        protocol=seg.protocol,
        role="chief",
        task=0,
    )
    workers = [
        EventWriter(
            layout.segment_events(seg.index, seg.protocol, "worker", w),
            run_id=RUN_ID,
            segment=seg.index,
            protocol=seg.protocol,
            role="worker",
            task=w,
        )
        for w in range(2)
    ]
    with chief:
        chief.emit(
            "segment_start",
            wall_time=seg.started_at,
            start_step=seg.start_step,
            until_step=seg.end_step,
            num_workers=2,
            batch_per_worker=32,
            learning_rate=0.1,
            momentum=0.9,
            momentum_rule="ramped",
        )
        if seg.protocol == "asp" and announce_straggler:
            chief.emit("straggler", wall_time=seg.started_at + 1.0, **STRAGGLER)
        for i in range(1, steps + 1):
            t = seg.first_step_at + (i - 1) * step_seconds
            if t > until:
                break
            step = seg.start_step + i
            chief.emit(
                "step",
                wall_time=t,
                global_step=float(step),
                samples=step * GLOBAL_BATCH,
                updates=step,
                loss=2.3 * np.exp(-step / 120.0) + 0.1,
                examples_per_sec=GLOBAL_BATCH / step_seconds,
                step_time=step_seconds,
                learning_rate=0.1,
                momentum=0.9,
            )
            for w, writer in enumerate(workers):
                slow = STRAGGLER["start"] <= t <= STRAGGLER["end"] and w == STRAGGLER["worker"]
                compute = 0.12 * (STRAGGLER["slowdown"] if slow else 1.0)
                writer.emit(
                    "worker_step",
                    wall_time=t + 0.01 * w,
                    worker=w,
                    global_step=float(step),
                    step_time=compute + 0.08,
                    compute_time=compute,
                    wait_time=0.08,
                )
            if step == seg.end_step or (seg.protocol == "asp" and step == 250):
                accuracy = 0.80 if step == 100 else (0.86 if step == 250 else 0.912)
                chief.emit(
                    "eval",
                    wall_time=t + 0.1,
                    global_step=float(step),
                    test_accuracy=accuracy,
                    test_loss=1.0 - accuracy,
                )
        if fail_at is None:
            chief.emit(
                "checkpoint",
                wall_time=seg.ended_at - 0.3,
                global_step=float(seg.end_step),
                samples=seg.end_step * GLOBAL_BATCH,
                uri="ckpt",
                seconds=0.3,
            )
            chief.emit(
                "segment_end",
                wall_time=seg.ended_at,
                global_step=float(seg.end_step),
                samples=seg.end_step * GLOBAL_BATCH,
                updates=seg.end_step,
                seconds=seg.seconds,
                examples_per_sec=seg.examples_per_sec,
                stopped_early=False,
                reason="reached until_step",
            )
    for writer in workers:
        writer.close()


def _result(seg: SegmentTiming, accuracy: float, startup: dict[str, float]) -> dict:
    return {
        "index": seg.index,
        "protocol": seg.protocol,
        "start_step": seg.start_step,
        "end_step": seg.end_step,
        "samples": seg.end_step * GLOBAL_BATCH,
        "updates": seg.end_step,
        "started_at": seg.started_at,
        "first_step_at": seg.first_step_at,
        "ended_at": seg.ended_at,
        "seconds": seg.seconds,
        "examples_per_sec": seg.examples_per_sec,
        "stopped_early": False,
        "reason": "reached until_step",
        "checkpoint": f"ckpt-{seg.end_step * GLOBAL_BATCH:012d}",
        "test_accuracy": accuracy,
        "test_loss": 1.0 - accuracy,
        "startup": startup,
    }


LOST_PS = {
    "node": "ps-0",
    "host": "h4",
    "exit_code": -9,
    "global_step": 212.0,
    "outcome": "the segment fails",
}


# The launcher's account of segment 1's failure: the parameter server went first, with its host.
FAILED_FIRST = {
    "reason": "parameter server 0 exited with -9",
    "node": "ps-0",
    "host": "h4",
    "exit_code": -9,
    "lost": True,
    "global_step": 170.0,
    "log": "logs/seg-01-asp/ps-0.log",
}


def write_run(root: str, *, second_segment_fails: bool = False, announce_straggler: bool = True) -> RunLayout:
    """A "10" run folder; optionally segment 1 dies at T0+70 and a third planned segment never starts.

    The job asks for the straggler window; ``announce_straggler`` says whether a process also emitted
    the ``straggler`` event for it.
    """
    layout = RunLayout(root)
    job = JobSpec(
        job_name="report-test",
        switch_order="10",
        total_steps=400,
        bsp_fraction=0.25,
        num_workers=2,
        online_policy="greedy",
        stragglers=(StragglerSpec(worker=1, start=60.0, duration=15.0, slowdown=4.0),),
    ).to_params()
    state = new_state(layout, RUN_ID, job)
    state["plan"] = [
        {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"},
        {"index": 1, "protocol": "asp", "until_step": 400, "origin": "plan"},
    ]
    state["decisions"] = [DECISION]
    state["timings"] = {"created": T0 - 5.0, "first_bsp_start": T0}
    seg0 = _result(SEG0, 0.80, SEG0_STARTUP)
    storage.write_json(layout.segment_result(0, "bsp"), seg0)
    state["segments"] = {"0": seg0}
    _emit_segment(layout, SEG0)
    if second_segment_fails:
        _emit_segment(layout, SEG1, fail_at=T0 + 70.0)
        with EventWriter(
            layout.segment_events(1, "asp", "launcher", 0),
            run_id=RUN_ID,
            segment=1,
            protocol="asp",
            role="launcher",
            task=0,
        ) as launcher:
            launcher.emit("node_lost", wall_time=T0 + 70.5, **LOST_PS)
            launcher.emit("segment_failed", wall_time=T0 + 71.0, **FAILED_FIRST)
        for name in ("chief-0", "ps-0"):
            storage.write_text(layout.node_log(1, "asp", name), f"{name}: its lines\n")
        state["plan"].append({"index": 2, "protocol": "bsp", "until_step": 450, "origin": "online"})
        state["status"] = "failed"
    else:
        _emit_segment(layout, SEG1, announce_straggler=announce_straggler)
        seg1 = _result(SEG1, 0.912, SEG1_STARTUP)
        storage.write_json(layout.segment_result(1, "asp"), seg1)
        state["segments"]["1"] = seg1
        state["status"] = "success"
    storage.write_json(layout.state, state)
    return layout


def assert_png_is_a_real_plot(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert os.path.getsize(path) > 20_000, f"{path} is suspiciously small"
    pixels = mpimg.imread(path)[..., :3]
    # A blank canvas has one colour; a plot with lines, shading and text has many and real spread.
    assert float(pixels.std()) > 0.05, f"{path} looks blank"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, f"{path} has almost no colours"


def assert_full_run_summary(summary: dict) -> None:
    seg0, seg1 = summary["segments"]
    assert [s["status"] for s in summary["segments"]] == ["complete", "complete"]
    assert (seg0["protocol"], seg0["start_step"], seg0["end_step"], seg0["steps"]) == ("bsp", 0, 100, 100)
    assert (seg1["protocol"], seg1["start_step"], seg1["end_step"], seg1["steps"]) == ("asp", 100, 400, 300)
    assert seg0["seconds"] == pytest.approx(20.5)
    assert seg1["seconds"] == pytest.approx(55.0)
    assert seg1["startup"] == SEG1_STARTUP
    assert summary["complete"] is True
    assert summary["final_accuracy"] == pytest.approx(0.912)
    assert summary["total_seconds"] == pytest.approx(100.0)
    assert summary["training_seconds"] == pytest.approx(75.5)
    assert summary["examples_per_sec"] == pytest.approx(400 * GLOBAL_BATCH / 75.5)
    assert summary["workload_steps"] == 400
    assert summary["steps_done"] == 400
    (gap,) = summary["switch_gaps_seconds"]
    assert (gap["from_segment"], gap["to_segment"]) == (0, 1)
    assert (gap["from_protocol"], gap["to_protocol"]) == ("bsp", "asp")
    assert gap["seconds"] == pytest.approx(14.5)  # segment 0 ended at +30.5, segment 1 stepped at +45
    assert gap["handoff_seconds"] == pytest.approx(0.5)  # segment 1's launcher started at +31
    assert gap["startup"] == SEG1_STARTUP
    assert summary["online_switches"] == [DECISION]
    assert summary["straggler_windows"] == [STRAGGLER]


def test_report_of_a_local_two_segment_run(tmp_path) -> None:
    layout = write_run(str(tmp_path / "runs" / "report-test" / RUN_ID))

    summary = build_report(layout.root)

    assert_full_run_summary(summary)
    assert sorted(summary["images"]) == sorted(IMAGE_FILES)
    assert summary["images_skipped"] == {}
    for name, path in summary["images"].items():
        assert path == os.path.join(layout.report, IMAGE_FILES[name])
        assert_png_is_a_real_plot(path)
    with open(os.path.join(layout.report, "summary.json")) as f:
        assert json.load(f)["final_accuracy"] == pytest.approx(0.912)
    page = (tmp_path / "runs" / "report-test" / RUN_ID / "report" / "index.html").read_text()
    for file_name in IMAGE_FILES.values():
        assert f'<img src="{file_name}"' in page
    assert "14.50" in page and "checkpoint_write" in page and "stay" in page

    lines = format_summary_lines(summary)
    assert lines[0].startswith("final accuracy 0.9120")
    assert any(line.startswith("total 100.0 s") for line in lines)
    assert any(
        "switch 0->1 (BSP->ASP): gap 14.5 s" in line and "process_start: 11.2" in line for line in lines
    )
    assert lines[-1] == f"report: {os.path.join(layout.report, 'index.html')}"

    # The finalize task knows the outcome the report task (before teardown) could not.
    assert summary["status"] == "success"  # what state.json said when the report was built
    assert refresh_status(layout.root, "failed")["status"] == "failed"
    with open(os.path.join(layout.report, "summary.json")) as f:
        assert json.load(f)["status"] == "failed"
    assert (
        "<td>failed</td>"
        in (tmp_path / "runs" / "report-test" / RUN_ID / "report" / "index.html").read_text()
    )
    # Readable by whoever serves or copies the report, not only by the Airflow user.
    assert {
        oct(p.stat().st_mode & 0o777)
        for p in (tmp_path / "runs" / "report-test" / RUN_ID / "report").iterdir()
    } == {"0o644"}


def test_report_marks_a_failed_segment_incomplete(tmp_path) -> None:
    layout = write_run(str(tmp_path / "run"), second_segment_fails=True)

    summary = build_report(layout.root)

    statuses = [(s["index"], s["protocol"], s["status"]) for s in summary["segments"]]
    assert statuses == [(0, "bsp", "complete"), (1, "asp", "incomplete"), (2, "bsp", "not_started")]
    seg1 = summary["segments"][1]
    # Reported from its events: it started at step 100 and its last step before dying was at +70 s.
    assert seg1["start_step"] == 100
    assert 100 < seg1["end_step"] < 400
    assert seg1["first_step_at"] == pytest.approx(SEG1.first_step_at)
    assert seg1["test_accuracy"] is None and "no result.json" in seg1["reason"]
    assert summary["complete"] is False
    assert summary["final_accuracy"] == pytest.approx(0.80)
    (gap,) = summary["switch_gaps_seconds"]  # the never-started segment has no gap
    assert gap["seconds"] == pytest.approx(14.5) and gap["startup"] is None
    assert summary["workload_steps"] == 450
    for path in summary["images"].values():
        assert_png_is_a_real_plot(path)
    # The node whose loss ended it: from the launcher's node_lost event, in the Cluster events section.
    assert summary["lost_nodes"] == [{"time": T0 + 70.5, "segment": 1, "protocol": "asp", **LOST_PS}]
    page = (tmp_path / "run" / "report" / "index.html").read_text()
    assert '<tr class="incomplete">' in page and '<tr class="not_started">' in page
    assert '<td>ps-0</td><td>h4</td><td class="num">-9</td>' in page and "the segment fails" in page
    # Every node's log, linked from the page (the run folder's logs/), and the node that failed first.
    links = {"chief-0": "../logs/seg-01-asp/chief-0.log", "ps-0": "../logs/seg-01-asp/ps-0.log"}
    assert summary["node_logs"] == [{"segment": "seg-01-asp", "logs": links}]
    assert '<a href="../logs/seg-01-asp/ps-0.log">ps-0</a>' in page
    (failure,) = summary["segment_failures"]
    assert (failure["segment"], failure["node"], failure["lost"]) == (1, "ps-0", True)
    assert "<td>ps-0</td><td>h4</td><td>lost</td>" in page
    assert any("[incomplete]" in line for line in format_summary_lines(summary))


def test_report_of_a_segment_that_a_retry_resumed_from_its_own_checkpoint(tmp_path) -> None:
    """Segment 1's first attempt dies at +70 s; a retry resumes it from its checkpoint at step 200 and
    finishes. The segment still spans the hand-off (step 100) to 400, from the first attempt's start;
    the report says it was resumed, and where."""
    layout = write_run(str(tmp_path / "run"))
    retry = SegmentTiming(1, "asp", 200, 400, T0 + 84.0, T0 + 88.0, T0 + 99.5, T0 + 100.0)
    for name in storage.list_files(layout.segment_metrics(1, "asp"), suffix=".jsonl"):
        storage.delete(name)
    _emit_segment(layout, SEG1, fail_at=T0 + 70.0)
    _emit_segment(layout, retry, announce_straggler=False)
    storage.write_json(layout.segment_result(1, "asp"), _result(retry, 0.912, SEG1_STARTUP))

    summary = build_report(layout.root)

    seg0, seg1 = summary["segments"]
    assert (seg0["attempts"], seg0["resumed_at"]) == (1, [])
    assert (seg1["status"], seg1["start_step"], seg1["end_step"], seg1["steps"]) == (
        "complete",
        100,
        400,
        300,
    )
    assert (seg1["attempts"], seg1["resumed_at"]) == (2, [200])
    assert seg1["started_at"] == SEG1.started_at and seg1["first_step_at"] == SEG1.first_step_at
    (gap,) = summary["switch_gaps_seconds"]
    assert gap["seconds"] == pytest.approx(14.5)  # to the first attempt's first step, as without a retry
    assert any(
        line.startswith("segment 1 ASP steps 100-400")
        and "resumed at step 200 after a failed attempt" in line
        for line in format_summary_lines(summary)
    )
    assert "<td>2 (resumed at 200)</td>" in (tmp_path / "run" / "report" / "index.html").read_text()


def test_report_names_each_segments_protocol_settings_and_bytes_per_worker_step(tmp_path) -> None:
    """An SSP (s=2) segment, then top-k BSP: the report names each with its settings (from the plan
    entry) and gives the bytes a worker sent per step (from the segment's result); a segment folder
    that no plan entry names takes its settings from its result."""
    layout = RunLayout(str(tmp_path / "run"))
    job = JobSpec(job_name="report-protocols", switch_order="ssp:2,topk:0.01", total_steps=400, num_workers=2)
    state = new_state(layout, RUN_ID, job.to_params())
    ssp = SegmentTiming(0, "ssp", 0, 100, T0, T0 + 10.0, T0 + 29.8, T0 + 30.5)
    topk = SegmentTiming(1, "cbsp", 100, 400, T0 + 31.0, T0 + 45.0, T0 + 99.5, T0 + 100.0)
    local = SegmentTiming(2, "local", 400, 500, T0 + 101.0, T0 + 105.0, T0 + 119.5, T0 + 120.0)
    state["plan"] = [
        {"index": 0, "protocol": "ssp", "protocol_args": {"staleness": 2}, "until_step": 100},
        {
            "index": 1,
            "protocol": "cbsp",
            "protocol_args": {"compression": "topk", "ratio": 0.01},
            "until_step": 400,
        },
    ]
    sent = {0: 99_152.0, 1: 1_744.0, 2: 25_580.0}
    args = {0: {"staleness": 2}, 1: {"compression": "topk", "ratio": 0.01}, 2: {"period": 4}}
    for seg in (ssp, topk, local):
        _emit_segment(layout, seg, announce_straggler=False)
        result = {
            **_result(seg, 0.9, SEG0_STARTUP),
            "protocol_args": args[seg.index],
            "bytes_per_worker_step": sent[seg.index],
        }
        storage.write_json(layout.segment_result(seg.index, seg.protocol), result)
    storage.write_json(layout.state, state)

    summary = build_report(layout.root)

    named = [
        (s["protocol_token"], s["protocol_label"], s["bytes_per_worker_step"]) for s in summary["segments"]
    ]
    assert named == [
        ("ssp:2", "SSP (s=2)", 99_152.0),
        ("topk:0.01", "compressed BSP (top-k 0.01)", 1_744.0),
        ("local:4", "local SGD (H=4)", 25_580.0),
    ]
    assert any(line.startswith("segment 0 SSP (s=2) steps 0-100") for line in format_summary_lines(summary))
    page = (tmp_path / "run" / "report" / "index.html").read_text()
    assert "<th>bytes / worker / step</th>" in page
    assert "<td>compressed BSP (top-k 0.01)</td>" in page


def test_straggler_windows_fall_back_to_the_job_spec_without_straggler_events(tmp_path) -> None:
    # The window is start=60 s after the first BSP segment's start (state timings.first_bsp_start).
    layout = write_run(str(tmp_path / "run"), announce_straggler=False)

    summary = summarize(load_run(layout.root))

    assert summary["straggler_windows"] == [STRAGGLER]
    assert not os.path.exists(layout.report)  # summarize alone renders nothing


def test_report_of_an_empty_run_folder_draws_nothing_but_still_writes_the_page(tmp_path) -> None:
    summary = build_report(str(tmp_path / "never-ran"))

    assert summary["segments"] == [] and summary["images"] == {}
    assert set(summary["images_skipped"]) == set(IMAGE_FILES)
    assert summary["final_accuracy"] is None and summary["total_seconds"] is None
    assert (tmp_path / "never-ran" / "report" / "index.html").exists()


def test_report_of_a_gcs_run_folder(gcs_bucket, tmp_path) -> None:
    layout = write_run(f"{gcs_bucket}/runs/report-test/{RUN_ID}")

    summary = build_report(layout.root)

    assert_full_run_summary(summary)
    assert summary["index_html"] == f"{layout.report}/index.html"
    names = storage.download_dir(layout.report, str(tmp_path / "report"))
    assert sorted(names) == sorted([*IMAGE_FILES.values(), "index.html", "summary.json"])
    for file_name in IMAGE_FILES.values():
        assert summary["images"][file_name.removesuffix(".png")] == f"{layout.report}/{file_name}"
        assert_png_is_a_real_plot(str(tmp_path / "report" / file_name))
    stored = storage.read_json(f"{layout.report}/summary.json")
    assert stored["switch_gaps_seconds"][0]["seconds"] == pytest.approx(14.5)
