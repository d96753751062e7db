"""The events, state and run-layout contracts, on local folders and on the GCS emulator."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from proc_utils import wait_for
from syncswitch import events, state, storage
from syncswitch.layout import RunLayout, join, safe_run_id, segment_name


@pytest.fixture(params=["local", "gcs"])
def bucket_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "bucket")
    return join(request.getfixturevalue("gcs_bucket"), "runs")


@pytest.fixture
def layout(bucket_dir: str) -> RunLayout:
    return RunLayout.for_run(bucket_dir, "resnet-cifar", "manual__2025-01-01T00:00:00+00:00")


def _writer(layout: RunLayout, role: str, task: int, **kwargs: float) -> events.EventWriter:
    return events.EventWriter(
        layout.segment_events(0, "bsp", role, task),
        run_id="r1",
        segment=0,
        protocol="bsp",
        role=role,
        task=task,
        **kwargs,
    )


def _run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# --- events ------------------------------------------------------------------------------------


def test_events_round_trip_with_common_keys(layout: RunLayout) -> None:
    with _writer(layout, "chief", 0, flush_seconds=0.0) as writer:
        writer.emit("segment_start", start_step=0, until_step=100, num_workers=2)
        writer.emit("step", global_step=1.0, loss=2.3)
        writer.emit("step", global_step=2.0, loss=2.1)

    records = events.read_events(layout.metrics)
    assert [r["event"] for r in records] == ["segment_start", "step", "step"]
    for record in records:
        assert {k: record[k] for k in ("run_id", "segment", "protocol", "role", "task")} == {
            "run_id": "r1",
            "segment": 0,
            "protocol": "bsp",
            "role": "chief",
            "task": 0,
        }
        assert abs(record["wall_time"] - time.time()) < 60
    steps = events.read_events(layout.segment_metrics(0, "bsp"), event="step")
    assert [r["loss"] for r in steps] == [2.3, 2.1]


def test_events_from_several_files_merge_by_wall_time(layout: RunLayout) -> None:
    with _writer(layout, "chief", 0) as chief, _writer(layout, "worker", 1) as worker:
        for i in range(3):
            chief.emit("step", global_step=float(i))
            worker.emit("worker_step", worker=1, global_step=float(i), step_time=0.1)
    storage.write_json(layout.segment_result(0, "bsp"), {"index": 0})  # not an events file

    records = events.read_events(layout.metrics)
    assert len(records) == 6
    assert [r["wall_time"] for r in records] == sorted(r["wall_time"] for r in records)
    assert {r["role"] for r in records} == {"chief", "worker"}
    assert len(events.read_events(layout.metrics, event="worker_step")) == 3


def test_unknown_event_type_is_rejected(tmp_path: Path) -> None:
    with (
        events.EventWriter(
            str(tmp_path / "e.jsonl"), run_id="r", segment=0, protocol="asp", role="worker", task=0
        ) as writer,
        pytest.raises(ValueError, match="unknown event type"),
    ):
        writer.emit("stepp", global_step=1)


def test_torn_last_line_is_skipped(layout: RunLayout) -> None:
    good = [{"event": "step", "wall_time": 1.0, "global_step": 1}, {"event": "eval", "wall_time": 2.0}]
    text = "".join(json.dumps(r) + "\n" for r in good) + "\n" + '{"event": "step", "wall_ti'
    storage.write_text(layout.segment_events(0, "bsp", "chief", 0), text)

    assert events.read_events(layout.metrics) == good
    assert list(events.parse_lines('{"a": 1}\n\n  \n{"b": 2}')) == [{"a": 1}, {"b": 2}]


def test_gcs_writer_uploads_periodically(gcs_bucket: str) -> None:
    layout = RunLayout(join(gcs_bucket, "run"))
    with _writer(layout, "chief", 0, flush_seconds=0.3) as writer:
        writer.emit("step", global_step=1.0)
        time.sleep(0.35)
        writer.emit("step", global_step=2.0)
        # both visible while the writer is still open (the uploader runs beside the training thread)
        wait_for(
            lambda: [r["global_step"] for r in events.read_events(layout.metrics)] == [1.0, 2.0],
            timeout=5,
            what="both events uploaded",
        )


def test_gcs_writer_uploads_the_rest_on_close(
    gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer buffers gs:// events in a local temp file; keep those in tmp_path to check cleanup.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    layout = RunLayout(join(gcs_bucket, "run"))
    writer = _writer(layout, "worker", 2, flush_seconds=3600.0)
    writer.emit("worker_step", worker=2, global_step=0.0, step_time=0.1)
    wait_for(lambda: len(events.read_events(layout.metrics)) == 1, timeout=10, what="the first upload")
    for i in range(1, 5):
        writer.emit("worker_step", worker=2, global_step=float(i), step_time=0.1)
    time.sleep(0.5)
    # nothing more was uploaded: the flush interval has not passed since the first upload
    assert len(events.read_events(layout.metrics)) == 1

    writer.close()
    writer.close()  # closing twice is harmless

    assert [r["global_step"] for r in events.read_events(layout.metrics)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert storage.list_files(layout.metrics) == [layout.segment_events(0, "bsp", "worker", 2)]
    assert list(tmp_path.glob("events-*.jsonl")) == [], "the local buffer file was not removed"


# --- state -------------------------------------------------------------------------------------


def test_a_long_stream_goes_on_in_bounded_parts_that_every_reader_sees(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "buffers"))
    (tmp_path / "buffers").mkdir()
    tail = events.EventTail(layout.metrics)
    seen: list[float] = []
    with _writer(layout, "chief", 0, flush_seconds=0.05, part_bytes=1000) as writer:
        for i in range(40):
            writer.emit("step", global_step=float(i), loss=1.0)
            if i % 10 == 9:  # a watcher reading while parts are finished and new ones begin
                wait_for(
                    lambda i=i: (
                        seen.extend(r["global_step"] for r in tail.read_new("step")) or seen[-1:] == [i]
                    ),
                    timeout=10,
                    what=f"step {i} tailed",
                )
    uri = layout.segment_events(0, "bsp", "chief", 0)
    files = storage.list_files(layout.metrics)
    assert files[0] == uri and len(files) > 5
    assert files[1:] == [events.part_uri(uri, n) for n in range(1, len(files))]
    for name in files:  # every part stops at about part_bytes (one event past it at most)
        assert len(storage.read_bytes(name)) < 1000 + 300
    assert [r["global_step"] for r in events.read_events(layout.metrics)] == [float(i) for i in range(40)]
    assert seen == [float(i) for i in range(40)]  # each event tailed once
    assert list((tmp_path / "buffers").glob("events-*")) == [], "a part's local buffer was left"


def test_a_second_writer_of_a_stream_keeps_what_the_first_wrote(layout: RunLayout) -> None:
    """A retried segment's processes write the same streams again: on a local folder they append,
    on gs:// (objects cannot be appended to) the new writer goes on in the next part instead of
    overwriting the first attempt's events, and a watcher that tailed the first sees the second."""
    tail = events.EventTail(layout.metrics)
    with _writer(layout, "chief", 0) as first:
        first.emit("segment_start", global_step=0.0)
        first.emit("step", global_step=1.0)
    assert [r["global_step"] for r in tail.read_new()] == [0.0, 1.0]
    # The retry's own watcher starts where the retry's events begin (taken before its launch).
    offsets = events.EventTail(layout.metrics).skip_existing()
    assert offsets and all(size > 0 for size in offsets.values())
    with _writer(layout, "chief", 0) as retry:
        retry.emit("segment_start", global_step=1.0)
        retry.emit("step", global_step=2.0)
    assert [r["event"] for r in events.read_events(layout.metrics)] == ["segment_start", "step"] * 2
    assert [r["global_step"] for r in tail.read_new()] == [1.0, 2.0]
    assert [r["global_step"] for r in events.EventTail(layout.metrics, offsets).read_new()] == [1.0, 2.0]
    uri = layout.segment_events(0, "bsp", "chief", 0)
    expected = [uri] if not storage.is_remote(uri) else [uri, events.part_uri(uri, 1)]
    assert storage.list_files(layout.metrics) == expected


