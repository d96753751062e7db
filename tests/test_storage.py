"""syncswitch.storage against a local folder and a real GCS emulator bucket, with the same tests."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from google.api_core.exceptions import NotFound
from syncswitch import storage
from syncswitch.layout import join


@pytest.fixture(params=["local", "gcs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage prefix that does not exist yet: a local folder or a key prefix in a fresh bucket."""
    if request.param == "local":
        return str(tmp_path / "root")
    return join(request.getfixturevalue("gcs_bucket"), "root")


def _make_tree(base: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_bytes_text_json_round_trip(root: str) -> None:
    storage.write_bytes(join(root, "a/blob.bin"), b"\x00\x01\xff")
    storage.write_text(join(root, "a/note.txt"), "héllo\nworld")
    storage.write_json(join(root, "state.json"), {"step": 3, "plan": [{"protocol": "bsp"}]})

    assert storage.read_bytes(join(root, "a/blob.bin")) == b"\x00\x01\xff"
    assert storage.read_text(join(root, "a/note.txt")) == "héllo\nworld"
    assert storage.read_json(join(root, "state.json")) == {"step": 3, "plan": [{"protocol": "bsp"}]}


def test_overwrite_replaces_content(root: str) -> None:
    uri = join(root, "x.txt")
    storage.write_text(uri, "first, longer content")
    storage.write_text(uri, "second")
    assert storage.read_text(uri) == "second"


def test_missing_objects_give_defaults_or_raise(root: str) -> None:
    missing = join(root, "nope.txt")
    assert storage.read_text(missing, default="") == ""
    assert storage.read_text(missing, default="fallback") == "fallback"
    assert storage.read_json(missing, default={"empty": True}) == {"empty": True}
    with pytest.raises((FileNotFoundError, NotFound)):
        storage.read_text(missing)
    with pytest.raises((FileNotFoundError, NotFound)):
        storage.read_bytes(missing)


def test_exists_and_delete(root: str) -> None:
    uri = join(root, "d/file.txt")
    assert not storage.exists(uri)
    storage.write_text(uri, "x")
    assert storage.exists(uri)
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # deleting something absent is not an error


def test_list_files_is_recursive_sorted_and_filters_suffix(root: str) -> None:
    for rel in ["b.jsonl", "a/x.jsonl", "a/deep/y.jsonl", "a/deep/result.json", "ab/sibling.jsonl"]:
        storage.write_text(join(root, rel), "{}")

    assert storage.list_files(join(root, "a")) == [
        join(root, "a/deep/result.json"),
        join(root, "a/deep/y.jsonl"),
        join(root, "a/x.jsonl"),
    ]
    assert storage.list_files(root, suffix=".jsonl") == [
        join(root, "a/deep/y.jsonl"),
        join(root, "a/x.jsonl"),
        join(root, "ab/sibling.jsonl"),
        join(root, "b.jsonl"),
    ]
    # a trailing slash means the same prefix
    assert storage.list_files(join(root, "a") + "/", suffix=".json") == [join(root, "a/deep/result.json")]
    assert storage.list_files(join(root, "missing")) == []
    # the same listing with each file's size
    storage.write_text(join(root, "a/x.jsonl"), "12345")
    assert storage.file_sizes(join(root, "a"), suffix=".jsonl") == {
        join(root, "a/deep/y.jsonl"): 2,
        join(root, "a/x.jsonl"): 5,
    }
    assert storage.file_sizes(join(root, "missing")) == {}


def test_list_dirs_gives_immediate_children_only(root: str) -> None:
    for rel in ["checkpoints/ckpt-1/manifest.json", "checkpoints/ckpt-2/a/b.data", "checkpoints/top.txt"]:
        storage.write_text(join(root, rel), "x")

    assert storage.list_dirs(join(root, "checkpoints")) == ["ckpt-1", "ckpt-2"]
    assert storage.list_dirs(root) == ["checkpoints"]
    assert storage.list_dirs(join(root, "missing")) == []


def test_upload_and_download_dir_round_trip(root: str, tmp_path: Path) -> None:
    files = {
        "ckpt.index": b"index",
        "ckpt.data-00000-of-00001": os.urandom(200_000),
        "sub/manifest.json": b"{}",
    }
    source, target = tmp_path / "src", tmp_path / "dst"
    _make_tree(source, files)

    uploaded = storage.upload_dir(str(source), join(root, "ckpt-7"))
    downloaded = storage.download_dir(join(root, "ckpt-7"), str(target))

    assert uploaded == downloaded == sorted(files)
    for rel, data in files.items():
        assert (target / rel).read_bytes() == data


def test_upload_and_download_single_file(root: str, tmp_path: Path) -> None:
    source = tmp_path / "in.bin"
    source.write_bytes(b"payload")
    storage.upload_file(str(source), join(root, "one.bin"))
    storage.download_file(join(root, "one.bin"), str(tmp_path / "out/nested/one.bin"))
    assert (tmp_path / "out/nested/one.bin").read_bytes() == b"payload"


def test_delete_prefix_removes_only_that_prefix(root: str) -> None:
    for rel in ["run/a.txt", "run/x/b.txt", "run2/keep.txt"]:
        storage.write_text(join(root, rel), "x")

    storage.delete_prefix(join(root, "run"))

    assert storage.list_files(join(root, "run")) == []
    assert storage.list_files(root) == [join(root, "run2/keep.txt")]
    storage.delete_prefix(join(root, "never-existed"))


def test_split_gs_and_is_remote() -> None:
    assert storage.split_gs("gs://bucket/a/b.txt") == ("bucket", "a/b.txt")
    assert storage.split_gs("gs://bucket") == ("bucket", "")
    assert storage.is_remote("gs://bucket/x")
    assert not storage.is_remote("/tmp/gs://x")
    with pytest.raises(ValueError):
        storage.split_gs("gs:///key")


def test_gcs_objects_land_in_the_emulator_bucket(gcs_bucket: str) -> None:
    # Checks the client really talks to the emulator: the object is visible through the raw client.
    storage.write_text(join(gcs_bucket, "k/v.txt"), "value")
    bucket_name, _ = storage.split_gs(gcs_bucket)
    names = [b.name for b in storage.gcs_client().list_blobs(bucket_name)]
    assert names == ["k/v.txt"]
    assert storage.list_dirs(gcs_bucket) == ["k"]


# --- local atomicity ---------------------------------------------------------------------------


def test_local_write_is_atomic_for_concurrent_readers(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    versions = [b"a" * 2_000_000, b"b" * 3_000_000]
    storage.write_bytes(path, versions[0])
    torn: list[int] = []
    stop = threading.Event()

    def read_repeatedly() -> None:
        while not stop.is_set():
            data = storage.read_bytes(path)
            if data not in versions:
                torn.append(len(data))

    reader = threading.Thread(target=read_repeatedly)
    reader.start()
    try:
        for i in range(30):
            storage.write_bytes(path, versions[i % 2])
    finally:
        stop.set()
        reader.join()

    assert torn == [], f"a reader saw partial files of sizes {torn[:5]}"
    assert os.listdir(tmp_path) == ["state.json"], "temp files were left behind"


def test_local_temp_files_are_not_listed(tmp_path: Path) -> None:
    storage.write_text(str(tmp_path / "d/real.txt"), "x")
    # what a writer leaves visible mid-write: a temp file beside the target
    (tmp_path / "d/.tmp-abc123").write_text("partial")
    assert storage.list_files(str(tmp_path / "d")) == [str(tmp_path / "d/real.txt")]


def test_failed_local_write_keeps_old_content_and_no_temp(tmp_path: Path) -> None:
    path = str(tmp_path / "f.txt")
    storage.write_text(path, "old")
    with pytest.raises(TypeError):
        storage.write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert storage.read_text(path) == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_local_delete_removes_a_folder(tmp_path: Path) -> None:
    storage.write_text(str(tmp_path / "dir/a/b.txt"), "x")
    storage.delete(str(tmp_path / "dir"))
    assert not storage.exists(str(tmp_path / "dir"))


def test_local_files_are_readable_by_others(tmp_path: Path) -> None:
    path = str(tmp_path / "report" / "summary.json")
    storage.write_json(path, {"a": 1})
    assert os.stat(path).st_mode & 0o777 == 0o644


# ---- bucket outages: the session emulator is stopped and started again on the same port -------------


def test_a_call_during_a_short_outage_waits_for_the_bucket(
    gcs_server, gcs_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = join(gcs_bucket, "run", "before.json")
    storage.write_json(before, {"written": "before"})
    restarted = gcs_server.outage(3.0)
    with caplog.at_level("WARNING", logger="syncswitch.storage"):
        storage.write_json(join(gcs_bucket, "run", "during.json"), {"written": "during"})
    restarted.join()
    assert storage.read_json(before) == {"written": "before"}, "the outage lost an object"
    assert storage.read_json(join(gcs_bucket, "run", "during.json")) == {"written": "during"}
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("bucket unreachable: write gs://") for m in messages), messages
    assert any(m.startswith("bucket reachable again: write gs://") for m in messages), messages


def test_an_outage_past_the_limit_raises_naming_the_call_and_the_limit(
    gcs_server, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(storage.RETRY_SECONDS_ENV, "2")
    uri = join(gcs_bucket, "run", "state.json")
    restarted = gcs_server.outage(6.0)
    try:
        with pytest.raises(storage.BucketUnavailable, match=rf"write {uri}: .*limit 2 s"):
            storage.write_json(uri, {})
    finally:
        restarted.join()
    monkeypatch.delenv(storage.RETRY_SECONDS_ENV)
    assert not storage.exists(uri), "nothing half-written"


def test_events_are_kept_through_an_outage_and_training_never_waits(gcs_server, gcs_bucket: str) -> None:
    """Every emit returns while the bucket is away (it stays away until they all have: one that
    waited for it would never return), and every event reaches it once it is back."""
    from syncswitch.events import EventWriter, read_events

    uri = join(gcs_bucket, "run", "metrics", "seg-00-bsp", "worker-0.jsonl")
    writer = EventWriter(uri, run_id="r", segment=0, protocol="bsp", role="worker", task=0, flush_seconds=0.1)
    writer.emit("step", global_step=1.0)
    gcs_server.stop()
    try:
        emitting = threading.Thread(target=lambda: [_emit_step(writer, step) for step in range(2, 30)])
        emitting.start()
        emitting.join(timeout=120)
        assert not emitting.is_alive(), "emit() waited for the bucket"
    finally:
        gcs_server.start()
    writer.close()
    steps = [e["global_step"] for e in read_events(join(gcs_bucket, "run", "metrics"))]
    assert steps == [float(s) for s in range(1, 30)]


def _emit_step(writer: Any, step: int) -> None:  # noqa: ANN401 - syncswitch.events.EventWriter
    writer.emit("step", global_step=float(step))
    time.sleep(0.05)  # past the writer's flush interval now and then: it tries to upload


def test_state_updates_ride_out_an_outage(gcs_server, gcs_bucket: str) -> None:
    from syncswitch.layout import RunLayout
    from syncswitch.state import read_state, update_state

    layout = RunLayout(join(gcs_bucket, "job", "run"))
    update_state(layout, lambda s: s.update(segments={}))
    restarted = gcs_server.outage(2.0)
    update_state(layout, lambda s: s["segments"].update({"0": {"end_step": 10}}))
    restarted.join()
    assert read_state(layout) == {"segments": {"0": {"end_step": 10}}}


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_create_private_keeps_the_first_writers_secret(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    uri = f"{root}/run/cluster/secrets/token"
    assert storage.create_private(uri, b"first") == b"first"
    assert storage.create_private(uri, b"second") == b"first"
    assert storage.read_bytes(uri) == b"first"
    if where == "local":
        assert os.stat(uri).st_mode & 0o777 == 0o600
