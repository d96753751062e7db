"""The user-code check a run makes before anything is provisioned (``syncswitch check``).

On CPU, in one process: import the job's user code, resolve every segment's hparams, build the model
as the training loops do (the flat weight groups of syncswitch.params included), draw one training
batch of worker 0's shard, run one forward and backward pass with the problem's loss, and one test
batch through the evaluation metrics. Each failure is a UserCodeError naming the registered name,
the user's file and line, and the step that failed; the pipeline's validate task runs this in a
subprocess (its TensorFlow stays out of the Airflow worker) and fails the run with that line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any

from syncswitch import usercode
from syncswitch.errors import SpecError
from syncswitch.fields import add_job_flags, params_from_flags
from syncswitch.usercode import UserCodeError

CHECK_BATCH = 4  # a small batch: the check is about shapes and types, not speed
NO_AUTOGRAPH = (
    "The training step is traced without AutoGraph: branch on a tensor with keras.ops.cond or "
    "keras.ops.where, not a Python if or while"
)


@contextmanager
def _blame(what: str, doing: str, usr_dir: str, defined_by: Any = None):  # noqa: ANN202
    from syncswitch.problems import ProblemError

    try:
        yield
    except (UserCodeError, SpecError, ProblemError):
        raise  # they name their field already (a bad data_dir is not a fault of the code)
    except Exception as exc:  # noqa: BLE001 - any error of user code becomes one clear message
        raise usercode.user_error(what, doing, exc, usr_dir, defined_by) from exc


def check_job(job: Any, cache_dir: str) -> dict[str, Any]:
    """Check ``job`` (a syncswitch.spec.JobSpec); returns what was checked, with timings."""
    started = time.monotonic()
    usercode.load(job.usr_dir)
    from syncswitch.hparams import HParamsError, check_one_optimizer, get_hparams
    from syncswitch.registry import FIELDS, REGISTRY

    model_what, problem_what = f"model {job.model!r}", f"problem {job.problem!r}"
    for kind, name in (("model", job.model), ("problem", job.problem), ("hparams", job.hparam_set)):
        with _blame(f"{FIELDS[kind]} {name!r}", "loading it", job.usr_dir):
            REGISTRY.entry(kind, name).load()
    _check_hooks(job)
    try:
        base = get_hparams(job.hparam_set, job.model)
        hparams = [base.override(overrides) for overrides in job.hparams]
        check_one_optimizer(hparams)
    except HParamsError as err:
        field, _, message = str(err).partition(": ")
        raise SpecError(field, message) from None
    hp = hparams[0]
    from syncswitch.problems import get_problem

    problem = get_problem(job.problem)
    builder = REGISTRY.entry("model", job.model).load()
    with _blame(problem_what, "prepare(data_dir)", job.usr_dir, problem):
        local_data = problem.prepare(job.data_dir, cache_dir)
    with _blame(problem_what, "train_dataset (worker 0's shard)", job.usr_dir, problem):
        dataset = problem.train_dataset(
            local_data, batch_size=hp.batch_size, shard_index=0, num_shards=job.num_workers, seed=job.seed
        )
        features, labels = _first(dataset, job.problem, "train_dataset")
    with _blame(model_what, "building it", job.usr_dir, builder):
        from syncswitch.models import build_model, decayed_weights
        from syncswitch.params import FlatModel

        model = build_model(hp, problem)
        flat = FlatModel(model, groups=job.num_ps, hp=hp, decayed=decayed_weights(model))
    loss = _forward_backward(flat, model, problem, features, labels, builder, job)
    test_metrics = _evaluation_batch(model, problem, local_data, job)
    return {
        "usr_dir": job.usr_dir,
        "model": job.model,
        "problem": job.problem,
        "hparam_set": job.hparam_set,
        "parameters": int(sum(math.prod(w.shape) for w in model.trainable_weights)),
        "variables": len(model.weights),
        "loss": loss,
        "test_metrics": sorted(test_metrics),
        "seconds": round(time.monotonic() - started, 2),
    }


def _check_hooks(job: Any) -> None:
    """Each of the job's hooks is registered, made, and has a hook method."""
    from syncswitch.hooks import load_hooks

    for name in job.hooks:
        with _blame(f"hooks {name!r}", "making it", job.usr_dir):
            load_hooks((name,))


def _first(dataset: Any, problem: str, which: str) -> tuple[Any, Any]:
    """The first element of problem ``problem``'s dataset ``which``, a (features, labels) pair."""
    element = next(iter(dataset.take(1)), None)
    if element is None:
        raise UserCodeError("problem", f"{problem!r}: {which} yields nothing")
    if not isinstance(element, tuple) or len(element) != 2:
        raise UserCodeError(
            "problem",
            f"{problem!r}: {which} must yield (features, labels) pairs, got {type(element).__name__}",
        )
    return element


