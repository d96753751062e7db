"""syncswitch.problems on real files: CIFAR binaries written by cifar_fixtures, the bundled digits, the
synthetic generator, and gs:// data staged from the real GCS emulator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from cifar_fixtures import CIFAR10_TEST_FILE, CifarFixture, record_id, write_cifar10, write_cifar100
from syncswitch import storage
from syncswitch.layout import join
from syncswitch.problems import CifarProblem, ProblemError, get_problem, problem_names

CIFAR10 = get_problem("image_cifar10")
CIFAR100 = get_problem("image_cifar100")


def _collect(dataset: tf.data.Dataset, batches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for image, label in dataset.take(batches) if batches else dataset:
        images.append(image.numpy())
        labels.append(label.numpy())
    return np.concatenate(images), np.concatenate(labels)


def _to_uint8(problem: CifarProblem, images: np.ndarray) -> np.ndarray:
    """Undo the per-channel normalisation; exact for images that were not augmented."""
    raw = (images * np.array(problem.std) + np.array(problem.mean)) * 255.0
    return np.rint(raw).astype(np.uint8)


def _normalised(problem: CifarProblem, images: np.ndarray) -> np.ndarray:
    return ((images / 255.0 - np.array(problem.mean)) / np.array(problem.std)).astype(np.float32)


# --- names ------------------------------------------------------------------------------------


def test_built_in_problems_are_registered_under_their_names() -> None:
    assert {"digits", "image_cifar10", "image_cifar100", "synthetic_cifar"} <= set(problem_names())
    for name in problem_names():
        assert get_problem(name).name == name


def test_unknown_problem_names_the_accepted_ones() -> None:
    with pytest.raises(ProblemError, match=r"^problem: unknown 'mnist'; accepted: .*digits, .*image_cifar10"):
        get_problem("mnist")


def test_listing_problems_does_not_import_tensorflow() -> None:
    code = (
        "import sys; from syncswitch.problems import get_problem, problem_names; "
        "[get_problem(n).image_shape for n in problem_names()]; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_shapes_and_classes() -> None:
    assert (CIFAR10.image_shape, CIFAR10.num_classes) == ((32, 32, 3), 10)
    assert (CIFAR100.image_shape, CIFAR100.num_classes) == ((32, 32, 3), 100)
    assert (get_problem("digits").image_shape, get_problem("digits").num_classes) == ((8, 8, 1), 10)
    synthetic = get_problem("synthetic_cifar")
    assert (synthetic.image_shape, synthetic.num_classes) == ((32, 32, 3), 10)


# --- CIFAR reading --------------------------------------------------------------------------------


def test_cifar10_test_set_is_read_exactly(tmp_path: Path) -> None:
    written = write_cifar10(str(tmp_path / "c10"), records_per_file=6)
    folder = CIFAR10.prepare(written.folder, str(tmp_path / "cache"))
    assert folder == written.folder

    images, labels = _collect(CIFAR10.test_dataset(folder, batch_size=4))

    assert images.dtype == np.float32 and images.shape == (6, 32, 32, 3)
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels, written.test_labels)
    np.testing.assert_allclose(images, _normalised(CIFAR10, written.test_images), atol=1e-5)
    np.testing.assert_array_equal(_to_uint8(CIFAR10, images), written.test_images)
    assert CIFAR10.num_test_examples(folder) == 6


def test_cifar100_reads_the_fine_label_from_the_parent_folder(tmp_path: Path) -> None:
    written = write_cifar100(str(tmp_path / "cifar-100-binary"), train_records=10, test_records=5)

    folder = CIFAR100.prepare(str(tmp_path), str(tmp_path / "cache"))

    assert folder == written.folder
    images, labels = _collect(CIFAR100.test_dataset(folder, batch_size=5))
    np.testing.assert_array_equal(labels, written.test_labels)
    np.testing.assert_array_equal(_to_uint8(CIFAR100, images), written.test_images)
    assert CIFAR100.num_test_examples(folder) == 5


def test_normalisation_is_per_channel_mean_and_std() -> None:
    # A mid-grey pixel of value v maps to (v/255 - mean_c) / std_c in each channel c.
    record = tf.constant(bytes([3]) + bytes([128]) * 1024 + bytes([0]) * 1024 + bytes([255]) * 1024)
    image, label = CIFAR10.decode(record)
    expected = (np.array([128, 0, 255]) / 255.0 - np.array(CIFAR10.mean)) / np.array(CIFAR10.std)
    np.testing.assert_allclose(image.numpy()[5, 7], expected, atol=1e-6)
    assert int(label) == 3


@pytest.fixture
def cifar10(tmp_path: Path) -> CifarFixture:
    return write_cifar10(str(tmp_path / "cifar-10-batches-bin"), records_per_file=8)


def test_train_shards_are_disjoint_and_cover_the_data(cifar10: CifarFixture) -> None:
    labels_by_id = {
        record_id(img): int(lbl) for img, lbl in zip(cifar10.train_images, cifar10.train_labels, strict=True)
    }
    seen: list[set[int]] = []
    for shard in (0, tf.constant(1, tf.int64)):  # a PSS dataset_fn passes the worker index as a tensor
        dataset = CIFAR10.train_dataset(cifar10.folder, batch_size=4, shard_index=shard, num_shards=2, seed=3)
        images, labels = _collect(dataset, batches=10)  # two passes over a shard of 20 records
        ids = [record_id(img) for img in _to_uint8(CIFAR10, images)]
        assert [labels_by_id[i] for i in ids] == labels.tolist()
        seen.append(set(ids))

    assert len(seen[0]) == len(seen[1]) == 20
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == cifar10.train_ids


def _crops_and_flips(problem: CifarProblem, image: np.ndarray) -> list[np.ndarray]:
    """All 162 outputs pad-4 + crop-32 + optional flip can make of one normalised image."""
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
    crops = [padded[y : y + 32, x : x + 32] for y in range(9) for x in range(9)]
    return crops + [crop[:, ::-1] for crop in crops]


def test_augmentation_is_a_crop_and_flip_of_the_record(cifar10: CifarFixture) -> None:
    originals = {record_id(img): _normalised(CIFAR10, img) for img in cifar10.train_images}
    dataset = CIFAR10.train_dataset(cifar10.folder, batch_size=8, shard_index=0, num_shards=1, seed=0)
    images, labels = _collect(dataset, batches=2)

    assert images.shape == (16, 32, 32, 3) and images.dtype == np.float32 and labels.dtype == np.int32
    changed = 0
    for image in images:
        original = originals[record_id(_to_uint8(CIFAR10, image))]
        assert any(np.allclose(image, c, atol=1e-5) for c in _crops_and_flips(CIFAR10, original))
        changed += not np.allclose(image, original, atol=1e-5)
    assert changed >= 8, "augmentation left most images unchanged"


def test_training_stream_is_deterministic_per_seed(cifar10: CifarFixture) -> None:
    def first_batches(seed: int) -> np.ndarray:
        dataset = CIFAR10.train_dataset(cifar10.folder, batch_size=8, shard_index=0, num_shards=2, seed=seed)
        return _collect(dataset, batches=3)[0]

    np.testing.assert_array_equal(first_batches(5), first_batches(5))
    assert not np.array_equal(first_batches(5), first_batches(6))


def test_datasets_make_no_variables_no_stateful_rng_and_no_big_constants(cifar10: CifarFixture) -> None:
    """What a ParameterServerStrategy dataset_fn needs: built in a fresh graph, every op (functions
    included) is checked."""
    for name, folder in (("image_cifar10", cifar10.folder), ("synthetic_cifar", ""), ("digits", "")):
        problem = get_problem(name)
        graph = tf.Graph()
        with graph.as_default():
            shard = tf.constant(1, tf.int64)
            problem.train_dataset(folder, batch_size=4, shard_index=shard, num_shards=2, seed=1)
            problem.test_dataset(folder, batch_size=4)
        graph_def = graph.as_graph_def()
        nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
        op_types = {n.op for n in nodes}
        assert not {t for t in op_types if "Variable" in t or "VarHandle" in t}, name
        assert not {t for t in op_types if "Random" in t and not t.startswith("Stateless")}, name
        if name != "digits":  # digits is 0.4 MB of constants by design; the others carry no data
            biggest = max(len(n.attr["value"].tensor.tensor_content) for n in nodes if n.op == "Const")
            assert biggest < 64 * 1024, name


# --- CIFAR validation --------------------------------------------------------------------------------


def _break(folder: str, how: str) -> str:
    """Damage one file of a CIFAR-10 fixture; returns its name."""
    path = os.path.join(folder, "data_batch_3.bin")
    if how == "missing":
        os.unlink(path)
    elif how == "empty":
        open(path, "wb").close()
    elif how == "short":
        with open(path, "r+b") as f:
            f.truncate(1000)
    elif how == "wrong size":
        with open(path, "ab") as f:
            f.write(b"\x00")
    return "data_batch_3.bin"


@pytest.mark.parametrize("how", ["missing", "empty", "short", "wrong size"])
def test_bad_cifar_files_are_rejected_naming_data_dir(
    cifar10: CifarFixture, tmp_path: Path, how: str
) -> None:
    broken = _break(cifar10.folder, how)
    with pytest.raises(ProblemError) as info:
        CIFAR10.prepare(cifar10.folder, str(tmp_path / "cache"))
    message = str(info.value)
    assert message.startswith("data_dir: ") and cifar10.folder in message and broken in message
    assert all(name in message for name in ("data_batch_1.bin", CIFAR10_TEST_FILE))
    if how != "missing":
        assert "3073-byte" in message


def test_cifar_needs_a_data_dir(tmp_path: Path) -> None:
    with pytest.raises(ProblemError, match=r"^data_dir: problem 'image_cifar100' needs a data_dir"):
        CIFAR100.prepare("", str(tmp_path))
    with pytest.raises(ProblemError, match=r"^data_dir: .*nowhere.* is missing train\.bin, test\.bin"):
        CIFAR100.prepare(str(tmp_path / "nowhere"), str(tmp_path))


# --- gs:// data ----------------------------------------------------------------------------------


def test_gcs_data_is_staged_once_into_the_cache(gcs_bucket: str, tmp_path: Path) -> None:
    written = write_cifar10(str(tmp_path / "upload"), records_per_file=4)
    data_dir = join(gcs_bucket, "datasets/cifar")
    storage.upload_dir(written.folder, join(data_dir, "cifar-10-batches-bin"))
    cache = str(tmp_path / "cache")

    folder = CIFAR10.prepare(data_dir, cache)

    assert folder.startswith(cache + os.sep)
    images, labels = _collect(CIFAR10.test_dataset(folder, batch_size=3))
    np.testing.assert_array_equal(labels, written.test_labels)
    np.testing.assert_array_equal(_to_uint8(CIFAR10, images), written.test_images)
    assert CIFAR10.num_test_examples(folder) == 4
    # A complete copy is reused: the bucket is no longer needed.
    storage.delete_prefix(data_dir)
    assert CIFAR10.prepare(data_dir, cache) == folder
    assert os.listdir(cache) == [os.path.basename(folder)]


@pytest.mark.parametrize("how", ["missing", "wrong size"])
def test_bad_gcs_data_is_rejected_naming_the_uri(gcs_bucket: str, tmp_path: Path, how: str) -> None:
    written = write_cifar10(str(tmp_path / "upload"), records_per_file=4)
    broken = _break(written.folder, how)
    data_dir = join(gcs_bucket, "c10")
    storage.upload_dir(written.folder, data_dir)
    cache = tmp_path / "cache"

    with pytest.raises(ProblemError) as info:
        CIFAR10.prepare(data_dir, str(cache))

    message = str(info.value)
    assert message.startswith("data_dir: ") and data_dir in message and broken in message
    assert not cache.exists() or not os.listdir(cache), "a rejected download must leave no cache entry"


# --- digits and synthetic --------------------------------------------------------------------------


def test_digits_are_scikit_learns_with_its_stratified_split() -> None:
    """The digits problem reads scikit-learn's data file and a fixed split without importing it; what
    it reads is what ``load_digits`` and ``train_test_split`` give (the split the problem always had)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., np.newaxis]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=0, stratify=labels
    )
    problem = get_problem("digits")
    for split, (x, y) in {"train": (x_train, y_train), "test": (x_test, y_test)}.items():
        ours = problem.arrays(split)
        assert ours[0].dtype == np.float32 and ours[1].dtype == np.int32
        np.testing.assert_array_equal(ours[0], x)
        np.testing.assert_array_equal(ours[1], y)


