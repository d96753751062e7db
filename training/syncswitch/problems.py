"""The problems (data sets) of the training runtime, named as in tensor2tensor.

    get_problem("image_cifar10")                  -> Problem (built-in, an entry point or a usr_dir's)
    problem.prepare(data_dir, cache_dir)          -> local folder ready to read ("" if none is needed)
    problem.train_dataset(folder, batch_size=..., shard_index=..., num_shards=..., seed=...)
    training_pipeline(examples, shuffle_buffer=..., **stream)
                                                  -> what every train_dataset makes of its examples
    problem.test_dataset(folder, batch_size=...)
    problem.loss(labels, outputs)                 -> per-example loss (default: cross-entropy of logits)
    problem.metrics()                             -> {name: fn(labels, outputs) -> per-example values}

The contract (``Problem`` below; docs/bring-your-own-model.md): datasets yield ``(features, labels)``,
each any nest of tensors (a dict of features, a tuple, one tensor), batched. Training datasets repeat
forever, are shuffled and read a disjoint share of the records per shard (shard = worker index, which
may be a tensor inside a ParameterServerStrategy ``dataset_fn``). Those ``dataset_fn``s may not create
variables, so augmentation uses stateless random ops seeded from ``(seed, shard, element index)``: the
same seed gives the same stream. The built-in image problems yield ``(image float32 [B, H, W, C],
label int32 [B])``.

TensorFlow is imported inside functions so that this module (and the names) can be used cheaply, e.g.
to validate a job spec on the Airflow side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from syncswitch import storage

if TYPE_CHECKING:
    import tensorflow as tf

log = logging.getLogger(__name__)

CIFAR_IMAGE_BYTES = 3 * 32 * 32
# Pad-4 + random-crop-32, the He et al. 2016 CIFAR augmentation.
CIFAR_PAD = 4
# scikit-learn's bundled digits (what load_digits() reads), and their fixed 80/20 split: the rows of
# each part in order, as train_test_split(test_size=0.2, random_state=0, stratify=labels) makes them
# (tests/test_problems.py checks both against scikit-learn). Read without importing scikit-learn, so
# that it and SciPy under it stay out of every fork server's preload, on every host of every cluster.
DIGITS_FILE = "datasets/data/digits.csv.gz"
DIGITS_SPLIT = Path(__file__).with_name("digits_split.json")
SYNTHETIC_TEST_EXAMPLES = 512
# First component of the stateless seeds of the synthetic test set; training seeds are >= 0.
_SYNTHETIC_TEST_KEY = -1
_SHUFFLE_BUFFER = 10_000


class ProblemError(ValueError):
    """Bad problem name or data. The message names the field (``problem`` or ``data_dir``) and says
    what is accepted or expected."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


# --- the interface ------------------------------------------------------------------------------


class Problem:
    """One data set: how to stage and read it, its loss and its evaluation metrics.

    Subclass it (user problems too) and register the subclass under a name
    (``@syncswitch.register_problem("name")``). Only ``train_dataset`` and ``test_dataset`` are
    required; the rest has defaults for classification with integer labels and logits outputs.
    """

    name: str  # the registered name (set by syncswitch.registry)

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        """Return a local folder with the data ready to read, downloading ``gs://`` data into
        ``cache_dir``; "" when the data needs no folder (generated, bundled). Raises ProblemError
        when files are missing or malformed."""
        return ""

    def prepare_shard(self, data_dir: str, cache_dir: str, shard_index: int, num_shards: int) -> str:
        """What a worker on a host of its own stages: by default everything (``prepare``); a problem
        of many files stages only the files of shard ``shard_index`` (syncswitch.tfrecords)."""
        return self.prepare(data_dir, cache_dir)

    def train_dataset(
        self, local_dir: str, *, batch_size: int, shard_index: Any, num_shards: int, seed: int
    ) -> tf.data.Dataset:
        """Batches of ``(features, labels)`` of ``batch_size``, forever, shard ``shard_index`` of
        ``num_shards`` (a tensor under ParameterServerStrategy), shuffled with ``seed``."""
        raise NotImplementedError

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        """The whole evaluation set once, in batches of ``(features, labels)``."""
        raise NotImplementedError

    def loss(self, labels: Any, outputs: Any) -> Any:
        """Per-example loss ``[B]`` of the model's ``outputs``; weight decay is added by the optimizer."""
        import keras

        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def metrics(self) -> dict[str, Any]:
        """Evaluation metrics, ``name -> fn(labels, outputs) -> per-example values`` averaged over
        the test set (reported as ``test_<name>``). ``accuracy`` is the pipeline's quality measure
        (timing policy, reports, history): higher is better."""
        return {"accuracy": classification_accuracy}

    def signature(self) -> dict[str, Any]:
        """What a checkpoint of this problem must match to be restored into a run of it."""
        return {"problem": getattr(self, "name", type(self).__name__)}