def _forward_backward(
    flat: Any, model: Any, problem: Any, features: Any, labels: Any, builder: Any, job: Any
) -> float:
    import tensorflow as tf

    from syncswitch.models import example_loss

    per_example = example_loss(problem, model)
    shapes: dict[str, Any] = {}

    def mean_loss(outputs: Any, y: Any) -> Any:
        values = per_example(outputs, y)
        shapes["loss"] = values.shape
        return tf.reduce_mean(values)

    # Traced as the segments trace their step (without AutoGraph): a model whose call needs Python
    # control flow on tensors fails here, before anything is provisioned, and not on the cluster.
    step = tf.function(lambda x, y: flat.loss_and_gradients(x, y, mean_loss), autograph=False)
    with _blame(f"model {job.model!r}", "a forward and backward pass on one batch", job.usr_dir, builder):
        try:
            loss, grads, _state = step(features, labels)
        except tf.errors.OperatorNotAllowedInGraphError as exc:
            # TensorFlow's own advice (add @tf.function, rely on AutoGraph) does not apply here: keep
            # its first sentence and say what does. Same traceback, so the user's line is named.
            sentence = str(exc).split(". ")[0]
            raise type(exc)(f"{sentence}. {NO_AUTOGRAPH}").with_traceback(exc.__traceback__) from None
    if shapes["loss"].rank != 1:
        raise UserCodeError(
            "problem",
            f"{job.problem!r}: loss(labels, outputs) must return one value per example, shape [batch]; "
            f"got shape {shapes['loss']}",
        )
    value = float(loss)
    if not math.isfinite(value) or not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads):
        raise UserCodeError(
            "model", f"{job.model!r}: the first batch gave a non-finite loss or gradient ({value})"
        )
    return value


def _evaluation_batch(model: Any, problem: Any, local_data: str, job: Any) -> dict[str, float]:
    import tensorflow as tf

    metrics = dict(getattr(model, "eval_metrics", None) or problem.metrics())
    if "accuracy" not in metrics:
        raise UserCodeError(
            "problem",
            f"{job.problem!r}: metrics() must include 'accuracy', the pipeline's quality measure "
            f"(higher is better); it has {', '.join(metrics) or 'none'}",
        )
    with _blame(f"problem {job.problem!r}", "test_dataset", job.usr_dir, problem):
        test_batches = problem.test_dataset(local_data, batch_size=CHECK_BATCH)
        features, labels = _first(test_batches, job.problem, "test_dataset")
    values = {}
    with _blame(f"problem {job.problem!r}", "the evaluation metrics on one test batch", job.usr_dir, problem):
        outputs = model(features, training=False)
        for name, metric in metrics.items():
            values[name] = float(tf.reduce_mean(tf.cast(metric(labels, outputs), tf.float64)))
    return values


def needs_check(job: Any) -> bool:
    """Whether a job uses code that is not the runtime's own: a usr_dir, hooks (none is built in) or
    an entry point's names."""
    if job.usr_dir or job.hooks:
        return True
    from syncswitch.registry import BUILTIN_SOURCE, REGISTRY

    names = (("model", job.model), ("problem", job.problem), ("hparams", job.hparam_set))
    return any(REGISTRY.entry(kind, name).source != BUILTIN_SOURCE for kind, name in names)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="syncswitch check",
        description="Check a job's model, problem and hparams (user code included) on one batch, on CPU. "
        "The job comes from --job, from the flags of `syncswitch run`, or both (the flags win).",
        allow_abbrev=False,
    )
    parser.add_argument("--job", default="", help="a JSON file of job params (the DAG's params)")
    add_job_flags(parser)
    args = parser.parse_args(argv)
    from syncswitch.spec import JobSpec

    try:
        params: dict[str, Any] = {}
        if args.job:
            try:
                with open(args.job, encoding="utf-8") as f:
                    params = json.load(f)
            except (OSError, ValueError) as exc:
                raise SpecError("--job", f"{args.job}: {exc}") from None
            if not isinstance(params, dict):
                raise SpecError("--job", f"{args.job} must hold one JSON object of job params")
        job = JobSpec.from_params({**params, **params_from_flags(args)})
        with tempfile.TemporaryDirectory(prefix="syncswitch-check-") as cache:
            summary = check_job(job, cache)
    except SpecError as err:  # UserCodeError included: one line naming the field, file and line
        print(f"syncswitch check: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0
