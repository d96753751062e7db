"""Helpers for tests that drive DAG runs on the session's real embedded Airflow (real scheduler), and
triggers on their own (first_event)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow.triggers.base import BaseTrigger, TaskSuccessEvent
from proc_utils import environ, wait_for
from syncswitch import checkpoints, storage
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch.state import read_state
from syncswitch_airflow.backends.base import CLUSTER_ENV, ClusterBackend, SegmentStatus
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.airflow_api import AirflowApi, AirflowError

DAG_ID = "sync_switch"


def trigger(airflow: EmbeddedAirflow, conf: dict[str, Any], dag_id: str = DAG_ID) -> tuple[str, RunLayout]:
    """Trigger a run; returns its run id and run folder."""
    run_id = airflow.api.trigger(dag_id, conf)
    return run_id, RunLayout.for_run(conf["bucket_dir"], conf["job_name"], run_id)


def latest_step(layout: RunLayout, index: int, protocol: str) -> float:
    steps = read_events(layout.segment_metrics(index, protocol), event="step")
    return steps[-1]["global_step"] if steps else 0.0


def wait_until_segment_ended(
    backend: ClusterBackend, handle: dict[str, Any], index: int, timeout: float = 300
) -> None:
    """Until segment ``index``'s launcher has exited on the cluster ``handle`` of ``backend``. An
    ``unknown`` status (its folder not readable on the chief just then) is not an end: the segment
    trigger does not take it for one either."""
    seen: list[SegmentStatus] = []

    def ended() -> bool:
        seen[:] = [backend.segment_status(handle, index)]
        return seen[0].state == "exited"

    wait_for(ended, timeout=timeout, what=lambda: f"the end of segment {index} (last status {seen})", poll=2)


def checkpoint_step(layout: RunLayout) -> float:
    """The global step of the run's newest complete checkpoint (0 before the first).

    Tests that kill a node mid-segment wait on this rather than on step events: a checkpoint is in the
    bucket the moment it is complete, step events only at their writer's next upload (seconds later,
    while a digits segment runs dozens of steps a second). The kill then lands just past the
    checkpoint, far from the segment's end, on a fast machine as on a slow one."""
    latest = checkpoints.latest(layout)
    return float(latest["global_step"]) if latest else 0.0


def wait_for_step(layout: RunLayout, index: int, protocol: str, step: float, timeout: float = 300) -> None:
    wait_for(
        lambda: latest_step(layout, index, protocol) >= step,
        timeout=timeout,
        what=f"segment {index} ({protocol}) at step {step}",
        poll=0.5,
    )


def wait_for_task(
    airflow: EmbeddedAirflow, run_id: str, task_id: str, states: tuple[str, ...], timeout: float = 300
) -> str:
    seen: dict[str, str | None] = {}

    def reached() -> bool:
        seen.update(airflow.api.task_states(DAG_ID, run_id))
        return seen.get(task_id) in states

    wait_for(
        reached, timeout=timeout, what=lambda: f"{task_id} in {states} (now {seen.get(task_id)})", poll=1
    )
    return seen[task_id]


def wait_run(airflow: EmbeddedAirflow, run_id: str, timeout: float = 900) -> str:
    return airflow.api.wait(DAG_ID, run_id, timeout=timeout)


