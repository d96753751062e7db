"""The example user projects under examples/ (docs/bring-your-own-model.md), run as users run them.

For each example: ``syncswitch check`` passes on it, then a short ASP segment and a BSP segment through
``syncswitch train`` (real multi-process clusters, ``--usr-dir`` the example's package folder) train,
the BSP segment restores the ASP segment's last checkpoint bit-identically, and test accuracy is
reported. The TFRecord example reads its data from, and writes its run to, a bucket on the GCS
emulator. A faster test checks that its TFRecord problem shards by file, and by record when there are
fewer files than shards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from syncswitch import storage, usercode
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch.problems import ProblemError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MNIST1D = {
    "usr_dir": str(EXAMPLES / "mnist1d" / "mnist1d_example"),
    "model": "mnist1d_cnn",
    "problem": "mnist1d",
    "hparam_set": "mnist1d_cnn",
}
TFRECORDS = {
    "usr_dir": str(EXAMPLES / "keras_app_tfrecords" / "tfrecord_example"),
    "model": "keras_app_mobilenet",
    "problem": "synthetic_tfrecord_images",
    "hparam_set": "synthetic_tfrecord_images",
}
WRITE_TFRECORDS = EXAMPLES / "keras_app_tfrecords" / "write_tfrecords.py"
# Two tiny segments: enough to show training, a checkpoint inside each segment and the handoff.
SEGMENTS = (("asp", 20), ("bsp", 40))
CKPT_FREQUENCY = 10
WORKERS = 2
TIMEOUT = 300


def run(args: list[str], timeout: float = TIMEOUT) -> dict[str, Any]:
    """Run a Python command line; returns its last stdout line parsed as JSON (its result)."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:3]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(names: dict[str, str], tmp_path: Path, data_dir: str = "") -> dict[str, Any]:
    """``syncswitch check --job`` on a job of ``names``."""
    job = tmp_path / "job.json"
    params = {"job_name": "example", **names, "num_workers": WORKERS, "data_dir": data_dir}
    job.write_text(json.dumps(params))
    return run(["-m", "syncswitch.cli", "check", "--job", str(job)])


