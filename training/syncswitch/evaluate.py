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
    uri: str, hp: HParams, problem_name: str, data_dir: str, scratch_dir: str
) -> dict[str, float]:
    """{test_accuracy, test_loss, global_step} of the checkpoint at ``uri`` (a ckpt-<samples> folder)."""
    import tensorflow as tf

    from syncswitch.models import build_model
    from syncswitch.problems import get_problem

    problem = get_problem(problem_name)
    manifest = {"uri": uri, **checkpoints.read_manifest(uri)}
    model = build_model(hp, problem)
    prefix = checkpoints.fetch(manifest, scratch_dir)
    # Only the model is needed: expect_partial() skips the optimizer slots and counters.
    tf.train.Checkpoint(model=model).read(prefix).expect_partial()
    return {**evaluate_model(model, problem, data_dir), "global_step": float(manifest["global_step"])}


def evaluate_model(model: Any, problem: Any, data_dir: str) -> dict[str, float]:
    """{test_accuracy, test_loss} of a Keras model on ``problem``'s test set (inference mode)."""
    import keras
    import tensorflow as tf

    correct, total, loss_sum = 0, 0, 0.0
    for x, y in problem.test_dataset(data_dir, batch_size=EVAL_BATCH):
        logits = model(x, training=False)
        loss_sum += float(
            tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        )
        correct += int(
            tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.int32))
        )
        total += int(tf.shape(y)[0])
    return {"test_accuracy": correct / max(total, 1), "test_loss": loss_sum / max(total, 1)}


def evaluate_latest(run_dir: str, hp: HParams, problem_name: str, data_dir: str) -> dict[str, Any]:
    """Evaluate the newest complete checkpoint of a run folder (the pipeline's evaluate task)."""
    from syncswitch.problems import get_problem

    manifest = checkpoints.latest(RunLayout(run_dir))
    if manifest is None:
        raise FileNotFoundError(f"run_dir: no complete checkpoint under {run_dir}/checkpoints")
    scratch = tempfile.mkdtemp(prefix="syncswitch-eval-")
    try:
        local_data = get_problem(problem_name).prepare(data_dir, scratch)
        result = evaluate_checkpoint_uri(manifest["uri"], hp, problem_name, local_data, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**result, "checkpoint": manifest["uri"]}