class TaskTimeline:
    """An ``on_poll`` for ``AirflowApi.wait`` that keeps (and prints) every change of the run's and
    its tasks' states with the time it was seen: when a run under faults does not end, the failure
    says where it stood and since when."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._seen: dict[str, str | None] = {}
        self.changes: list[str] = []

    def __call__(self, state: str, tasks: dict[str, str | None]) -> None:
        for name, now in {"(run)": state, **tasks}.items():
            if self._seen.get(name, "") != now:
                self._seen[name] = now
                line = f"{time.monotonic() - self._start:6.0f} s {time.strftime('%H:%M:%S')} {name}: {now}"
                self.changes.append(line)
                print(line, flush=True)

    def __str__(self) -> str:
        return "\n".join(self.changes)


def assert_stopped_by_hand(api: AirflowApi, run_id: str, segment_task: str) -> None:
    """A run marked failed while ``segment_task`` trained: that task failed, the cluster was torn down,
    and finalize (a teardown task too: Airflow leaves the state of a run marked failed to its
    teardowns and leaves while one is pending) failed the run."""
    assert api.run_state(DAG_ID, run_id) == "failed"
    tasks = api.task_states(DAG_ID, run_id)
    stopped = (tasks[segment_task], tasks["teardown_cluster"], tasks["finalize"])
    assert stopped == ("failed", "success", "failed"), tasks


def segment_starts(layout: RunLayout) -> dict[int, int]:
    """How many times each segment was started (its segment_start events): 1 = never relaunched."""
    counts: dict[int, int] = {}
    for event in read_events(layout.metrics, event="segment_start"):
        counts[event["segment"]] = counts.get(event["segment"], 0) + 1
    return counts


def relaunch_evidence(airflow: EmbeddedAirflow, run_id: str, layout: RunLayout) -> str:
    """What tells why a segment started twice, for an assertion message: every segment_start event,
    the warnings and errors of the run's segment task logs (their trigger logs included) and the
    supervisor's log of component restarts. CI keeps only the test's output."""
    starts = [
        {k: event.get(k) for k in ("segment", "start_step", "wall_time", "restored")}
        for event in read_events(layout.metrics, event="segment_start")
    ]
    lines = [f"segment_start events: {starts}"]
    logs = airflow.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    for path in sorted(logs.glob("task_id=segment_*/*")):
        for line in path.read_text(errors="replace").splitlines():
            noteworthy = '"level":"warning"' in line or '"level":"error"' in line or "launched" in line
            if noteworthy and "DeprecationWarning" not in line:
                lines.append(f"{path.parent.name}/{path.name}: {line[:600]}")
    if airflow.log_path.exists():
        lines += ["embedded.log:", *airflow.log_path.read_text(errors="replace").splitlines()[-40:]]
    return "\n".join(lines)


def checkpoint_names(layout: RunLayout) -> list[str]:
    return storage.list_dirs(layout.checkpoints)


def state_of(layout: RunLayout) -> dict[str, Any]:
    state = read_state(layout)
    assert state is not None, f"no state.json in {layout.root}"
    return state


def component_pid(airflow: EmbeddedAirflow, name: str) -> int:
    from syncswitch_airflow.embedded.supervisor import read_status

    status = read_status(Path(airflow.home))
    assert status is not None and status["components"][name]["running"], status
    return status["components"][name]["pid"]


def wait_for_restart(airflow: EmbeddedAirflow, name: str, old_pid: int, timeout: float = 60) -> int:
    """Wait until the supervisor has replaced component ``name`` (pid ``old_pid``); the new pid."""
    from syncswitch_airflow.embedded.supervisor import read_status

    def replaced() -> bool:
        status = read_status(Path(airflow.home)) or {}
        component = status.get("components", {}).get(name, {})
        return component.get("running") and component.get("pid") != old_pid

    wait_for(replaced, timeout=timeout, what=f"the {name} restarted", poll=0.5)
    time.sleep(1.0)
    return component_pid(airflow, name)


def new_component_pid(airflow: EmbeddedAirflow, name: str, old_pid: int, timeout: float = 120) -> int:
    """The pid of the component that replaced ``old_pid``, as soon as the supervisor has started it."""
    from syncswitch_airflow.embedded.supervisor import read_status

    def started() -> int | None:
        component = (read_status(Path(airflow.home)) or {}).get("components", {}).get(name, {})
        return component["pid"] if component.get("running") and component.get("pid") != old_pid else None

    wait_for(started, timeout=timeout, what=f"the {name} restarted", poll=0.05)
    return started() or new_component_pid(airflow, name, old_pid, timeout)


def wait_until_answered(airflow: EmbeddedAirflow, name: str = "api-server", timeout: float = 300) -> None:
    """Until the supervisor's status says the probed component has answered since its start: a fault
    test of an api-server that "answered, then hung" must not stop one that has not answered yet."""
    from syncswitch_airflow.embedded.supervisor import read_status

    def answered() -> bool:
        component = (read_status(Path(airflow.home)) or {}).get("components", {}).get(name, {})
        return bool(component.get("running") and component.get("answered"))

    wait_for(answered, timeout=timeout, what=f"the {name} to answer since its start", poll=0.5)


def job_checkpoint_step(job_root: str) -> float:
    """``checkpoint_step`` of the (one) run under a job's folder ``<bucket_dir>/<job>``; 0 before it
    has a run folder."""
    runs = storage.list_dirs(job_root)
    return checkpoint_step(RunLayout(f"{job_root}/{runs[0]}")) if runs else 0.0


class DuringRun:
    """A script that acts on a run from a background thread (kills a host when a checkpoint is
    written, brings it back...), while dag.test() runs the DAG in the test's own thread.

    The script gets this object; its ``wait`` ends when ``stop()`` is called. ``stop()`` re-raises
    whatever the script raised (an assertion of its own included)."""

    def __init__(self, script: Callable[[DuringRun], None]) -> None:
        self._script = script
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.waiting_for = ""  # what the script waits for now, for a failure's message

    def start(self) -> DuringRun:
        self._thread.start()
        return self

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        self.waiting_for = f"{what} (since {time.strftime('%H:%M:%S')})"
        while not self._stop.is_set():
            if predicate():
                return
            self._stop.wait(0.2)
        raise RuntimeError(f"the run ended before {what}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._errors:
            raise self._errors[0]

    def _run(self) -> None:
        try:
            self._script(self)
        except BaseException as exc:  # re-raised by stop(), in the test's thread
            self._errors.append(exc)


def first_event(trigger: BaseTrigger, timeout: float = 30.0) -> dict[str, Any]:
    """The payload of the trigger's first event; for an event that ends the watcher on the triggerer
    (TaskSuccessEvent), the XCom it gives the task."""

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            if isinstance(event, TaskSuccessEvent):
                return event.xcoms["return_value"]
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


def task_instances(api: AirflowApi, run_id: str) -> dict[str, dict[str, Any]]:
    """A sync_switch run's task instances by task id, in one request."""
    body = api.get_json(f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances?limit=100")
    return {ti["task_id"]: ti for ti in body["task_instances"]}


def task_log_lines(
    api: AirflowApi, run_id: str, task_id: str, tries: int, keep: Callable[[str], bool], width: int
) -> list[str]:
    """The lines of each try's log of a task that ``keep`` selects (cut to ``width``), fetched through the
    api-server from where the task ran while that is still there (CI keeps only the test's output, and
    a Celery worker's logs go with its private folder)."""
    lines = []
    for try_number in range(1, tries + 1):
        try:
            log = task_log(api, run_id, task_id, try_number)
        except (OSError, AirflowError) as exc:
            lines.append(f"  {task_id} try {try_number}: log unreadable ({exc})")
            continue
        lines += [f"  {task_id} try {try_number}: {line[:width]}" for line in log.splitlines() if keep(line)]
    return lines


def is_error_line(line: str) -> bool:
    """An error of a task's log as :func:`task_log` gives it (a JSON line per event, ``json.dumps``
    spacing) or a raw traceback."""
    return '"level": "error"' in line or "Traceback" in line or "Error" in line


def task_log(api: AirflowApi, run_id: str, task_id: str, try_number: int = 1) -> str:
    """A sync_switch task's log as the UI shows it (the api-server fetches it from where it ran)."""
    body = api.get_json(
        f"/api/v2/dags/sync_switch/dagRuns/{quote(run_id)}/taskInstances/{task_id}/logs/{try_number}"
        "?full_content=true"
    )
    return "\n".join(json.dumps(item) if isinstance(item, dict) else str(item) for item in body["content"])


class LocalSegmentNodes:
    """Finds the pids of the nodes (e.g. 'worker-1'; all of them if none is named) of a running segment
    on a job's local cluster, from the launcher's process table. The cluster's folder is in its fork
    server's environment; it is looked up in /proc until found, then kept (a throttle asks five times a
    second)."""

    def __init__(self, job_name: str, segment: int, *nodes: str) -> None:
        self.job_name, self.segment, self.nodes = job_name, segment, nodes
        self.cluster_dir = ""

    def __call__(self) -> list[int]:
        if not self.cluster_dir:
            found = (environ(int(e)).get(CLUSTER_ENV, "") for e in os.listdir("/proc") if e.isdigit())
            self.cluster_dir = next((d for d in found if f"/{self.job_name}-" in d), "")
        table = Path(self.cluster_dir, "segments", f"seg-{self.segment:02d}", "scratch", "nodes.json")
        try:
            nodes = json.loads(table.read_text()) if self.cluster_dir else {}
            return [int(nodes[name]["pid"]) for name in self.nodes or nodes]
        except (OSError, ValueError, KeyError):
            return []
