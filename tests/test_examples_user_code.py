"""The example user projects under examples/ (docs/bring-your-own-model.md), run as users run them.

For each example, "101" through the DAG on the local backend (the text example's, with its export
served from a fresh process, is in test_user_code.py): the validate task checks the user code, every
segment stops exactly on its target and restores its predecessor's checkpoint bit-identically, and
the model is exported. The TFRecord example reads its data from, and writes its run to, a bucket on
the GCS emulator. Faster tests check that its TFRecord problem shards by file (and by record when
there are fewer files than shards) and that a worker stages only its own files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from syncswitch import storage, usercode
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch.problems import ProblemError
from syncswitch.state import read_state

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
# Three tiny segments: enough to show training, a checkpoint inside each segment and the handoffs.
SEGMENT_STEPS = (20, 20, 20)
CKPT_FREQUENCY = 10
WORKERS = 2
TIMEOUT = 300


def run(args: list[str], timeout: float = TIMEOUT) -> dict[str, Any]:
    """Run a Python command line; returns its last stdout line parsed as JSON (its result)."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:3]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_101(dag: Any, names: dict[str, str], job_name: str, bucket_dir: str, data_dir: str = "") -> dict:  # noqa: ANN401
    """ "101" of an example through the DAG (dag.test; its validate task runs ``syncswitch check`` on the
    example first); the run's state. Each segment stops exactly on its target and restores the
    previous one's checkpoint bit-identically (both digests in its segment_start event)."""
    conf = {
        "job_name": job_name,
        **names,
        "switch_order": "101",
        "train_steps": list(SEGMENT_STEPS),
        "ckpt_frequency": [CKPT_FREQUENCY],
        "num_workers": WORKERS,
        "bucket_dir": bucket_dir,
        "data_dir": data_dir,
    }
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket_dir, job_name, dag_run.run_id)
    state = read_state(layout)
    assert [e["protocol"] for e in state["plan"]] == ["bsp", "asp", "bsp"]
    ends = [sum(SEGMENT_STEPS[: i + 1]) for i in range(3)]
    assert [state["segments"][str(i)]["end_step"] for i in range(3)] == ends
    assert state["final"]["global_step"] == ends[-1]
    for index, protocol in ((1, "asp"), (2, "bsp")):
        starts = read_events(layout.segment_metrics(index, protocol), event="segment_start")
        # The hand-off: the first attempt starts where the segment before ended. A retry (CI's load
        # once failed an attempt) resumes from this segment's own latest checkpoint, as exactly.
        assert starts and starts[0]["start_step"] == ends[index - 1], starts
        assert all(ends[index - 1] <= s["start_step"] <= ends[index] for s in starts), starts
        assert all(s["checkpoint_digest"] == s["restored_digest"] is not None for s in starts)
    assert state["user_code"]["digest"] == usercode.digest(names["usr_dir"])
    assert storage.exists(state["final"]["export"]["keras"])
    return state


# ---- the examples, end to end ------------------------------------------------------------------------


@pytest.mark.airflow
@pytest.mark.cluster
def test_mnist1d_example_trains_101_through_the_dag(dag, tmp_path: Path, work_root: Path) -> None:  # noqa: ANN001
    state = run_101(dag, MNIST1D, "example-mnist1d", str(tmp_path / "runs"))
    # 60 steps are far from MNIST-1D's ~0.95 ceiling but above chance (0.1).
    assert state["final"]["test_accuracy"] > 0.15, state["final"]


@pytest.mark.airflow
@pytest.mark.cluster
def test_keras_app_tfrecords_example_trains_101_on_a_bucket(
    dag,
    gcs_bucket: str,
    tmp_path: Path,
    work_root: Path,  # noqa: ANN001
) -> None:
    data_dir = f"{gcs_bucket}/synthetic-images"
    written = run([str(WRITE_TFRECORDS), data_dir, "--train-files", "4", "--records-per-file", "128"])
    assert len(written["files"]) == 5 and all(f.startswith(data_dir) for f in written["files"])
    state = run_101(dag, TFRECORDS, "example-tfrecords", f"{gcs_bucket}/runs", data_dir)
    assert state["segments"]["2"]["checkpoint"].startswith(f"{gcs_bucket}/runs/")


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
