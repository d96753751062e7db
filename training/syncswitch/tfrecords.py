"""``TFRecordImageProblem``: image-classification TFRecords in a folder or a bucket, as a problem.

The data is a folder (local, or ``gs://``) of ``train-*.tfrecord`` and ``test-*.tfrecord`` files of
``tf.train.Example`` records with two features: ``image`` (bytes: raw uint8 pixels, row-major HWC, or
a PNG) and ``label`` (int64). Subclass it with the images' shape, the number of classes and the
encoding (and ``feature_spec``/``decode`` for other features), and register the subclass; that is all
a new image data set needs (examples/keras_app_tfrecords).

- ``prepare`` stages ``gs://`` files into the node's cache folder (TensorFlow's own ``gs://`` reader
  cannot be pointed at an emulator, google-cloud-storage can, through ``syncswitch.storage``); a local
  folder is read where it is.
- ``prepare_shard`` stages only what one worker reads: its own training files (and the list of all of
  them, so every worker agrees on the order). A BSP worker on a host of its own stages that way, so a
  large dataset is not copied to every node.
- ``train_dataset`` shards by file when there are at least as many training files as shards, so each
  worker opens and reads only its own files (the way to scale to many large files); with fewer files
  it falls back to sharding by record, which still gives disjoint shares but reads every file.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import tempfile
from typing import Any, Unpack

import tensorflow as tf

from syncswitch import storage
from syncswitch.problems import Problem, ProblemError, TrainStream, stage_folder, training_pipeline

TRAIN_PATTERN = "train-*.tfrecord"
TEST_PATTERN = "test-*.tfrecord"
# In a folder staged for one shard: the names of every training file, in order.
TRAIN_FILES = "train-files.json"
ENCODINGS = ("raw", "png")


class TFRecordImageProblem(Problem):
    """Images and integer labels from TFRecord files; features float32 ``[B, H, W, C]`` in [0, 1],
    labels int32 ``[B]``. The default loss and accuracy (logits outputs) apply."""

    image_shape: tuple[int, int, int]
    num_classes: int
    image_encoding: str = "raw"
    train_pattern: str = TRAIN_PATTERN
    test_pattern: str = TEST_PATTERN
    shuffle_buffer: int = 2048
    # Files read at once by a shard: interleaving mixes records of different files before the shuffle.
    cycle_length: int = 4

    # ---- the records --------------------------------------------------------------------------

    def feature_spec(self) -> dict[str, tf.io.FixedLenFeature]:
        """How to parse one ``tf.train.Example``; override to read more features."""
        return {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
        }

    def decode(self, serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """One serialized example -> (float32 image in [0, 1] of ``image_shape``, int32 label)."""
        example = tf.io.parse_single_example(serialized, self.feature_spec())
        if self.image_encoding == "png":
            pixels = tf.io.decode_png(example["image"], channels=self.image_shape[-1])
        else:
            pixels = tf.io.decode_raw(example["image"], tf.uint8)
        image = tf.reshape(pixels, self.image_shape)
        return tf.cast(image, tf.float32) / 255.0, tf.cast(example["label"], tf.int32)

    def augment(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """A random left-right flip. Stateless (seeded per example): dataset_fns may not create the
        variables a stateful random op needs."""
        return tf.image.stateless_random_flip_left_right(image, seed=seed)

    # ---- staging ------------------------------------------------------------------------------

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        if not data_dir:
            raise ProblemError(
                "data_dir",
                f"problem {self.name!r} needs a data_dir (local folder or gs:// URI) holding "
                f"{self.train_pattern} and {self.test_pattern}",
            )
        if not storage.is_remote(data_dir):
            self.files(data_dir, self.train_pattern)  # fail here, naming the folder, if it has none
            self.files(data_dir, self.test_pattern)
            return data_dir
        return self._stage_remote(data_dir.rstrip("/"), cache_dir)

    def _remote_files(self, data_dir: str) -> list[str]:
        """The train and test files directly in ``data_dir`` (sub-folders are not data)."""
        patterns = (self.train_pattern, self.test_pattern)
        top_level = [u for u in storage.list_files(data_dir) if "/" not in u[len(data_dir) + 1 :]]
        wanted = [u for u in top_level if any(fnmatch.fnmatch(os.path.basename(u), p) for p in patterns)]
        for pattern in patterns:
            if not any(fnmatch.fnmatch(os.path.basename(u), pattern) for u in wanted):
                raise ProblemError(
                    "data_dir", f"{data_dir!r} has no {pattern} files for problem {self.name!r}"
                )
        return wanted

    def _stage_remote(self, data_dir: str, cache_dir: str) -> str:
        """Every train and test file, downloaded once per URI into ``cache_dir``."""
        names = [os.path.basename(u) for u in self._remote_files(data_dir)]
        return stage_folder(data_dir, cache_dir, f"{self.name}-{_digest(data_dir)}", files=names)

    def prepare_shard(self, data_dir: str, cache_dir: str, shard_index: int, num_shards: int) -> str:
        """Only what shard ``shard_index`` of ``num_shards`` trains on: its own training files when
        sharding is by file, plus the list of all of them. Test files are staged by ``prepare``
        (the chief evaluates)."""
        if not storage.is_remote(data_dir):
            return self.prepare(data_dir, cache_dir)
        data_dir = data_dir.rstrip("/")
        uris = self._remote_files(data_dir)
        train = sorted(
            os.path.basename(u) for u in uris if fnmatch.fnmatch(os.path.basename(u), self.train_pattern)
        )
        mine = train[shard_index::num_shards] if len(train) >= num_shards else train
        name = f"{self.name}-{_digest(data_dir)}-shard{shard_index}of{num_shards}"
        folder = stage_folder(data_dir, cache_dir, name, files=mine)
        manifest = os.path.join(folder, TRAIN_FILES)
        if not os.path.exists(manifest):
            with open(manifest + ".tmp", "w", encoding="utf-8") as f:
                json.dump(train, f)
            os.replace(manifest + ".tmp", manifest)
        return folder

    def files(self, local_dir: str, pattern: str) -> list[str]:
        """The files of ``pattern`` in ``local_dir``, sorted: every shard must see the same order. A
        folder staged for one shard lists every training file, of which it holds its own."""
        manifest = os.path.join(local_dir, TRAIN_FILES)
        if pattern == self.train_pattern and os.path.exists(manifest):
            with open(manifest, encoding="utf-8") as f:
                return [os.path.join(local_dir, name) for name in json.load(f)]
        found = sorted(glob.glob(os.path.join(glob.escape(local_dir), pattern)))
        if not found:
            raise ProblemError("data_dir", f"{local_dir!r} has no {pattern} files for problem {self.name!r}")
        return found

    # ---- datasets -----------------------------------------------------------------------------

    def records(self, files: list[str], *, shard_index: Any, num_shards: int) -> tf.data.Dataset:
        """Serialized records of this shard: its own files when there are enough, else every
        ``num_shards``-th record of all of them."""
        # Dataset.shard wants an int64 index: ParameterServerStrategy's worker index is one, but a
        # Python int or an int32 tensor from elsewhere is accepted too.
        shard_index = tf.cast(shard_index, tf.int64)
        if len(files) >= num_shards:
            return (
                tf.data.Dataset.from_tensor_slices(files)
                .shard(num_shards, shard_index)
                .interleave(
                    tf.data.TFRecordDataset,
                    cycle_length=self.cycle_length,
                    num_parallel_calls=tf.data.AUTOTUNE,
                    deterministic=True,
                )
            )
        return tf.data.TFRecordDataset(files).shard(num_shards, shard_index)

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> tf.data.Dataset:
        files = self.files(local_dir, self.train_pattern)
        records = self.records(files, shard_index=stream["shard_index"], num_shards=stream["num_shards"])

        def decode_and_augment(serialized: tf.Tensor, example_seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            image, label = self.decode(serialized)
            return self.augment(image, example_seed), label

        return training_pipeline(
            records,
            shuffle_buffer=self.shuffle_buffer,
            sharded=True,
            per_example=decode_and_augment,
            **stream,
        )

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        return (
            tf.data.TFRecordDataset(self.files(local_dir, self.test_pattern))
            .map(self.decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(batch_size)
            .prefetch(tf.data.AUTOTUNE)
        )

    def signature(self) -> dict[str, Any]:
        return {**super().signature(), "input_shape": list(self.image_shape), "num_classes": self.num_classes}


def _digest(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:12]


def serialize_example(image: bytes, label: int) -> bytes:
    """One record in the layout ``TFRecordImageProblem`` reads."""
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_records(uri: str, records: list[bytes]) -> None:
    """Write a TFRecord file to a local path or ``gs://`` URI: framed locally by TensorFlow, then
    copied through ``syncswitch.storage`` (which honours ``STORAGE_EMULATOR_HOST``)."""
    with tempfile.TemporaryDirectory(prefix="tfrecords-") as scratch:
        local = os.path.join(scratch, os.path.basename(uri))
        with tf.io.TFRecordWriter(local) as writer:
            for record in records:
                writer.write(record)
        storage.upload_file(local, uri)
