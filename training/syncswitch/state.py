"""The run state contract: ``state.json`` in the run folder, the pipeline's memory of one DAG run.

    {
      "run_id", "job_name", "run_dir", "status": "running" | "success" | "failed",
      "job":       JobSpec params (JobSpec.to_params()),
      "plan":      [{"index", "protocol", "until_step", "origin": "plan" | "online"}, ...],
      "segments":  {"<index>": SegmentResult dict (below)},
      "decisions": [{"time", "segment", "action", "reason", ...numbers behind it}, ...],
      "cluster":   {"backend", ...backend-specific handle},
      "timings":   {"created", "first_bsp_start", "finished"},
    }

A SegmentResult is what the chief writes to ``metrics/seg-ii-proto/result.json`` when a segment ends:
index, protocol, start_step, end_step, samples, updates, started_at, first_step_at, ended_at,
seconds, examples_per_sec, stopped_early, reason, checkpoint, test_accuracy, test_loss, startup.

Several tasks update state.json (segment tasks, the straggler sensor), so every update is a
read-modify-write guarded by a lock: an fcntl lock for local folders, a generation precondition for
GCS objects.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from syncswitch import storage
from syncswitch.layout import RunLayout

State = dict[str, Any]


def new_state(layout: RunLayout, run_id: str, job_params: dict[str, Any]) -> State:
    return {
        "run_id": run_id,
        "job_name": job_params["job_name"],
        "run_dir": layout.root,
        "status": "running",
        "job": job_params,
        "plan": [],
        "segments": {},
        "decisions": [],
        "cluster": {},
        "timings": {"created": time.time()},
    }


def read_state(layout: RunLayout) -> State | None:
    return storage.read_json(layout.state, default=None)


def update_state(layout: RunLayout, mutate: Callable[[State], None], attempts: int = 20) -> State:
    """Apply ``mutate`` to the current state and write it back atomically; returns the new state."""
    if storage.is_remote(layout.state):
        return _update_gcs(layout.state, mutate, attempts)
    return _update_local(layout.state, mutate)


def _update_local(path: str, mutate: Callable[[State], None]) -> State:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = storage.read_json(path, default={})
            mutate(state)
            storage.write_json(path, state)
            return state
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _update_gcs(uri: str, mutate: Callable[[State], None], attempts: int) -> State:
    from google.api_core.exceptions import PreconditionFailed

    for attempt in range(attempts):
        try:
            # A transient outage is retried inside (storage.retrying); a lost race comes out here.
            return storage.retrying(f"update {uri}", lambda: _update_gcs_once(uri, mutate))
        except PreconditionFailed:  # another writer won (between reload and download, or on upload)
            # Jitter so that writers that lost together do not retry in lockstep.
            time.sleep(random.uniform(0.01, 0.05 * (attempt + 1)))
    raise RuntimeError(f"state.json at {uri} changed under {attempts} concurrent updates")


def _update_gcs_once(uri: str, mutate: Callable[[State], None]) -> State:
    """One read-modify-write guarded by the object's generation (0 = must not exist yet)."""
    from google.api_core.exceptions import NotFound

    bucket, key = storage.split_gs(uri)
    # A fresh Blob per attempt: reload() stores the generation it saw, and a reused Blob would
    # pin the next attempt's reads to that stale generation (NotFound -> {} -> 412 forever).
    blob_ref = storage.gcs_client().bucket(bucket).blob(key)
    generation = 0
    state: State = {}
    with contextlib.suppress(NotFound):
        blob_ref.reload(retry=None)
        generation = blob_ref.generation
        state = json.loads(blob_ref.download_as_bytes(if_generation_match=generation, retry=None))
    mutate(state)
    blob_ref.upload_from_string(
        json.dumps(state, indent=2, sort_keys=True, default=str),
        content_type="application/json",
        if_generation_match=generation,
        retry=None,
    )
    return state


def record_decision(layout: RunLayout, decision: dict[str, Any]) -> State:
    decision = {"time": time.time(), **decision}
    return update_state(layout, lambda s: s.setdefault("decisions", []).append(decision))