def train_segments(
    names: dict[str, str], run_dir: str, work_root: Path, data_dir: str = ""
) -> list[dict[str, Any]]:
    """The SEGMENTS through ``syncswitch train``, each continuing the run folder's latest checkpoint;
    each segment's scratch (its fork server's folder included) under ``work_root``."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in names.items()]
    common = [
        *flags,
        *("--run-dir", run_dir, "--workers", str(WORKERS), "--ps", "1"),
        *("--total-steps", str(SEGMENTS[-1][1]), "--ckpt-frequency", str(CKPT_FREQUENCY), "--eval"),
        *(("--data-dir", data_dir) if data_dir else ()),
    ]
    return [
        run(
            ["-m", "syncswitch.cli", "train", "--quiet", *common]
            + ["--protocol", protocol, "--until-step", str(until), "--work-dir", str(work_root / f"seg-{i}")]
        )
        for i, (protocol, until) in enumerate(SEGMENTS)
    ]


def assert_handoff(run_dir: str, results: list[dict[str, Any]]) -> None:
    """Each segment stopped at its target, and the second started from the first's last checkpoint
    with the very weights saved there."""
    assert [r["protocol"] for r in results] == [p for p, _ in SEGMENTS]
    assert [r["global_step"] for r in results] == [until for _, until in SEGMENTS]
    assert [r["start_step"] for r in results] == [0, SEGMENTS[0][1]]
    for result in results:
        assert 0.0 <= result["test_accuracy"] <= 1.0, result
    starts = read_events(RunLayout(run_dir).segment_metrics(1, SEGMENTS[1][0]), event="segment_start")
    assert starts, "the second segment wrote no segment_start event"
    for start in starts:  # one per BSP worker
        assert start["start_step"] == SEGMENTS[0][1]
        assert start["restored_from"] == results[0]["checkpoint"]
        assert start["checkpoint_digest"] == start["restored_digest"], "restored weights differ"


# ---- the examples, end to end ------------------------------------------------------------------------


@pytest.mark.cluster
def test_mnist1d_example_checks_and_trains_asp_then_bsp(tmp_path: Path, no_leftover_processes) -> None:
    no_leftover_processes(re.escape(str(tmp_path)))
    summary = check(MNIST1D, tmp_path)
    assert summary["test_metrics"] == ["accuracy"]
    run_dir = str(tmp_path / "run")
    results = train_segments(MNIST1D, run_dir, tmp_path)
    assert_handoff(run_dir, results)
    # 40 steps are far from MNIST-1D's ~0.95 ceiling but well above chance (0.1).
    assert results[-1]["test_accuracy"] > 0.15, results[-1]


@pytest.mark.cluster
def test_keras_app_tfrecords_example_on_a_bucket(
    gcs_bucket: str, tmp_path: Path, no_leftover_processes
) -> None:
    no_leftover_processes(re.escape(str(tmp_path)))
    data_dir = f"{gcs_bucket}/synthetic-images"
    written = run([str(WRITE_TFRECORDS), data_dir, "--train-files", "4", "--records-per-file", "128"])
    assert len(written["files"]) == 5 and all(f.startswith(data_dir) for f in written["files"])
    summary = check(TFRECORDS, tmp_path, data_dir)
    assert summary["parameters"] > 100_000  # the keras.applications backbone, not a toy model
    run_dir = f"{gcs_bucket}/run"
    results = train_segments(TFRECORDS, run_dir, tmp_path, data_dir)
    assert_handoff(run_dir, results)
    assert results[-1]["checkpoint"].startswith(f"{run_dir}/")


# ---- the TFRecord problem's staging and sharding, in this process --------------------------------------


@pytest.fixture(scope="module")
def tfrecord_problem() -> Any:
    """The example's registered problem, its package imported as a job's usr_dir is."""
    usercode.load(TFRECORDS["usr_dir"])
    from syncswitch.problems import get_problem

    return get_problem(TFRECORDS["problem"])


def _records(problem: Any, files: list[str], shard: int, shards: int) -> list[bytes]:
    return [r.numpy() for r in problem.records(files, shard_index=shard, num_shards=shards)]


def test_tfrecord_problem_shards_by_file_or_by_record(tfrecord_problem: Any, tmp_path: Path) -> None:
    from tfrecord_example.synthetic import write_tfrecords

    write_tfrecords(str(tmp_path), 4, records_per_file=6, test_records_per_file=5)
    files = tfrecord_problem.files(str(tmp_path), "train-*.tfrecord")
    per_file = [_records(tfrecord_problem, [f], 0, 1) for f in files]
    everything = sorted(r for records in per_file for r in records)
    assert len(set(everything)) == 24

    # 2 shards of 4 files: shard i reads files i and i + 2 only.
    for shard in range(2):
        assert sorted(_records(tfrecord_problem, files, shard, 2)) == sorted(
            per_file[shard] + per_file[shard + 2]
        )
    # 8 shards of 4 files: every 8th record of all files, disjoint and complete.
    by_record = [_records(tfrecord_problem, files, shard, 8) for shard in range(8)]
    assert [len(r) for r in by_record] == [3] * 8
    assert sorted(r for records in by_record for r in records) == everything

    # The shard index may be a tensor (ParameterServerStrategy's dataset_fn); batches are decoded images.
    import tensorflow as tf

    dataset = tfrecord_problem.train_dataset(
        str(tmp_path), batch_size=4, shard_index=tf.constant(1), num_shards=2, seed=3
    )
    images, labels = next(iter(dataset))
    assert images.shape == (4, 32, 32, 3) and images.dtype == tf.float32 and labels.dtype == tf.int32
    assert float(tf.reduce_min(images)) >= 0.0 and float(tf.reduce_max(images)) <= 1.0
    test_examples = sum(
        int(y.shape[0]) for _, y in tfrecord_problem.test_dataset(str(tmp_path), batch_size=2)
    )
    assert test_examples == 5


def test_tfrecord_problem_stages_a_bucket_folder_once(
    tfrecord_problem: Any, gcs_bucket: str, tmp_path: Path
) -> None:
    from tfrecord_example.synthetic import write_tfrecords

    data_dir = f"{gcs_bucket}/images"
    written = write_tfrecords(data_dir, 2, records_per_file=3, test_records_per_file=3)
    storage.write_text(f"{data_dir}/notes/train-00000-of-00001.tfrecord", "not data: in a sub-folder")
    storage.write_text(f"{data_dir}/README.txt", "not data: another name")

    local = tfrecord_problem.prepare(data_dir, str(tmp_path / "cache"))
    assert sorted(p.name for p in Path(local).iterdir()) == sorted(Path(u).name for u in written)
    assert tfrecord_problem.prepare(data_dir + "/", str(tmp_path / "cache")) == local, "staged again"

    with pytest.raises(ProblemError, match=r"data_dir: .*no test-\*\.tfrecord"):
        storage.write_text(f"{gcs_bucket}/only-train/train-00000-of-00001.tfrecord", "x")
        tfrecord_problem.prepare(f"{gcs_bucket}/only-train", str(tmp_path / "cache"))
    with pytest.raises(ProblemError, match="needs a data_dir"):
        tfrecord_problem.prepare("", str(tmp_path / "cache"))


def test_a_worker_stages_only_its_own_training_files(
    tfrecord_problem: Any, gcs_bucket: str, tmp_path: Path
) -> None:
    """prepare_shard: what a BSP worker on a host of its own stages from a bucket (not the dataset)."""
    from tfrecord_example.synthetic import write_tfrecords

    data_dir = f"{gcs_bucket}/sharded"
    written = sorted(
        Path(u).name for u in write_tfrecords(data_dir, 4, records_per_file=3, test_records_per_file=2)
    )
    train = [n for n in written if n.startswith("train-")]
    local = tfrecord_problem.prepare_shard(data_dir, str(tmp_path / "cache"), 1, 2)
    assert sorted(p.name for p in Path(local).iterdir()) == sorted([train[1], train[3], "train-files.json"])
    mine = sorted(r for f in (train[1], train[3]) for r in _records(tfrecord_problem, [f"{local}/{f}"], 0, 1))
    files = tfrecord_problem.files(local, "train-*.tfrecord")
    assert [Path(f).name for f in files] == train  # every worker agrees on the order
    assert sorted(_records(tfrecord_problem, files, 1, 2)) == mine
