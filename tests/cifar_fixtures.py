"""Small CIFAR-10 / CIFAR-100 files in the real binary format, with known pixels and labels.

Every image is random noise except a 12x12 block around the centre whose first two channels hold the
image's record id (``id % 256``, ``id // 256``). Pad-4 + random-crop-32 + random flip always move one
of the block's pixels to ``ID_PIXEL``, so ``record_id`` identifies a record even after augmentation.
Record ids are unique across the train and test files of one fixture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ID_PIXEL = (16, 16)
_ID_BLOCK = slice(10, 22)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"


@dataclass(frozen=True)
class CifarFixture:
    """What was written. Images are uint8 [N, 32, 32, 3] (height, width, channel), in file order."""

    folder: str
    train_images: np.ndarray
    train_labels: np.ndarray  # the class: CIFAR-10's label, CIFAR-100's fine label
    test_images: np.ndarray
    test_labels: np.ndarray

    @property
    def train_ids(self) -> set[int]:
        return {record_id(image) for image in self.train_images}


def record_id(image: np.ndarray) -> int:
    """The id written into a uint8 [32, 32, 3] image (augmented or not)."""
    y, x = ID_PIXEL
    return int(image[y, x, 0]) + 256 * int(image[y, x, 1])


def _images(rng: np.random.Generator, first_id: int, count: int) -> np.ndarray:
    images = rng.integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8)
    for offset in range(count):
        rid = first_id + offset
        images[offset, _ID_BLOCK, _ID_BLOCK, 0] = rid % 256
        images[offset, _ID_BLOCK, _ID_BLOCK, 1] = rid // 256
    return images


def _records(label_bytes: np.ndarray, images: np.ndarray) -> bytes:
    """Label bytes followed by the pixels channel-major (all reds, all greens, all blues)."""
    chw = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    return np.concatenate([label_bytes.astype(np.uint8), chw], axis=1).tobytes()


def write_cifar10(directory: str, records_per_file: int = 8, seed: int = 0) -> CifarFixture:
    """data_batch_1..5.bin and test_batch.bin, ``records_per_file`` records each, in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    train_images, train_labels = [], []
    for index, name in enumerate((*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)):
        images = _images(rng, index * records_per_file, records_per_file)
        labels = rng.integers(0, 10, size=records_per_file)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(_records(labels[:, np.newaxis], images))
        train_images.append(images)
        train_labels.append(labels)
    return CifarFixture(
        folder=directory,
        train_images=np.concatenate(train_images[:-1]),
        train_labels=np.concatenate(train_labels[:-1]),
        test_images=train_images[-1],
        test_labels=train_labels[-1],
    )


def write_cifar100(
    directory: str, train_records: int = 40, test_records: int = 8, seed: int = 0
) -> CifarFixture:
    """train.bin and test.bin in ``directory``; records carry a coarse and a fine label byte."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    first_id = 0
    for name, count in (("train.bin", train_records), ("test.bin", test_records)):
        images = _images(rng, first_id, count)
        fine = rng.integers(0, 100, size=count)
        coarse = fine // 5
        with open(os.path.join(directory, name), "wb") as f:
            f.write(_records(np.stack([coarse, fine], axis=1), images))
        written[name] = (images, fine)
        first_id += count
    return CifarFixture(
        folder=directory,
        train_images=written["train.bin"][0],
        train_labels=written["train.bin"][1],
        test_images=written["test.bin"][0],
        test_labels=written["test.bin"][1],
    )
