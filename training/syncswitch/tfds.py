"""Problems on prepared TensorFlow Datasets: a TFDS dataset folder that users built once
(``builder.download_and_prepare(download_dir=...)``) and keep in a bucket or a local folder.

Nothing is downloaded or generated at run time and no builder code is needed: the folder's
``dataset_info.json`` describes it (``tfds.builder_from_directory``). ``gs://`` folders are staged
into the node's cache first (TensorFlow's own gs:// client cannot reach an emulator; ours can).

    @register_problem("my_tfds")
    class MyTfds(TfdsProblem):
        dataset = "my_dataset/1.0.0"          # relative to data_dir ("" = data_dir is that folder)

        def to_pair(self, example):           # the dataset's feature dict -> (features, labels)
            return tf.cast(example["image"], tf.float32) / 255.0, example["label"]

``tensorflow-datasets`` is needed only by jobs that use such a problem (it is in the dev group).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Unpack

from syncswitch import storage
from syncswitch.problems import Problem, ProblemError, TrainStream, stage_folder, training_pipeline

_SHUFFLE_BUFFER = 10_000


class TfdsProblem(Problem):
    """A prepared TFDS dataset under ``data_dir``. Override ``to_pair`` for other feature names."""

    dataset: str = ""  # e.g. "my_dataset/1.0.0": the version folder, relative to data_dir
    train_split: str = "train"
    test_split: str = "test"
    features_key: str = "image"
    label_key: str = "label"

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        if not data_dir:
            raise ProblemError("data_dir", f"problem {self.name!r} reads a prepared TFDS folder: name it")
        folder = f"{data_dir.rstrip('/')}/{self.dataset}" if self.dataset else data_dir
        if storage.is_remote(data_dir):
            digest = hashlib.sha256(folder.encode()).hexdigest()[:12]
            local = stage_folder(folder, cache_dir, f"tfds-{self.name}-{digest}", self._check)
        else:
            local = folder
            self._check(local)
        return local

    def _check(self, folder: str) -> None:
        if not os.path.isfile(os.path.join(folder, "dataset_info.json")):
            raise ProblemError(
                "data_dir",
                f"problem {self.name!r}: {folder!r} holds no dataset_info.json; expected a prepared TFDS "
                f"version folder{f' ({self.dataset})' if self.dataset else ''}",
            )

    def builder(self, local_dir: str) -> Any:
        import tensorflow_datasets as tfds

        return tfds.builder_from_directory(local_dir)

    def to_pair(self, example: dict[str, Any]) -> tuple[Any, Any]:
        """``(features, labels)`` of one example; by default ``features_key`` scaled to [0, 1] floats
        when it is an integer image, and ``label_key``."""
        import tensorflow as tf

        features = example[self.features_key]
        if features.dtype == tf.uint8:
            features = tf.cast(features, tf.float32) / 255.0
        return features, tf.cast(example[self.label_key], tf.int32)

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> Any:
        def pair(example: dict[str, Any], _example_seed: Any) -> tuple[Any, Any]:
            return self.to_pair(example)

        # Records in a fixed order, then this worker's share: every worker reads a disjoint share.
        examples = self.builder(local_dir).as_dataset(split=self.train_split, shuffle_files=False)
        return training_pipeline(examples, shuffle_buffer=_SHUFFLE_BUFFER, per_example=pair, **stream)

    def test_dataset(self, local_dir: str, *, batch_size: int) -> Any:
        import tensorflow as tf

        examples = self.builder(local_dir).as_dataset(split=self.test_split, shuffle_files=False)
        return examples.map(self.to_pair, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size)
