"""A prepared TensorFlow Datasets folder in a bucket as a problem (syncswitch.tfds): built here with a
real TFDS builder (scikit-learn's digits, generated offline), uploaded to the GCS emulator, then
checked and trained on from gs:// with nothing downloaded or generated at run time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds
from syncswitch import storage
from syncswitch.check import check_job
from syncswitch.spec import JobSpec

VERSION = "1.0.0"


class TinyDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's 8x8 digits as a TFDS dataset: 1437 train, 360 test examples."""

    VERSION = tfds.core.Version(VERSION)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1)),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
        )

    def _split_generators(self, dl_manager):  # noqa: ANN001, ANN202 - TFDS' signature
        return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

    def _generate_examples(self, split: str):  # noqa: ANN202 - a generator of (key, example)
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images * 15.9375).astype(np.uint8)[..., np.newaxis]
        indices = np.arange(len(images))
        chosen = indices[indices % 5 != 0] if split == "train" else indices[indices % 5 == 0]
        for i in chosen:
            yield int(i), {"image": images[i], "label": int(digits.target[i])}


USER_PROBLEM = """
from syncswitch.registry import register_problem
from syncswitch.tfds import TfdsProblem

@register_problem("tfds_digits")
class TfdsDigits(TfdsProblem):
    dataset = "tiny_digits/1.0.0"
    image_shape = (8, 8, 1)   # what the built-in cnn model reads
    num_classes = 10
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyDigits(data_dir=str(data_dir)).download_and_prepare(download_dir=str(data_dir / "downloads"))
    assert (data_dir / "tiny_digits" / VERSION / "dataset_info.json").is_file()
    return data_dir


@pytest.mark.cluster
def test_a_prepared_tfds_folder_in_a_bucket_trains_with_nothing_downloaded(
    prepared: Path, gcs_bucket: str, tmp_path: Path
) -> None:
    data_dir = f"{gcs_bucket}/tfds"
    storage.upload_dir(str(prepared / "tiny_digits"), f"{data_dir}/tiny_digits")
    code = tmp_path / "tfds_user_problem.py"
    code.write_text(USER_PROBLEM)
    job = {"usr_dir": str(code), "model": "cnn", "problem": "tfds_digits", "hparam_set": "cnn_digits"}

    summary = check_job(JobSpec.from_params({**job, "data_dir": data_dir}), str(tmp_path / "cache"))
    assert summary["test_metrics"] == ["accuracy"]

    run_dir, cache = f"{gcs_bucket}/runs/tfds", tmp_path / "cluster-data"

    def train(protocol: str, until_step: int) -> dict:
        argv = [sys.executable, "-m", "syncswitch.cli", "train", f"--protocol={protocol}", "--workers=2",
                "--ps=1", f"--usr-dir={code}", "--model=cnn", "--problem=tfds_digits",
                "--hparam-set=cnn_digits", f"--data-dir={data_dir}", f"--run-dir={run_dir}",
                f"--until-step={until_step}", "--ckpt-frequency=0", f"--data-cache={cache}", "--eval",
                "--quiet"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    result = train("asp", 150)
    assert result["global_step"] == 150 and result["test_accuracy"] > 0.5
    # The next segment of the same cluster (its data cache) reads the copy the first one staged.
    [staged] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    first_copy = staged.stat().st_ino
    assert train("bsp", 170)["global_step"] == 170
    assert [p for p in cache.iterdir()] == [staged] and staged.stat().st_ino == first_copy


def test_a_folder_that_is_not_a_prepared_dataset_is_named(tmp_path: Path) -> None:
    code = tmp_path / "tfds_missing_problem.py"
    code.write_text(USER_PROBLEM.replace("tfds_digits", "tfds_missing"))
    job = JobSpec.from_params(
        {
            "usr_dir": str(code),
            "model": "cnn",
            "problem": "tfds_missing",
            "hparam_set": "cnn_digits",
            "data_dir": str(tmp_path),
        }  # fmt: skip
    )
    with pytest.raises(
        ValueError, match=r"^data_dir: problem 'tfds_missing': .* holds no dataset_info\.json"
    ):
        check_job(job, str(tmp_path / "cache"))
