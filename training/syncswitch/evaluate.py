"""Test accuracy of a checkpoint, on a plain (non-distributed) copy of the model.

Used by the chief at the end of a segment and by the pipeline's evaluate task; the model is rebuilt
outside any strategy, so the same code evaluates checkpoints written under BSP or ASP.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from syncswitch import checkpoints
from syncswitch.hparams import HParams
from syncswitch.layout import RunLayout

EVAL_BATCH = 256


def evaluate_checkpoint_uri(
    uri: str,
    hp: HParams,
    problem_name: str,
    data_dir: str,
    scratch_dir: str,
    *,
    export_to: RunLayout | None = None,
    export_from_step: float = 0.0,
) -> dict[str, Any]:
    """{test_accuracy, test_loss, global_step} of the checkpoint at ``uri`` (a ckpt-<samples> folder).
    With ``export_to``, a checkpoint at or past ``export_from_step`` (the job's last) is exported
    there too (syncswitch.export): ``export`` names it, or ``export_error`` says why not."""
    import tensorflow as tf

    from syncswitch.models import build_model
    from syncswitch.problems import get_problem

    problem = get_problem(problem_name)
    manifest = {"uri": uri, **checkpoints.read_manifest(uri)}
    model = build_model(hp, problem)
    prefix = checkpoints.fetch(manifest, scratch_dir)
    # Only the model is needed: expect_partial() skips the optimizer slots and counters.
    tf.train.Checkpoint(model=model).read(prefix).expect_partial()
    result = {**evaluate_model(model, problem, data_dir), "global_step": float(manifest["global_step"])}
    if export_to is not None and result["global_step"] >= export_from_step - 1e-6:
        result.update(export_evaluated(model, problem, data_dir, export_to))
    return result


def export_evaluated(model: Any, problem: Any, data_dir: str, layout: RunLayout) -> dict[str, Any]:
    """Export the model; a failed export is reported, it does not fail the trained run."""
    from syncswitch.export import export_model

    try:
        return {"export": export_model(model, problem, data_dir, layout)}
    except Exception as exc:  # noqa: BLE001 - training and evaluation succeeded; say what failed
        print(f"export of the trained model to {layout.export} failed: {exc!r}", flush=True)
        return {"export_error": f"{type(exc).__name__}: {exc}"}


def evaluate_model(model: Any, problem: Any, data_dir: str) -> dict[str, float]:
    """{test_loss, test_<metric> for each of the problem's (or the model's) metrics} of a Keras model
    on ``problem``'s test set, in inference mode. ``test_accuracy`` is always among them."""
    import tensorflow as tf

    from syncswitch.models import example_loss

    loss_of = example_loss(problem, model)
    metrics = dict(getattr(model, "eval_metrics", None) or problem.metrics())
    if "accuracy" not in metrics:
        raise ValueError(
            f"problem {problem.name!r}: metrics() must include 'accuracy', the pipeline's quality "
            f"measure (higher is better); it has {', '.join(metrics) or 'none'}"
        )
    sums = dict.fromkeys(["loss", *metrics], 0.0)
    total = 0
    for x, y in problem.test_dataset(data_dir, batch_size=EVAL_BATCH):
        outputs = model(x, training=False)
        sums["loss"] += float(tf.reduce_sum(loss_of(outputs, y)))
        for name, metric in metrics.items():
            sums[name] += float(tf.reduce_sum(tf.cast(metric(y, outputs), tf.float64)))
        total += int(tf.shape(tf.nest.flatten(y)[0])[0])
    return {f"test_{name}": value / max(total, 1) for name, value in sums.items()}


def evaluate_latest(
    run_dir: str, hp: HParams, problem_name: str, data_dir: str, *, export: bool = False
) -> dict[str, Any]:
    """Evaluate the newest complete checkpoint of a run folder (the pipeline's evaluate task), and
    with ``export`` export it (syncswitch.export)."""
    from syncswitch.problems import get_problem

    manifest = checkpoints.latest(RunLayout(run_dir))
    if manifest is None:
        raise FileNotFoundError(f"run_dir: no complete checkpoint under {run_dir}/checkpoints")
    scratch = tempfile.mkdtemp(prefix="syncswitch-eval-")
    try:
        local_data = get_problem(problem_name).prepare(data_dir, scratch)
        export_to = RunLayout(run_dir) if export else None
        uri = manifest["uri"]
        result = evaluate_checkpoint_uri(uri, hp, problem_name, local_data, scratch, export_to=export_to)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**result, "checkpoint": manifest["uri"]}
