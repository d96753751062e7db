"""``TFRecordImageProblem``: a generic problem for image-classification TFRecords in a folder or bucket.

The data is a folder (local, or ``gs://``) of ``train-*.tfrecord`` and ``test-*.tfrecord`` files of
``tf.train.Example`` records with two features: ``image`` (bytes: raw uint8 pixels, row-major HWC, or
a PNG) and ``label`` (int64). Subclass it with the images' shape, the number of classes and the
encoding, and register the subclass; that is all a new image data set needs.

- ``prepare`` stages ``gs://`` files into the node's cache folder (TensorFlow's own ``gs://`` reader
  cannot be pointed at an emulator, google-cloud-storage can, through ``syncswitch.storage``); a local
  folder is read where it is.
- ``train_dataset`` shards by file when there are at least as many training files as shards, so each
  worker opens and reads only its own files (the way to scale to many large files); with fewer files
  it falls back to sharding by record, which still gives disjoint shares but reads every file.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

import tensorflow as tf
from syncswitch import storage
from syncswitch.problems import Problem, ProblemError

log = logging.getLogger(__name__)

TRAIN_PATTERN = "train-*.tfrecord"
TEST_PATTERN = "test-*.tfrecord"
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
        """Download once per URI into ``cache_dir``: into a temp folder renamed into place, so a folder
        under its final name is always complete, also when several processes stage at once."""
        target = os.path.join(cache_dir, f"{self.name}-{hashlib.sha256(data_dir.encode()).hexdigest()[:12]}")
        if os.path.isdir(target):
            return target
        uris = self._remote_files(data_dir)
        os.makedirs(cache_dir, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cache_dir, prefix=".staging-")
        try:
            for uri in uris:
                storage.download_file(uri, os.path.join(staging, os.path.basename(uri)))
            os.rename(staging, target)
            log.info("problem %s: staged %d files of %s into %s", self.name, len(uris), data_dir, target)
        except OSError:
            if not os.path.isdir(target):
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def files(self, local_dir: str, pattern: str) -> list[str]:
        """The files of ``pattern`` in ``local_dir``, sorted: every shard must see the same order."""
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

    def train_dataset(
        self, local_dir: str, *, batch_size: int, shard_index: Any, num_shards: int, seed: int
    ) -> tf.data.Dataset:
        files = self.files(local_dir, self.train_pattern)

        def decode_and_augment(index: tf.Tensor, serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            image, label = self.decode(serialized)
            return self.augment(image, example_seed(seed, shard_index, index)), label

        return (
            self.records(files, shard_index=shard_index, num_shards=num_shards)
            .shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
            .repeat()
            .enumerate()
            .map(decode_and_augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(batch_size, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
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


def example_seed(seed: int, shard_index: Any, index: tf.Tensor) -> tf.Tensor:
    """A [2] int64 stateless seed unique to (seed, shard, element): no two shards or examples share
    an augmentation, and the same seed gives the same stream."""
    shard = tf.cast(shard_index, tf.int64)
    return tf.stack([tf.constant(seed, tf.int64) * 65_536 + shard, tf.cast(index, tf.int64)])


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