def classification_accuracy(labels: Any, outputs: Any) -> Any:
    """1.0 where the largest output is the label, else 0.0."""
    import tensorflow as tf

    predicted = tf.argmax(outputs, -1, output_type=tf.int64)
    return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int64)), tf.float32)


class ImageClassification(Problem):
    """Built-in image problems: ``image_shape`` and ``num_classes`` shape the built-in models."""

    image_shape: tuple[int, int, int]
    num_classes: int

    def signature(self) -> dict[str, Any]:
        return {"input_shape": list(self.image_shape), "num_classes": self.num_classes}

    def num_test_examples(self, local_dir: str) -> int:
        raise NotImplementedError


def _uri_digest(uri: str) -> str:
    return hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:12]


def stage_folder(
    uri: str | Callable[[], str], cache_dir: str, name: str, check: Any = None, files: list[str] | None = None
) -> str:
    """Download the ``gs://`` folder ``uri`` (or only ``files`` of it, relative names) once into
    ``cache_dir/name``; a complete copy is reused without looking at the bucket (``uri`` may be a
    function that finds the folder, called only when there is no copy). ``check(folder)`` validates
    the copy before it is kept (ProblemError). The copy is made in a temp folder and renamed into
    place, so a folder under its final name is always complete, also when several processes on one
    host stage the same data at once."""
    target = os.path.join(cache_dir, name)
    if os.path.isdir(target):
        log.info("reusing the staged copy in %s", target)
        return target
    uri = uri() if callable(uri) else uri
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_dir, prefix=".staging-")
    try:
        if files is None:
            names = storage.download_dir(uri, staging)
        else:
            names = files
            for relative in files:
                storage.download_file(f"{uri.rstrip('/')}/{relative}", os.path.join(staging, relative))
        if check is not None:
            check(staging)
        os.rename(staging, target)
        log.info("staged %d files of %s into %s", len(names), uri, target)
    except OSError:
        if not os.path.isdir(target):
            raise
        # Another process staged the same data first; its copy is as good as ours.
        log.info("%s was staged concurrently into %s", uri, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _check_batching(batch_size: int, num_shards: int, seed: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


class TrainStream(TypedDict):
    """``train_dataset``'s keyword arguments, which ``training_pipeline`` takes too: batches of
    ``batch_size``, shard ``shard_index`` of ``num_shards`` (a tensor under ParameterServerStrategy),
    shuffled with ``seed``."""

    batch_size: int
    shard_index: Any
    num_shards: int
    seed: int


def training_pipeline(
    examples: tf.data.Dataset,
    *,
    batch_size: int,
    shard_index: Any,
    num_shards: int,
    seed: int,
    shuffle_buffer: int,
    sharded: bool = False,
    per_example: Callable[[Any, tf.Tensor], Any] | None = None,
) -> tf.data.Dataset:
    """The training stream of ``examples``, as every problem's ``train_dataset`` returns it: shard
    ``shard_index`` of ``num_shards`` (unless ``sharded``: ``examples`` are this shard's already),
    shuffled through ``shuffle_buffer`` examples with ``seed``, repeated forever, each example passed
    through ``per_example(example, example_seed)`` where given (decoding and augmentation, after the
    shuffle; ``example_seed`` is ``stateless_seed`` of its shard and position), in whole batches of
    ``batch_size``, prefetched. The four stream arguments are ``train_dataset``'s (a TrainStream):
    pass them on as ``**stream``. ValueError for a batch size, shard count or seed out of range."""
    import tensorflow as tf

    _check_batching(batch_size, num_shards, seed)
    if not sharded:
        examples = examples.shard(num_shards, shard_index)
    examples = examples.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True).repeat()
    if per_example is not None:

        def seeded(index: tf.Tensor, example: Any) -> Any:
            return per_example(example, stateless_seed(seed, shard_index, index))

        examples = examples.enumerate().map(seeded, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return examples.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def stateless_seed(seed: int, shard_index: Any, index: Any) -> tf.Tensor:
    """A [2] int64 seed unique to (seed, shard, element): shards never share augmentation streams."""
    import tensorflow as tf

    shard = tf.cast(shard_index, tf.int64)
    return tf.stack([tf.constant(seed, tf.int64) * 65_536 + shard, tf.cast(index, tf.int64)])


# --- digits: scikit-learn's bundled 8x8 digits ----------------------------------------------------


@dataclass(frozen=True)
class DigitsProblem(ImageClassification):
    """scikit-learn's 1797 8x8 digits, scaled to [0, 1], with a fixed stratified 80/20 split."""

    name: str = "digits"
    image_shape: tuple[int, int, int] = (8, 8, 1)
    num_classes: int = 10

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        # Bundled with scikit-learn: nothing to stage, whatever data_dir says.
        return ""

    def arrays(self, split: str) -> tuple[Any, Any]:
        """``(images float32 [N, 8, 8, 1], labels int32 [N])`` of ``train`` or ``test``: scikit-learn's
        ``load_digits()`` split by ``train_test_split(test_size=0.2, random_state=0, stratify=labels)``,
        read without importing scikit-learn (see DIGITS_FILE)."""
        import numpy as np

        spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
        if spec is None or spec.origin is None:
            raise RuntimeError("the digits problem reads scikit-learn's bundled digits: install scikit-learn")
        data = np.loadtxt(Path(spec.origin).parent / DIGITS_FILE, delimiter=",")
        images = (data[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., np.newaxis]
        labels = data[:, -1].astype(np.int32)
        rows = json.loads(DIGITS_SPLIT.read_text())[split]
        return images[rows], labels[rows]

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> tf.data.Dataset:
        import tensorflow as tf

        # Under ParameterServerStrategy this runs inside a traced dataset_fn: without the wrapper
        # AutoGraph tries to convert the numpy loader, needless work at every segment start.
        images, labels = tf.autograph.experimental.do_not_convert(self.arrays)("train")
        examples = tf.data.Dataset.from_tensor_slices((images, labels))
        return training_pipeline(examples, shuffle_buffer=len(labels), **stream)

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        import tensorflow as tf

        images, labels = self.arrays("test")
        return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch_size)

    def num_test_examples(self, local_dir: str) -> int:
        return len(self.arrays("test")[1])


# --- CIFAR-10 / CIFAR-100 in the original binary format ---------------------------------------------


@dataclass(frozen=True)
class CifarProblem(ImageClassification):
    """CIFAR in the binary format: records of ``label_bytes`` label bytes + 3072 channel-major pixels.

    ``data_dir`` is the folder holding the files, or its parent holding ``subdir``.
    """

    name: str
    num_classes: int
    subdir: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_bytes: int
    label_offset: int  # which label byte is the class (CIFAR-100: 0 coarse, 1 fine)
    mean: tuple[float, float, float]  # per channel, of pixels scaled to [0, 1]
    std: tuple[float, float, float]
    image_shape: tuple[int, int, int] = (32, 32, 3)

    @property
    def record_bytes(self) -> int:
        return self.label_bytes + CIFAR_IMAGE_BYTES

    @property
    def expected_files(self) -> tuple[str, ...]:
        return self.train_files + self.test_files

    # ---- staging and validation ------------------------------------------------------------

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        if not data_dir:
            raise ProblemError(
                "data_dir",
                f"problem {self.name!r} needs a data_dir (local folder or gs:// URI) holding "
                f"{self._files_text()}",
            )
        if storage.is_remote(data_dir):
            return self._stage_remote(data_dir, cache_dir)
        folder = self._locate(data_dir, data_dir)
        self._validate(folder, data_dir)
        return folder

    def _files_text(self) -> str:
        return f"{', '.join(self.expected_files)} (directly or in {self.subdir}/)"

    def _locate(self, data_dir: str, shown_as: str) -> str:
        """The folder that holds the files: ``data_dir`` itself or its ``subdir``."""
        candidates = (data_dir, os.path.join(data_dir, self.subdir))
        for folder in candidates:
            if all(os.path.isfile(os.path.join(folder, f)) for f in self.expected_files):
                return folder
        best = max(
            candidates, key=lambda d: sum(os.path.isfile(os.path.join(d, f)) for f in self.expected_files)
        )
        missing = [f for f in self.expected_files if not os.path.isfile(os.path.join(best, f))]
        raise ProblemError(
            "data_dir",
            f"{shown_as!r} is missing {', '.join(missing)} for problem {self.name!r}; "
            f"expected {self._files_text()}",
        )

    def _validate(self, folder: str, shown_as: str) -> None:
        """Every file must hold a whole, non-zero number of records."""
        for name in self.expected_files:
            size = os.path.getsize(os.path.join(folder, name))
            if size == 0 or size % self.record_bytes:
                raise ProblemError(
                    "data_dir",
                    f"{shown_as!r}: {name} has {size} bytes, not a positive multiple of the "
                    f"{self.record_bytes}-byte {self.name} record; expected {self._files_text()}",
                )

    def _stage_remote(self, data_dir: str, cache_dir: str) -> str:
        def check(staged: str) -> None:
            self._validate(self._locate(staged, data_dir), data_dir)

        name = f"{self.name}-{_uri_digest(data_dir)}"
        return stage_folder(lambda: self._locate_remote(data_dir), cache_dir, name, check)

    def _locate_remote(self, data_dir: str) -> str:
        base = data_dir.rstrip("/")
        present = set(storage.list_files(base))
        for folder in (base, f"{base}/{self.subdir}"):
            if all(f"{folder}/{f}" in present for f in self.expected_files):
                return folder
        missing = [f for f in self.expected_files if f"{base}/{f}" not in present]
        missing_sub = [f for f in self.expected_files if f"{base}/{self.subdir}/{f}" not in present]
        shortest = min(missing, missing_sub, key=len)
        raise ProblemError(
            "data_dir",
            f"{data_dir!r} is missing {', '.join(shortest)} for problem {self.name!r}; "
            f"expected {self._files_text()}",
        )

    def _paths(self, local_dir: str, names: tuple[str, ...]) -> list[str]:
        folder = self._locate(local_dir, local_dir)
        return [os.path.join(folder, name) for name in names]

    # ---- reading ---------------------------------------------------------------------------

    def _records(self, local_dir: str, names: tuple[str, ...]) -> tf.data.Dataset:
        import tensorflow as tf

        # Workers read the files themselves: nothing but the file names goes into the graph.
        return tf.data.FixedLengthRecordDataset(self._paths(local_dir, names), self.record_bytes)

    def decode(self, record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """One record -> (normalised float32 [32, 32, 3] image, int32 label)."""
        import tensorflow as tf

        raw = tf.io.decode_raw(record, tf.uint8)
        label = tf.cast(raw[self.label_offset], tf.int32)
        chw = tf.reshape(raw[self.label_bytes :], (3, 32, 32))
        image = tf.cast(tf.transpose(chw, (1, 2, 0)), tf.float32) / 255.0
        image = (image - tf.constant(self.mean)) / tf.constant(self.std)
        return image, label

    def augment(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """Zero-pad by 4 (zero is the mean after normalisation), random-crop 32x32, random flip."""
        import tensorflow as tf

        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
        padded = tf.pad(image, ((CIFAR_PAD, CIFAR_PAD), (CIFAR_PAD, CIFAR_PAD), (0, 0)))
        cropped = tf.image.stateless_random_crop(padded, self.image_shape, seed=crop_seed)
        return tf.image.stateless_random_flip_left_right(cropped, seed=flip_seed)

    def train_dataset(self, local_dir: str, **stream: Unpack[TrainStream]) -> tf.data.Dataset:
        def decode_and_augment(record: tf.Tensor, example_seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            image, label = self.decode(record)
            return self.augment(image, example_seed), label

        # Shard by record (not by file) so any worker count gets an even, disjoint share.
        records = self._records(local_dir, self.train_files)
        return training_pipeline(
            records, shuffle_buffer=_SHUFFLE_BUFFER, per_example=decode_and_augment, **stream
        )

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        import tensorflow as tf

        return (
            self._records(local_dir, self.test_files)
            .map(self.decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(batch_size)
            .prefetch(tf.data.AUTOTUNE)
        )

    def num_test_examples(self, local_dir: str) -> int:
        return sum(os.path.getsize(p) // self.record_bytes for p in self._paths(local_dir, self.test_files))


# --- synthetic CIFAR-shaped data for throughput benchmarks ------------------------------------------


@dataclass(frozen=True)
class SyntheticCifarProblem(ImageClassification):
    """Random 32x32x3 images generated in-graph from stateless random ops (no data, no constants).

    Each class adds its own colour to Gaussian noise, so the data is learnable and the loss falls,
    which makes a benchmark run also a sanity check.
    """

    name: str = "synthetic_cifar"
    image_shape: tuple[int, int, int] = (32, 32, 3)
    num_classes: int = 10

    def prepare(self, data_dir: str, cache_dir: str) -> str:
        return ""

    def _examples(self, count: int, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        import tensorflow as tf

        label_seed, noise_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
        labels = tf.random.stateless_uniform(
            (count,), label_seed, minval=0, maxval=self.num_classes, dtype=tf.int32
        )
        colours = tf.random.stateless_normal((self.num_classes, 3), seed=(7, 7))
        noise = tf.random.stateless_normal((count, *self.image_shape), noise_seed)
        images = noise + tf.gather(colours, labels)[:, tf.newaxis, tf.newaxis, :]
        return images, labels

    def train_dataset(
        self, local_dir: str, *, batch_size: int, shard_index: Any, num_shards: int, seed: int
    ) -> tf.data.Dataset:
        import tensorflow as tf

        _check_batching(batch_size, num_shards, seed)

        def make_batch(index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            # Shard s takes batch numbers s, s + num_shards, ...: disjoint seeds per shard.
            batch_number = index * num_shards + tf.cast(shard_index, tf.int64)
            return self._examples(batch_size, stateless_seed(seed, 0, batch_number))

        return tf.data.Dataset.counter().map(make_batch).prefetch(tf.data.AUTOTUNE)

    def test_dataset(self, local_dir: str, *, batch_size: int) -> tf.data.Dataset:
        import tensorflow as tf

        def make_example(index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            images, labels = self._examples(1, tf.stack([tf.constant(_SYNTHETIC_TEST_KEY, tf.int64), index]))
            return images[0], labels[0]

        # Generated example by example in-graph, so a dataset_fn carries no 6 MB constant.
        return tf.data.Dataset.range(SYNTHETIC_TEST_EXAMPLES).map(make_example).batch(batch_size)

    def num_test_examples(self, local_dir: str) -> int:
        return SYNTHETIC_TEST_EXAMPLES


# --- the registry: syncswitch.registry names these (BUILTIN_ENTRIES) ---------------------------------


def cifar10() -> CifarProblem:
    return CifarProblem(
        name="image_cifar10",
        num_classes=10,
        subdir="cifar-10-batches-bin",
        train_files=tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
        test_files=("test_batch.bin",),
        label_bytes=1,
        label_offset=0,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    )


def cifar100() -> CifarProblem:
    return CifarProblem(
        name="image_cifar100",
        num_classes=100,
        subdir="cifar-100-binary",
        train_files=("train.bin",),
        test_files=("test.bin",),
        label_bytes=2,
        label_offset=1,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
    )


def problem_names() -> list[str]:
    from syncswitch.registry import REGISTRY

    return REGISTRY.names("problem")


def get_problem(name: str) -> Problem:
    """The problem called ``name``; ProblemError naming the accepted names otherwise."""
    from syncswitch.registry import REGISTRY, UnknownNameError

    try:
        problem = REGISTRY.get("problem", name)
    except UnknownNameError as err:
        raise ProblemError("problem", str(err).split(": ", 1)[1]) from None
    if not isinstance(problem, Problem):
        raise ProblemError(
            "problem",
            f"{name!r} ({REGISTRY.entry('problem', name).source}) is {type(problem).__name__}, "
            "not a syncswitch.problems.Problem",
        )
    return problem
