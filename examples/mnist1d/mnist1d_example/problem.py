"""``mnist1d``: the MNIST-1D signals of the ``mnist1d`` package, generated in-process.

MNIST-1D (Greydanus 2020) turns ten 1-D digit templates into 40-sample signals with random padding,
translation, shear, scaling and correlated noise. It is tiny (4,000 training and 1,000 test signals)
but, unlike scikit-learn's 8x8 digits, not solved in a few hundred steps: linear models fail on it
and a small CNN needs thousands of steps to do well, so BSP, ASP and their switch point give visibly
different accuracies.

Nothing is downloaded: ``make_dataset`` regenerates the canonical data set from its fixed seed, the
same on every node. ``prepare`` does it once into the cluster's data cache, and the processes load
that file, so that generating is paid once per cluster, not by every process at every switch.
Features are float32 ``[B, 40, 1]`` (a channels-last signal), labels int32 ``[B]``.
"""

from __future__ import annotations

import os
import random
from functools import cache
from typing import Any, Unpack

import numpy as np
import tensorflow as tf
from syncswitch.problems import Problem, TrainStream, training_pipeline
from syncswitch.registry import register_problem

SEQUENCE_LENGTH = 40
NUM_CLASSES = 10
# The canonical MNIST-1D: 5,000 signals, 80/20 train/test split, seed 42 (get_dataset_args' defaults).
DATA_SEED = 42


@cache
def make_splits(seed: int = DATA_SEED) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (x, y), "test": (x, y)}``; x float32 ``[N, 40, 1]``, y int32 ``[N]``.

    ``make_dataset`` seeds Python's and numpy's global generators; their states are restored after it,
    so that generating the data does not change any other random stream of the process.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)

    def split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x.astype(np.float32)[..., np.newaxis], y.astype(np.int32)

    return {"train": split(data["x"], data["y"]), "test": split(data["x_test"], data["y_test"])}


def save_splits(folder: str) -> str:
    """Write ``make_splits()`` to ``folder/mnist1d.npz`` unless it is there; returns its path. Written
    under a temporary name and renamed, so a file under the final name is always complete."""
    path = os.path.join(folder, "mnist1d.npz")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        splits = make_splits()
        partial = f"{path}.{os.getpid()}.npz"
        np.savez(
            partial,
            x=splits["train"][0],
            y=splits["train"][1],
            x_test=splits["test"][0],
            y_test=splits["test"][1],
        )
        os.replace(partial, path)
    return path


@cache
def load_splits(local_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The splits from ``prepare``'s file in ``local_dir``, or generated where there is none."""
    path = os.path.join(local_dir, "mnist1d.npz") if local_dir else ""
    if not path or not os.path.exists(path):
        return make_splits()
    with np.load(path) as data:
        return {"train": (data["x"], data["y"]), "test": (data["x_test"], data["y_test"])}


@register_problem("mnist1d")
class Mnist1D(Problem):
    """Classification of MNIST-1D signals; the default loss and accuracy metric (logits outputs)."""

    sequence_length = SEQUENCE_LENGTH
    num_classes = NUM_CLASSES

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        folder = os.path.join(cache_dir, f"mnist1d-seed{DATA_SEED}")
        save_splits(folder)
        return folder

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> tf.data.Dataset:
        # Under ParameterServerStrategy this runs in a traced dataset_fn: do_not_convert keeps
        # AutoGraph out of the numpy generator (converting it is slow and pointless).
        x, y = tf.autograph.experimental.do_not_convert(load_splits)(local_dir)["train"]
        return training_pipeline(tf.data.Dataset.from_tensor_slices((x, y)), shuffle_buffer=len(y), **stream)

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        x, y = load_splits(local_dir)["test"]
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    def signature(self) -> dict[str, Any]:
        return {**super().signature(), "input_shape": [SEQUENCE_LENGTH, 1], "num_classes": NUM_CLASSES}