def test_a_long_stream_stays_under_its_budget_by_thinning_old_timings_only(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Days of events in a bounded stream: old parts lose every other worker_step / step event, the
    oldest the most (down to a few per part); checkpoints and the other rare events all stay, and so
    does recent history."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "buffers"))
    (tmp_path / "buffers").mkdir()
    part, budget = 20_000, 100_000
    with _writer(layout, "worker", 1, flush_seconds=0.05, part_bytes=part, stream_bytes=budget) as writer:
        for i in range(6000):
            writer.emit("worker_step", worker=1, global_step=float(i), step_time=0.01, compute_time=0.01)
            if i % 100 == 0:
                writer.emit("checkpoint", global_step=float(i), uri=f"ckpt-{i}")
    files = storage.list_files(layout.metrics)
    texts = [storage.read_text(uri) for uri in files]
    line = max(len(t) for text in texts for t in text.splitlines(keepends=True))
    floor = len(files) * events.MIN_TIMINGS_PER_PART * line
    assert len(files) > 50 and sum(map(len, texts)) <= budget + part + floor  # unthinned: ~1.4 MB
    kept = events.read_events(layout.metrics)
    checkpoints = [r["global_step"] for r in kept if r["event"] == "checkpoint"]
    assert checkpoints == [float(i) for i in range(0, 6000, 100)]  # every rare event stays
    steps = [r["global_step"] for r in kept if r["event"] == "worker_step"]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert steps[-150:] == [float(i) for i in range(5850, 6000)]  # recent history is whole
    for text in texts[:-10]:  # no stretch of the run vanishes: every part keeps a few timings
        assert text.count('"worker_step"') >= events.MIN_TIMINGS_PER_PART
    assert list((tmp_path / "buffers").glob("events-*")) == [], "a part's local buffer was left"


def test_new_read_and_update_state(layout: RunLayout) -> None:
    assert state.read_state(layout) is None
    initial = state.new_state(layout, "run-1", {"job_name": "resnet-cifar", "total_steps": 100})
    state.update_state(layout, lambda s: s.update(initial))

    def add_segment(s: state.State) -> None:
        s["plan"].append({"index": 0, "protocol": "bsp", "until_step": 20, "origin": "plan"})

    returned = state.update_state(layout, add_segment)
    stored = state.read_state(layout)
    assert stored == returned
    assert stored["run_dir"] == layout.root
    assert stored["status"] == "running"
    assert stored["plan"] == [{"index": 0, "protocol": "bsp", "until_step": 20, "origin": "plan"}]
    assert stored["job"] == {"job_name": "resnet-cifar", "total_steps": 100}


def _increment(worker: int, update: int) -> Callable[[state.State], None]:
    def mutate(s: state.State) -> None:
        s["count"] = s.get("count", 0) + 1
        s.setdefault("seen", []).append(f"{worker}-{update}")

    return mutate


def test_concurrent_thread_updates_lose_nothing(layout: RunLayout) -> None:
    threads, updates = 4, 6

    def work(worker: int) -> None:
        for update in range(updates):
            state.update_state(layout, _increment(worker, update), attempts=100)

    _run_threads(threads, work)

    final = state.read_state(layout)
    assert final["count"] == threads * updates
    assert sorted(final["seen"]) == sorted(f"{w}-{u}" for w in range(threads) for u in range(updates))


_UPDATER_SCRIPT = """
import sys
from syncswitch import state
from syncswitch.layout import RunLayout

root, name, updates = sys.argv[1], sys.argv[2], int(sys.argv[3])

def mutate(s):
    s["count"] = s.get("count", 0) + 1
    s.setdefault("seen", []).append(name)

for _ in range(updates):
    state.update_state(RunLayout(root), mutate)
"""


def test_concurrent_process_updates_lose_nothing_locally(tmp_path: Path) -> None:
    layout = RunLayout(str(tmp_path / "run"))
    processes, updates = 3, 15
    procs = [
        subprocess.Popen([sys.executable, "-c", _UPDATER_SCRIPT, layout.root, f"p{i}", str(updates)])
        for i in range(processes)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * processes

    final = state.read_state(layout)
    assert final["count"] == processes * updates
    assert sorted(final["seen"]) == sorted(f"p{i}" for i in range(processes) for _ in range(updates))


def test_record_decision_appends_with_time(layout: RunLayout) -> None:
    before = time.time()
    state.record_decision(layout, {"segment": 1, "action": "switch_to_asp", "reason": "planned"})

    def decide(worker: int) -> None:
        state.record_decision(layout, {"segment": 2, "action": "stay", "reason": f"t{worker}"})

    _run_threads(3, decide)

    decisions = state.read_state(layout)["decisions"]
    assert decisions[0]["action"] == "switch_to_asp"
    assert sorted(d["reason"] for d in decisions[1:]) == ["t0", "t1", "t2"]
    assert all(d["time"] >= before for d in decisions)


# --- layout ------------------------------------------------------------------------------------


def test_run_layout_paths() -> None:
    layout = RunLayout.for_run("gs://bucket/prefix/", "job", "manual__2025-01-01T00:00:00+00:00")
    root = "gs://bucket/prefix/job/manual__2025-01-01T00_00_00_00_00"
    assert layout.root == root
    assert layout.state == f"{root}/state.json"
    assert layout.checkpoints == f"{root}/checkpoints"
    assert layout.checkpoint(1234) == f"{root}/checkpoints/ckpt-000000001234"
    assert layout.metrics == f"{root}/metrics"
    assert layout.segment_metrics(1, "asp") == f"{root}/metrics/seg-01-asp"
    assert layout.segment_events(1, "asp", "ps", 0) == f"{root}/metrics/seg-01-asp/ps-0.jsonl"
    assert layout.segment_result(0, "bsp") == f"{root}/metrics/seg-00-bsp/result.json"
    assert layout.tensorboard == f"{root}/tensorboard"
    assert layout.control == f"{root}/control"
    assert layout.stop_request(3) == f"{root}/control/stop-seg-03"
    assert layout.report == f"{root}/report"
    assert RunLayout.for_run("/data/runs", "job", "r1").state == "/data/runs/job/r1/state.json"


def test_checkpoint_names_sort_by_progress_and_parse_back() -> None:
    layout = RunLayout("/runs/job/r")
    samples = [0, 9, 10, 128_000, 999_999_999_999]
    names = [layout.checkpoint(n) for n in samples]
    assert sorted(names) == names
    assert [RunLayout.checkpoint_samples(n) for n in names] == samples
    assert RunLayout.checkpoint_samples("ckpt-000000001234/") == 1234
    assert RunLayout.checkpoint_samples("gs://b/run/checkpoints/ckpt-000000000640") == 640


@pytest.mark.parametrize(
    "name", ["ckpt-12", "ckpt-000000001234.tmp", "ckpt-0000000012345", "manifest.json", "checkpoints"]
)
def test_checkpoint_samples_rejects_other_names(name: str) -> None:
    assert RunLayout.checkpoint_samples(name) is None


def test_join_segment_name_and_safe_run_id() -> None:
    assert join("gs://b/", "/a/", "", "b/") == "gs://b/a/b"
    assert join("/tmp/x") == "/tmp/x"
    assert segment_name(4, "bsp") == "seg-04-bsp"
    assert safe_run_id("scheduled__2025-01-01T00:00:00+00:00") == "scheduled__2025-01-01T00_00_00_00_00"
    assert safe_run_id("plain-id_1.2") == "plain-id_1.2"