def test_digits_split_and_batches() -> None:
    digits = get_problem("digits")
    assert digits.prepare("", "") == ""
    assert digits.num_test_examples("") == 360
    assert len(digits.arrays("train")[1]) == 1437

    images, labels = next(iter(digits.train_dataset("", batch_size=32, shard_index=0, num_shards=2, seed=0)))
    assert images.shape == (32, 8, 8, 1) and images.dtype == tf.float32 and labels.dtype == tf.int32
    assert float(tf.reduce_min(images)) >= 0.0 and float(tf.reduce_max(images)) <= 1.0
    test_images, test_labels = _collect(digits.test_dataset("", batch_size=100))
    assert test_images.shape == (360, 8, 8, 1)
    assert sorted(set(test_labels.tolist())) == list(range(10))
    # The split is fixed: building it again gives the same test set.
    np.testing.assert_array_equal(digits.arrays("test")[1], test_labels)


def test_synthetic_shapes_shards_and_fixed_test_set() -> None:
    synthetic = get_problem("synthetic_cifar")
    assert synthetic.prepare("gs://ignored", "") == ""

    def first(shard: int) -> tuple[tf.Tensor, tf.Tensor]:
        dataset = synthetic.train_dataset("", batch_size=16, shard_index=shard, num_shards=2, seed=0)
        return next(iter(dataset))

    images, labels = first(0)
    assert images.shape == (16, 32, 32, 3) and images.dtype == tf.float32
    assert labels.dtype == tf.int32 and set(labels.numpy().tolist()) <= set(range(10))
    assert not np.array_equal(images.numpy(), first(1)[0].numpy())
    np.testing.assert_array_equal(images.numpy(), first(0)[0].numpy())

    test_images, test_labels = _collect(synthetic.test_dataset("", batch_size=100))
    assert test_images.shape == (512, 32, 32, 3) and synthetic.num_test_examples("") == 512
    np.testing.assert_array_equal(test_labels, _collect(synthetic.test_dataset("", batch_size=64))[1])
