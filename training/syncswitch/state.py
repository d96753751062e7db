"""The run state contract: ``state.json`` in the run folder, the pipeline's memory of one DAG run.

    {
      "run_id", "job_name", "run_dir", "status": "running" | "success" | "failed",
      "job":       JobSpec params (JobSpec.to_params()),
      "plan":      [{"index", "protocol", "protocol_args" (where it has settings), "until_step",
                     "origin": "plan" | "online"}, ...],
      "segments":  {"<index>": SegmentResult dict (below)},
      "decisions": [{"time", "segment", "action", "reason", ...numbers behind it}, ...],
      "cluster":   {"backend", ...backend-specific handle},
      "vms":       {"<name>": VM record} of a gce cluster (syncswitch.costs.ledger reads them):
                   name, role, task, zone, machine_type, gpu_type, gpu_count, spot, state
                   (requested | running | revoked | deleted), requested_at, started_at, ended_at,
                   replaces (the revoked VM it stands in for)
      "cluster_events": [{"time", "kind": revoked | replaced | shrunk | replacement_failed, "vm", ...}],
      "cost":      the cost ledger (syncswitch.costs.ledger), written when the run ends
      "timing":    the timing policy's decision: {"bsp_fraction", "phase", "reason", "numbers"},
      "user_code": {"usr_dir", "digest", "packages", "uri"} of the job's user code (syncswitch.usercode)
      "final":     the final checkpoint's evaluation, and "export": the trained model's SavedModel and
                   .keras file (syncswitch.export),
      "timings":   {"created", "first_bsp_start", "finished"},
    }

A SegmentResult is what the chief writes to ``metrics/seg-ii-proto/result.json`` when a segment ends:
index, protocol, protocol_args, start_step, end_step, samples, updates, started_at, first_step_at,
ended_at, seconds, examples_per_sec, stopped_early, reason, checkpoint, test_accuracy, test_loss,
startup, bucket_retries (the chief process's retried bucket calls, syncswitch.storage.retry_count),
bytes_per_worker_step; SSP's ``staleness`` {bound, max_lead, steps_by_lead, cut_closures}, local
SGD's ``averaging`` {period, averages}.

Every change to state.json is one of the named operations below (record_cluster,
record_fork_servers, create_run, record_segment, straggler_reference_time, apply_switch,
record_decision, record_vm, record_cluster_event, record_final, finish_run), each a read-modify-write
through ``storage.update_json`` (an fcntl lock for local folders, a generation precondition for GCS
objects). Several writers act at once (segment triggers, the straggler sensor), and every operation
is idempotent, so a retried task or a restarted triggerer can repeat it safely. (On GCS an
update whose answer was lost in an outage is retried and meets a changed generation: it is then
re-read and re-applied, which the idempotence makes harmless.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.protocols import parse_token

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
    return storage.update_json(layout.state, mutate, attempts=attempts)


# ---- the named operations: the only writers of state.json -------------------------------------------


def record_cluster(layout: RunLayout, handle: dict[str, Any]) -> State:
    """The provisioned cluster's handle (``state["cluster"]``), written by the provisioning task
    before the run's state is created, and refreshed when it provisions again (a retry). Every later
    task reads it here: the segments launch on it and the teardown releases it."""
    return update_state(layout, lambda s: s.__setitem__("cluster", handle))


def record_fork_servers(layout: RunLayout, addresses: dict[str, str]) -> State:
    """New fork-server addresses (host name -> host:port) of the cluster's hosts, where a launch
    started a server again: later launches then find it where it listens. Names the handle does not
    hold (a replacement VM) are left out."""

    def move(state: State) -> None:
        for host in state.get("cluster", {}).get("hosts", []):
            if host.get("name") in addresses:
                host["forkserver"] = addresses[host["name"]]

    return update_state(layout, move)


def create_run(
    layout: RunLayout,
    run_id: str,
    job_params: dict[str, Any],
    plan: list[dict],
    timing: dict[str, Any] | None = None,
    user_code: dict[str, Any] | None = None,
) -> tuple[State, bool]:
    """The run's state with its offline plan and the timing policy's decision; (state, created). A
    retried or cleared run of the same run id keeps its state (the plan may already have changed
    online and segments may have ended): only the status is running again."""
    created: list[bool] = []

    def write(state: State) -> None:
        if state.get("run_id") == run_id and state.get("plan"):
            state["status"] = "running"
            return
        # The cluster and its VMs are recorded from provisioning on, before the run's state exists.
        kept = {k: state[k] for k in ("cluster", "vms", "cluster_events") if k in state}
        state.clear()
        state.update(new_state(layout, run_id, job_params), plan=plan, timing=timing or {})
        state["user_code"] = user_code or {}
        state.update(kept)
        created.append(True)

    return update_state(layout, write), bool(created)


def record_segment(layout: RunLayout, index: int, result: dict[str, Any]) -> State:
    """Store segment ``index``'s SegmentResult; an early stop (an online switch) moves the entry's
    target to where it stopped. Raises PlanError for an impossible end step."""
    return store_segment_result(layout, index, result)[0]


def store_segment_result(layout: RunLayout, index: int, result: dict[str, Any]) -> tuple[State, bool]:
    """``record_segment``, and whether this call changed the stored result (False where a restarted
    trigger or the task records it again): what happens once per segment end keys on it."""
    changed: list[bool] = []

    def store(state: State) -> None:
        segments = state.setdefault("segments", {})
        changed[:] = [segments.get(str(index)) != result]
        segments[str(index)] = result
        if result.get("stopped_early"):
            state["plan"] = plans.truncate(state["plan"], index, result["end_step"])

    return update_state(layout, store), bool(changed and changed[0])


def straggler_reference_time(layout: RunLayout, protocol: str, now: float) -> float | None:
    """Injected stragglers count from the first BSP segment's launch, across every segment: a BSP
    segment sets it (once); an ASP segment before any BSP one has none (it counts from its own)."""
    if protocol == "bsp":
        state = update_state(layout, lambda s: s.setdefault("timings", {}).setdefault("first_bsp_start", now))
    else:
        state = read_state(layout) or {}
    return state.get("timings", {}).get("first_bsp_start")


def record_decision(layout: RunLayout, decision: dict[str, Any]) -> State:
    decision = {"time": time.time(), **decision}
    return update_state(layout, lambda s: s.setdefault("decisions", []).append(decision))


def segment_recorded(state: State, index: int) -> bool:
    """Whether segment ``index``'s result is in the run's state (record_segment)."""
    return str(index) in state.get("segments", {})


def apply_switch(layout: RunLayout, item: dict[str, Any], record: dict[str, Any]) -> State:
    """Record an online switch decision and rewrite the plan in one update: the entry after ``item``
    runs the decision's protocol (``record["to"]``, a switch order's spelling; without one, ASP
    after BSP and BSP after anything else) to the same target. Repeating it does not insert the
    switch twice.

    Once the segment's result is recorded the plan stands (the next entry may be launched already)
    and nothing changes: the returned state then holds ``segments[index]``."""
    index = item["index"]
    target = record.get("to") or ("asp" if item["protocol"] == "bsp" else "bsp")
    new_protocol = parse_token(target, "the switch's protocol")
    new_fields = plans.entry_fields(new_protocol)

    def mutate(state: State) -> None:
        if segment_recorded(state, index):
            return
        current = state.get("plan", [])
        following = plans.entry(current, index + 1)
        already = (
            following is not None
            and following.get("origin") == "online"
            and following.get("protocol") == new_fields["protocol"]
            and following.get("protocol_args") == new_fields.get("protocol_args")
            and following.get("until_step") == item["until_step"]
        )
        if not already:
            state["plan"] = plans.insert_switch(current, index, new_protocol)
        state.setdefault("decisions", []).append({"time": time.time(), **record, "plan_changed": not already})

    return update_state(layout, mutate)


def record_vm(layout: RunLayout, name: str, **fields: Any) -> State:
    """Create or update one VM's record (``state["vms"][name]``); fields already set and not given
    are kept, so a repeated call (a retried task) changes nothing."""

    def upsert(state: State) -> None:
        state.setdefault("vms", {}).setdefault(name, {"name": name}).update(fields)

    return update_state(layout, upsert)


def record_cluster_event(layout: RunLayout, kind: str, vm: str, **details: Any) -> State:
    """A revocation, replacement or shrink; one event per (kind, vm), however often it is seen."""

    def add(state: State) -> None:
        events = state.setdefault("cluster_events", [])
        if not any(e.get("kind") == kind and e.get("vm") == vm for e in events):
            events.append({"time": time.time(), "kind": kind, "vm": vm, **details})

    return update_state(layout, add)


def record_final(layout: RunLayout, final: dict[str, Any]) -> State:
    """The evaluation of the run's final checkpoint."""
    return update_state(layout, lambda s: s.__setitem__("final", final))


def finish_run(layout: RunLayout, status: str | None, extra: dict[str, Any] | None = None) -> State:
    """The run's outcome (``success`` / ``failed``; None keeps the current one), its end time, and
    whatever else closes its books (``extra`` is merged into the state)."""

    def mark(state: State) -> None:
        if status:
            state["status"] = status
        state.setdefault("timings", {})["finished"] = time.time()
        state.update(extra or {})

    return update_state(layout, mark)
