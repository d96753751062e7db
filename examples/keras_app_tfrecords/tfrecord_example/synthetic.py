"""``synthetic_tfrecord_images``: a small, learnable image data set written as TFRecords.

Each 32x32 RGB image is Gaussian noise around a grey background with a square patch of its class's
colour at a random place and size: a global colour average tells the class in most images, but the
patch is small in some, so accuracy climbs over a few hundred steps instead of at once. Generated with
numpy from fixed seeds, so the same arguments write the same bytes.

    write_tfrecords("gs://bucket/data", num_train_files=4)     # or a local folder
"""

from __future__ import annotations

import numpy as np
from syncswitch.registry import register_problem
from syncswitch.tfrecords import TFRecordImageProblem, serialize_example, write_records

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
# Class colours are fixed, whatever the seed of the images: the train and test files must agree.
_COLOUR_SEED = 1234
_TEST_SEED_OFFSET = 1_000_000


@register_problem("synthetic_tfrecord_images")
class SyntheticTFRecordImages(TFRecordImageProblem):
    """The files ``write_tfrecords`` writes: raw uint8 32x32x3 images, 10 classes."""

    image_shape = IMAGE_SHAPE
    num_classes = NUM_CLASSES
    image_encoding = "raw"


def class_colours(num_classes: int = NUM_CLASSES) -> np.ndarray:
    """``[num_classes, 3]`` distinct colours in 0..255."""
    return np.random.default_rng(_COLOUR_SEED).integers(0, 256, size=(num_classes, 3)).astype(np.float32)


def make_images(count: int, seed: int, num_classes: int = NUM_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """``(uint8 images [count, 32, 32, 3], int64 labels [count])``, from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    height, width, channels = IMAGE_SHAPE
    colours = class_colours(num_classes)
    labels = rng.integers(0, num_classes, size=count)
    images = 128.0 + rng.normal(0.0, 48.0, size=(count, height, width, channels))
    for image, label in zip(images, labels, strict=True):
        size = int(rng.integers(6, 17))
        top, left = rng.integers(0, height - size + 1), rng.integers(0, width - size + 1)
        patch = image[top : top + size, left : left + size]
        patch[...] = colours[label] + rng.normal(0.0, 24.0, size=patch.shape)
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)


def write_tfrecords(
    out_dir: str,
    num_train_files: int = 4,
    *,
    records_per_file: int = 256,
    num_test_files: int = 1,
    test_records_per_file: int = 512,
    seed: int = 0,
) -> list[str]:
    """Write ``train-XXXXX-of-NNNNN.tfrecord`` and ``test-...`` files into ``out_dir`` (a local folder
    or a ``gs://`` URI); returns their URIs. File ``i`` of a split is generated from ``(seed, split,
    i)``, so files can be written (or rewritten) independently."""
    written = []
    for split, files, per_file, offset in (
        ("train", num_train_files, records_per_file, 0),
        ("test", num_test_files, test_records_per_file, _TEST_SEED_OFFSET),
    ):
        for index in range(files):
            images, labels = make_images(per_file, seed * 10_000_019 + offset + index)
            uri = f"{out_dir.rstrip('/')}/{split}-{index:05d}-of-{files:05d}.tfrecord"
            records = [serialize_example(x.tobytes(), int(y)) for x, y in zip(images, labels, strict=True)]
            write_records(uri, records)
            written.append(uri)
    return written
