"""SegmentOperator's choice on a real run folder and a real local cluster: follow a running segment,
record an ended one, launch only one that neither runs nor ended, and only while the job's
``segment_retries`` last."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from proc_utils import wait_for
from syncswitch import storage
from syncswitch.fields import MAX_SEGMENT_RETRIES
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch.state import new_state, read_state, update_state
from syncswitch_airflow.backends.base import EXITED, RUNNING
from syncswitch_airflow.backends.local import LocalBackend
from syncswitch_airflow.operators import segment as segment_module
from syncswitch_airflow.operators.segment import SegmentOperator, retries_so_far

# A segment that ends when told to: it writes its finished result.json once the go file exists.
ENDS_WHEN_TOLD = """
import json, os, sys, time
go, result = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.02)
with open(result, "w") as f:
    json.dump({"index": 0, "protocol": "bsp", "start_step": 0.0, "end_step": 30.0, "seconds": 1.0}, f)
"""


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[RunLayout, LocalBackend, dict[str, Any]]]:
    layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", "r")
    backend = LocalBackend(work_root=str(tmp_path / "work"))
    job = JobSpec(job_name="demo", switch_order="1", total_steps=30)
    handle = backend.provision(job, layout)
    entry = {"index": 0, "protocol": "bsp", "until_step": 30.0, "origin": "plan"}

    def init(state: dict) -> None:
        state.update(new_state(layout, "r", job.to_params()), plan=[entry], cluster=handle)

    update_state(layout, init)
    yield layout, backend, handle
    backend.teardown(handle)


def operator(layout: RunLayout) -> SegmentOperator:
    return SegmentOperator(task_id="segment_0.bsp", slot=0, protocol="bsp", run_dir=layout.root)


def try_context(try_number: int = 1) -> dict[str, Any]:
    """The part of Airflow's task context the operator reads: its task instance's try counters on a
    first round (``max_tries`` is the task's retries until a clear)."""
    return {"ti": SimpleNamespace(try_number=try_number, max_tries=MAX_SEGMENT_RETRIES)}


def test_a_segment_ending_while_its_retry_looks_is_recorded_not_launched_again(
    run: tuple[RunLayout, LocalBackend, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry that arrives as its segment ends: the segment ends (result, then launcher exit) right
    after the retry's first look, at its launcher or at its result.json. The retry must not take the
    exited launcher for a segment that never ended and launch it a second time (CI saw a retry that
    read the result first train the online segment twice)."""
    layout, backend, handle = run
    go = tmp_path / "go"
    result_path = layout.segment_result(0, "bsp")
    Path(result_path).parent.mkdir(parents=True, exist_ok=True)
    first = backend.launch_command(handle, 0, [sys.executable, "-c", ENDS_WHEN_TOLD, str(go), result_path])
    assert backend.segment_status(handle, 0).state == RUNNING

    def end_after_the_first_look(look: Any) -> Any:
        def probe(*args: Any) -> Any:
            answer = look(*args)
            if not go.exists():
                go.touch()
                wait_for(lambda: backend.segment_status(handle, 0).state == EXITED, what="the segment's end")
            return answer

        return probe

    monkeypatch.setattr(segment_module, "read_result", end_after_the_first_look(segment_module.read_result))
    monkeypatch.setattr(LocalBackend, "segment_status", end_after_the_first_look(LocalBackend.segment_status))
    try:
        operator(layout).execute(try_context())
    except TaskDeferred:
        pass  # it follows the segment: its trigger finds the result and records it
    else:  # it found the result: recorded, the plan's next entry (none here) launched
        assert read_state(layout)["segments"]["0"]["end_step"] == 30.0
    assert go.exists()  # the segment did end between the looks
    # Started once: the launch record is the first one's.
    record = json.loads((Path(backend.segment_dir(handle, 0)) / "process.json").read_text())
    assert record["pid"] == first["pid"]
    assert storage.read_json(result_path)["end_step"] == 30.0


def test_a_task_launching_as_the_segment_before_launches_it_follows_that_launch(
    run: tuple[RunLayout, LocalBackend, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trigger of the segment before launches this segment right after the task found it not
    running: the task's own launch is refused, and the task follows the running segment."""
    layout, backend, handle = run
    command = [sys.executable, "-c", "import time; time.sleep(30)", str(tmp_path)]
    launched: list[dict[str, Any]] = []
    real_status = LocalBackend.segment_status

    def status_then_the_trigger_launches(self: LocalBackend, *args: Any) -> Any:
        answer = real_status(self, *args)
        if not launched:
            launched.append(backend.launch_command(handle, 0, command))
        return answer

    monkeypatch.setattr(LocalBackend, "segment_status", status_then_the_trigger_launches)
    # An earlier try's events: the watcher of a try this task launches starts after them.
    earlier_try = layout.segment_events(0, "bsp", "worker", 0)
    storage.write_text(earlier_try, json.dumps({"event": "step", "global_step": 20.0}) + "\n")
    with pytest.raises(TaskDeferred) as deferred:
        operator(layout).execute(try_context(try_number=2))
    record = json.loads((Path(backend.segment_dir(handle, 0)) / "process.json").read_text())
    assert record["pid"] == launched[0]["pid"]
    assert deferred.value.trigger.event_offsets == {earlier_try: len(storage.read_bytes(earlier_try))}


def test_retries_are_counted_since_the_last_clear() -> None:
    """Airflow counts tries across clears (a clear raises max_tries to the tries so far plus the
    task's retries): a cleared task starts a new round of the job's segment_retries."""
    retries = 20
    assert [retries_so_far(SimpleNamespace(try_number=n, max_tries=retries), retries) for n in (1, 2, 3)] == [
        0,
        1,
        2,
    ]
    # Failed at try 3, cleared: max_tries = 3 + 20; the next try is 4, the new round's first.
    assert retries_so_far(SimpleNamespace(try_number=4, max_tries=23), retries) == 0
    assert retries_so_far(SimpleNamespace(try_number=5, max_tries=23), retries) == 1
    # A run whose task instance was created when the task had 1 retry: its own tries so far.
    assert retries_so_far(SimpleNamespace(try_number=2, max_tries=1), retries) == 1


@pytest.mark.parametrize("segment_retries", [0, 2])
def test_a_try_past_the_jobs_segment_retries_fails_for_good_without_launching(
    run: tuple[RunLayout, LocalBackend, dict[str, Any]], segment_retries: int
) -> None:
    """The try after the job's last retry (one whose failure ended without handing it back, e.g. on
    a lost Airflow worker) fails at once, naming the field, and launches nothing; the job's last try
    launches, and its trigger hands a failure back rather than ending the task on the triggerer."""
    layout, backend, handle = run
    update_state(layout, lambda state: state["job"].update(segment_retries=segment_retries))
    with pytest.raises(AirflowFailException, match=f"segment_retries={segment_retries}"):
        operator(layout).execute(try_context(try_number=segment_retries + 2))
    assert backend.segment_status(handle, 0).state != RUNNING
    assert not (Path(backend.segment_dir(handle, 0)) / "process.json").exists()

    # A running segment (launched as the trigger of the segment before would) is followed.
    backend.launch_command(handle, 0, [sys.executable, "-c", "import time; time.sleep(30)", str(layout.root)])
    with pytest.raises(TaskDeferred) as deferred:
        operator(layout).execute(try_context(try_number=segment_retries + 1))
    assert deferred.value.trigger.last_try
    assert deferred.value.trigger.event_offsets == {}  # a followed segment's events are all its own
    if segment_retries:
        with pytest.raises(TaskDeferred) as deferred:
            operator(layout).execute(try_context(try_number=segment_retries))
        assert not deferred.value.trigger.last_try
