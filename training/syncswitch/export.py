"""The trained model, out of the run in forms users serve: a SavedModel and a ``.keras`` file.

    export_model(model, problem, data_dir, layout) -> {"saved_model": uri, "keras": uri, "seconds": s}

The SavedModel (``model.export``, endpoint ``serve``) loads with TensorFlow alone, without this
project or the user's code (``tf.saved_model.load(path).serve(features)``). The ``.keras`` file keeps
the Keras model; custom layers need their code (the usr_dir) to load it. The last segment's chief
exports what it checkpointed last; the pipeline's evaluate task exports when no segment did.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from syncswitch import storage
from syncswitch.layout import RunLayout


def input_signature(problem: Any, data_dir: str) -> list[Any]:
    """The model's input specs, batch dimension left open, from the problem's test dataset."""
    import tensorflow as tf

    features_spec = problem.test_dataset(data_dir, batch_size=1).element_spec[0]
    open_batch = lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype, name=s.name)  # noqa: E731
    return [tf.nest.map_structure(open_batch, features_spec)]


def export_model(model: Any, problem: Any, data_dir: str, layout: RunLayout) -> dict[str, Any]:
    """Write ``model`` to ``layout.export_saved_model`` and ``layout.export_keras``."""
    started = time.monotonic()
    local = tempfile.mkdtemp(prefix="syncswitch-export-")
    try:
        saved = os.path.join(local, "saved_model")
        try:
            model.export(saved, format="tf_saved_model", verbose=False)
        except Exception:  # noqa: BLE001 - e.g. a subclassed model: Keras cannot infer its inputs
            shutil.rmtree(saved, ignore_errors=True)
            signature = input_signature(problem, data_dir)
            model.export(saved, format="tf_saved_model", verbose=False, input_signature=signature)
        keras_file = os.path.join(local, "model.keras")
        model.save(keras_file)
        storage.upload_dir(saved, layout.export_saved_model)
        storage.upload_file(keras_file, layout.export_keras)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return {
        "saved_model": layout.export_saved_model,
        "keras": layout.export_keras,
        "seconds": round(time.monotonic() - started, 2),
    }
