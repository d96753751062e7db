"""Checkpoints in the run folder: written atomically, restored from the latest complete one.

A checkpoint is ``checkpoints/ckpt-<samples>/`` holding the files of
``tf.train.Checkpoint(model, optimizer, progress)`` plus ``manifest.json``, which is uploaded last.
Only folders with a manifest count, so a crash mid-upload never yields a half-written "latest".
The manifest carries the progress counters and the model signature, so a checkpoint of another model
is rejected with a clear message before any process is spawned.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from syncswitch import layout as paths
from syncswitch import storage
from syncswitch.layout import RunLayout

MANIFEST = "manifest.json"
CKPT_PREFIX = "ckpt"


class CheckpointMismatchError(ValueError):
    """The run folder's checkpoint belongs to a different model than the one requested."""


def latest(layout: RunLayout) -> dict[str, Any] | None:
    """Manifest of the newest complete checkpoint (with its ``uri``), or None."""
    for name in sorted(storage.list_dirs(layout.checkpoints), reverse=True):
        if RunLayout.checkpoint_samples(name) is None:
            continue
        uri = paths.join(layout.checkpoints, name)
        manifest = storage.read_json(paths.join(uri, MANIFEST), default=None)
        if manifest is not None:
            return {**manifest, "uri": uri}
    return None


# What a checkpoint whose signature lacks a key was written with: the key came later.
SIGNATURE_DEFAULTS = {"optimizer": "momentum"}


def signature(hp: Any, problem: Any) -> dict[str, Any]:
    """What a checkpoint must match to be restored: derived from the hparams and the problem alone,
    so the launcher can check it before spawning anything (and without importing TensorFlow). The
    optimizer is part of it: another optimizer keeps other slots."""
    return {"model": hp.model, **hp.shape_signature(), **problem.signature(), "optimizer": hp.optimizer}


def structure(variables: list[Any]) -> list[list[Any]]:
    """The variables a checkpoint holds, as ``[path, shape, dtype]``: compared at restore, so a user
    model whose builder changed is refused by name instead of by TensorFlow's restore error."""
    return [[v.path, [int(d) for d in v.shape], str(v.dtype)] for v in variables]


def check_structure(manifest: dict[str, Any], variables: list[Any]) -> None:
    """CheckpointMismatchError naming the first differing variables, when the manifest records them."""
    theirs = manifest.get("structure")
    if theirs is None:
        return
    ours = structure(variables)
    if theirs == ours:
        return
    theirs_set, ours_set = {tuple(map(str, v)) for v in theirs}, {tuple(map(str, v)) for v in ours}
    missing = sorted(theirs_set - ours_set)[:3]
    extra = sorted(ours_set - ours_set.intersection(theirs_set))[:3]
    detail = (
        "; ".join(
            part
            for part in (
                f"checkpoint has {', '.join(f'{p} {s} {d}' for p, s, d in missing)}" if missing else "",
                f"the model has {', '.join(f'{p} {s} {d}' for p, s, d in extra)}" if extra else "",
            )
            if part
        )
        or "the variables are in another order"
    )
    raise CheckpointMismatchError(
        f"run_dir: the latest checkpoint {manifest['uri']} holds other variables than model "
        f"{manifest.get('signature', {}).get('model')!r} builds now ({len(theirs)} vs {len(ours)} variables; "
        f"{detail}); use a new run_dir or the model the checkpoint was written with"
    )


def check_compatible(manifest: dict[str, Any] | None, signature: dict[str, Any]) -> None:
    if manifest is None:
        return
    theirs = {**SIGNATURE_DEFAULTS, **manifest.get("signature", {})}
    diffs = {k: (theirs.get(k), v) for k, v in signature.items() if theirs.get(k) != v}
    if diffs:
        detail = ", ".join(f"{k}: checkpoint has {a!r}, requested {b!r}" for k, (a, b) in diffs.items())
        raise CheckpointMismatchError(
            f"run_dir: the latest checkpoint {manifest['uri']} is from a different model ({detail}); "
            "use a new run_dir or the same model, hparam_set, problem and optimizer"
        )


def write(
    checkpoint: Any,
    layout: RunLayout,
    *,
    samples: int,
    global_step: float,
    updates: int,
    signature: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> tuple[str, float]:
    """Write ``checkpoint`` (a tf.train.Checkpoint of local variables) and return (uri, seconds)."""
    started = time.monotonic()
    uri = layout.checkpoint(samples)
    local = tempfile.mkdtemp(prefix="ckpt-")
    try:
        checkpoint.write(os.path.join(local, CKPT_PREFIX))
        files = storage.upload_dir(local, uri)
        manifest = {
            "samples": samples,
            "global_step": global_step,
            "updates": updates,
            "signature": signature,
            "files": files,
            "written_at": time.time(),
            **(extra or {}),
        }
        storage.write_json(paths.join(uri, MANIFEST), manifest)  # last: marks it complete
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return uri, time.monotonic() - started


def fetch(manifest: dict[str, Any], scratch_dir: str) -> str:
    """A local checkpoint prefix for ``tf.train.Checkpoint.read``; downloads gs:// checkpoints."""
    uri = manifest["uri"]
    if not storage.is_remote(uri):
        return os.path.join(uri, CKPT_PREFIX)
    local = tempfile.mkdtemp(prefix="restore-", dir=scratch_dir)
    for name in manifest["files"]:
        storage.download_file(paths.join(uri, name), os.path.join(local, name))
    return os.path.join(local, CKPT_PREFIX)


def prune(layout: RunLayout, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints (and any older incomplete ones)."""
    names = sorted(
        (n for n in storage.list_dirs(layout.checkpoints) if RunLayout.checkpoint_samples(n) is not None),
        reverse=True,
    )
    complete = [n for n in names if storage.exists(paths.join(layout.checkpoints, n, MANIFEST))]
    if len(complete) <= keep:
        return []
    oldest_kept = RunLayout.checkpoint_samples(complete[keep - 1])
    doomed = [n for n in names if RunLayout.checkpoint_samples(n) < oldest_kept]
    for name in doomed:
        storage.delete_prefix(paths.join(layout.checkpoints, name))
    return doomed


def read_manifest(uri: str) -> dict[str, Any]:
    manifest = storage.read_json(paths.join(uri, MANIFEST), default=None)
    if manifest is None:
        raise FileNotFoundError(f"checkpoint {uri} has no {MANIFEST}: incomplete or missing")
    return manifest
