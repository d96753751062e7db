"""StragglerTrigger against real run folders, and the StragglerSensor's decisions on a real state.json.

A writer thread plays the segment's processes: it appends worker_step events through the real
EventWriter into the real run layout, in real time. The trigger's ``run()`` generator runs under
asyncio.run; no Airflow database is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException, DownstreamTasksSkipped, TaskDeferred
from airflow.triggers.base import TaskSuccessEvent
from airflow_runs import first_event
from background import Poller
from syncswitch import storage
from syncswitch.events import EventTail, EventWriter
from syncswitch.layout import RunLayout
from syncswitch.plan import MAX_SEGMENTS
from syncswitch.protocols import PROTOCOLS
from syncswitch.spec import JobSpec
from syncswitch.state import new_state, read_state, record_segment, update_state
from syncswitch_airflow.sensors.straggler import DEFAULT_SWITCH_GAP_SECONDS, StragglerSensor, apply_switch
from syncswitch_airflow.triggers import straggler as straggler_trigger
from syncswitch_airflow.triggers.straggler import StragglerTrigger

CLASSPATH = f"{StragglerTrigger.__module__}.{StragglerTrigger.__qualname__}"

DETECTOR = {"window_seconds": 0.5, "threshold": 1.5, "raise_after": 2, "clear_after": 2, "lateness": 0.1}
TICK = 0.05
SEGMENT_TASK = {"dag_id": "sync_switch", "run_id": "r", "task_id": "segment_0.bsp"}
# What a sensor's execute() gets from Airflow, as far as the sensor reads it.
CONTEXT = {"ti": SimpleNamespace(dag_id="sync_switch", run_id="r")}
Slowdown = Callable[[int, float], float]


def clean(_worker: int, _t: float) -> float:
    return 1.0


def worker_slow_after(worker: int, after: float, factor: float = 3.0) -> Slowdown:
    return lambda w, t: factor if w == worker and t >= after else 1.0


class SegmentWriter(Poller):
    """Appends lockstep BSP (or free-running ASP) worker_step events for one segment, in real time."""

    def __init__(self, uri_of: Callable[[int], str], protocol: str, workers: int, slowdown: Slowdown) -> None:
        self.writers = [
            EventWriter(
                uri_of(w), run_id="r", segment=0, protocol=protocol, role="worker", task=w, flush_seconds=0
            )
            for w in range(workers)
        ]
        self.protocol, self.slowdown = protocol, slowdown
        self.started, self.step = time.monotonic(), 0
        super().__init__(every=TICK, join_seconds=5)

    def poll(self) -> None:
        t = time.monotonic() - self.started
        computes = [0.02 * self.slowdown(w, t) for w in range(len(self.writers))]
        self.step += 1
        for w, (writer, compute) in enumerate(zip(self.writers, computes, strict=True)):
            # BSP: everyone's step takes as long as the slowest compute; ASP: each its own.
            step_time = (max(computes) if self.protocol == "bsp" else compute) + 0.005
            writer.emit(
                "worker_step",
                worker=w,
                global_step=float(self.step),
                step_time=step_time,
                compute_time=compute,
                wait_time=step_time - compute,
            )

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for writer in self.writers:
            writer.close()


def trigger_for(layout: RunLayout, protocol: str = "bsp", **kwargs: Any) -> StragglerTrigger:
    settings = {
        "segment_task": SEGMENT_TASK,
        "poll_interval": 0.05,
        "task_check_seconds": 0.1,
        "detector": DETECTOR,
        "index": 0,
        **kwargs,
    }
    return StragglerTrigger(run_dir=layout.root, protocol=protocol, **settings)


def writer_for(layout: RunLayout, protocol: str, workers: int, slowdown: Slowdown) -> SegmentWriter:
    return SegmentWriter(
        lambda w: layout.segment_events(0, protocol, "worker", w), protocol, workers, slowdown
    )


def write_result_after(layout: RunLayout, protocol: str, seconds: float) -> threading.Timer:
    timer = threading.Timer(
        seconds, lambda: storage.write_json(layout.segment_result(0, protocol), {"index": 0, "end_step": 10})
    )
    timer.start()
    return timer


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout.for_run(str(tmp_path), "job", "manual__2026-01-01T00:00:00+00:00")


# ---- the trigger -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 4])
def test_a_straggler_appearing_fires_a_verdict(layout: RunLayout, workers: int) -> None:
    with writer_for(layout, "bsp", workers, worker_slow_after(1, after=0.6)):
        payload = first_event(trigger_for(layout))
    assert payload["status"] == "verdict" and payload["change"] == "raised"
    assert (payload["index"], payload["protocol"]) == (0, "bsp")
    verdict = payload["verdict"]
    assert verdict["straggling"] and verdict["workers"] == [1]
    assert verdict["signal"] == "compute_time" and verdict["slowdown"] >= 2.0
    assert verdict["global_step"] > 0


def test_result_json_ends_the_watch(layout: RunLayout) -> None:
    with writer_for(layout, "bsp", 2, clean):
        timer = write_result_after(layout, "bsp", 1.5)
        payload = first_event(trigger_for(layout))
        timer.join()
    assert payload == {"status": "segment_ended", "index": 0, "protocol": "bsp"}


@pytest.fixture(autouse=True)
def segment_task_states(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The states the execution API reports for the watched segment task, one per question; the
    last one repeats. Airflow's task SDK is the external boundary here: no scheduler runs."""
    states: list[str | None] = [None]

    def answer(dag_id: str, run_id: str, task_id: str) -> str | None:
        assert (dag_id, run_id, task_id) == tuple(SEGMENT_TASK.values())
        return states.pop(0) if len(states) > 1 else states[0]

    monkeypatch.setattr(straggler_trigger, "task_state", answer)
    return states


def test_the_plan_s_last_segment_hands_its_end_back_to_the_sensor(layout: RunLayout) -> None:
    """Entry 1 is the last of a "10" plan: its end resumes the sensor on a worker (a plain
    TriggerEvent), which then skips the later slots' tasks; entry 0's end ends its watcher on the
    triggerer (a TaskSuccessEvent), as above."""
    start_run(layout, "greedy")
    for index, protocol, ends_here, status in (
        (0, "bsp", True, "segment_ended"),
        (1, "asp", False, "plan_ended"),
    ):
        storage.write_json(layout.segment_result(index, protocol), {"index": index})
        event = asyncio.run(anext(trigger_for(layout, protocol=protocol, index=index).run()))
        assert isinstance(event, TaskSuccessEvent) == ends_here
        payload = event.xcoms["return_value"] if ends_here else event.payload
        assert payload == {"status": status, "index": index, "protocol": protocol}


@pytest.mark.parametrize("final_state", ["failed", "skipped", "upstream_failed"])
def test_the_watch_ends_when_its_segment_task_ends_without_a_result(
    layout: RunLayout, segment_task_states: list, final_state: str
) -> None:
    # Deferred, then waiting for a retry (the retry relaunches the segment: keep watching), then done.
    segment_task_states[:] = ["deferred", "up_for_retry", "running", final_state]
    with writer_for(layout, "bsp", 2, clean):
        payload = first_event(trigger_for(layout))
    assert payload == {
        "status": "segment_task_ended",
        "task_state": final_state,
        "index": 0,
        "protocol": "bsp",
    }
    assert segment_task_states == [final_state]


def test_the_segment_task_is_asked_about_often_only_while_no_step_comes(
    layout: RunLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each question is an execution API call (~0.017 cores of the triggerer at one a second): every
    second while a poll brings no step timings (the segment may have failed, and its teardown waits
    for this watcher), every ``task_check_seconds`` while steps come."""
    asked: list[float] = []

    def running(**_kwargs: str) -> str:
        asked.append(time.monotonic())
        return "running"

    monkeypatch.setattr(straggler_trigger, "task_state", running)

    async def watch(seconds: float) -> None:
        trigger = trigger_for(layout, poll_interval=0.5, task_check_seconds=30.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(anext(trigger.run()), seconds)

    asyncio.run(watch(3.6))
    quiet, asked[:] = len(asked), []
    with writer_for(layout, "bsp", 2, clean):
        asyncio.run(watch(3.6))
    assert quiet >= 3 and len(asked) <= 2, (quiet, asked)


def test_an_unanswered_task_state_question_does_not_end_the_watch(
    layout: RunLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(**_kwargs: str) -> str:
        raise ConnectionError("execution API restarting")

    monkeypatch.setattr(straggler_trigger, "task_state", unavailable)
    with writer_for(layout, "bsp", 2, clean):
        timer = write_result_after(layout, "bsp", 1.0)
        payload = first_event(trigger_for(layout))
        timer.join()
    assert payload["status"] == "segment_ended"


def test_started_straggling_it_fires_when_the_straggler_clears(layout: RunLayout) -> None:
    since = time.time() - 20
    trigger = trigger_for(layout, "asp", straggling_since=since, straggling_workers=[1])
    with writer_for(layout, "asp", 2, clean):
        payload = first_event(trigger)
    assert payload["change"] == "cleared"
    assert payload["verdict"]["since"] == since and not payload["verdict"]["straggling"]
    assert payload["verdict"]["signal"] == "step_time"


def test_start_after_ignores_windows_already_acted_on(layout: RunLayout) -> None:
    slow_then_clean = lambda w, t: 3.0 if w == 1 and t < 1.5 else 1.0  # noqa: E731
    with writer_for(layout, "bsp", 2, slow_then_clean):
        time.sleep(1.6)
        # Control: a trigger that reads the whole history sees the slow windows at once.
        assert first_event(trigger_for(layout))["change"] == "raised"
        timer = write_result_after(layout, "bsp", 1.5)
        payload = first_event(trigger_for(layout, start_after=time.time()))
        timer.join()
    assert payload["status"] == "segment_ended"


def test_a_lasting_straggler_is_reported_again_every_recheck_seconds(layout: RunLayout) -> None:
    with writer_for(layout, "bsp", 2, worker_slow_after(0, after=0.0)):
        payload = first_event(trigger_for(layout, straggling_since=time.time(), recheck_seconds=1.0))
    assert payload["change"] == "ongoing" and payload["verdict"]["workers"] == [0]


def test_serialize_round_trips(layout: RunLayout) -> None:
    trigger = trigger_for(layout, straggling_since=12.5, straggling_workers=[1], recheck_seconds=30.0)
    classpath, kwargs = trigger.serialize()
    assert classpath == CLASSPATH == "syncswitch_airflow.triggers.straggler.StragglerTrigger"
    assert StragglerTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert kwargs["straggling_since"] == 12.5 and kwargs["detector"] == DETECTOR


def test_event_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "seg" / "worker-0.jsonl"
    path.parent.mkdir()
    path.write_text('{"event": "worker_step", "wall_time": 1}\n{"event": "worker_st')
    tail = EventTail(str(tmp_path / "seg"))
    assert [r["wall_time"] for r in tail.read_new()] == [1]
    with path.open("a") as f:
        f.write('ep", "wall_time": 2}\n')
    assert [r["wall_time"] for r in tail.read_new()] == [2]
    assert tail.read_new() == []


def test_a_straggler_in_a_gcs_run_folder(gcs_bucket: str) -> None:
    layout = RunLayout.for_run(gcs_bucket, "job", "gcs-run")
    detector = {**DETECTOR, "window_seconds": 1.0}
    with writer_for(layout, "bsp", 2, worker_slow_after(0, after=1.0)):
        payload = first_event(trigger_for(layout, poll_interval=0.2, detector=detector), timeout=60)
    assert payload["change"] == "raised" and payload["verdict"]["workers"] == [0]


# ---- the sensor --------------------------------------------------------------------------------


def start_run(layout: RunLayout, policy: str, max_online_switches: int = 2) -> None:
    job = JobSpec(
        switch_order="10", total_steps=400, online_policy=policy, max_online_switches=max_online_switches
    )
    entries = [
        {"index": s.index, "protocol": s.protocol, "until_step": s.until_step, "origin": "plan"}
        for s in job.plan("r", layout.root)
    ]

    def init(state: dict) -> None:
        state.update(new_state(layout, "r", job.to_params()), plan=entries)

    update_state(layout, init)


def sensor(layout: RunLayout, slot: int = 0) -> StragglerSensor:
    return StragglerSensor(
        task_id=f"segment_{slot}.watch_stragglers",
        run_dir=layout.root,
        slot=slot,
        segment_tasks={"bsp": f"segment_{slot}.bsp", "asp": f"segment_{slot}.asp"},
        poll_interval=0.05,
        detector=DETECTOR,
        recheck_seconds=5.0,
    )


def raised_payload(layout: RunLayout) -> dict[str, Any]:
    with writer_for(layout, "bsp", 2, worker_slow_after(1, after=0.5)):
        return first_event(trigger_for(layout))


def test_sensor_skips_a_slot_past_the_end_of_the_plan(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    with pytest.raises(AirflowSkipException):
        sensor(layout, slot=2).execute(CONTEXT)


def test_sensor_returns_at_once_when_its_segment_already_ended(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    storage.write_json(layout.segment_result(0, "bsp"), {"index": 0})
    started = time.monotonic()
    result = sensor(layout).execute(CONTEXT)
    assert result["status"] == "segment_ended" and result["decisions"] == []
    assert time.monotonic() - started < 1


def test_sensor_defers_to_the_trigger_for_a_running_segment(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    with pytest.raises(TaskDeferred) as deferred:
        sensor(layout).execute(CONTEXT)
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == CLASSPATH
    assert (kwargs["index"], kwargs["protocol"], kwargs["straggling_since"]) == (0, "bsp", None)
    assert deferred.value.method_name == "execute_complete"


def test_sensor_never_defers_under_dags_test(layout: RunLayout) -> None:
    """dag.test() runs tasks one at a time, triggers inline: a deferred sensor would block the segment
    (or its retry) it waits for, so it ends at once, started segment or not."""
    start_run(layout, "greedy")
    dag_test_run = SimpleNamespace(triggering_user_name="dag_test")
    for segment_has_started in (False, True):
        if segment_has_started:
            storage.write_text(layout.segment_events(0, "bsp", "worker", 0), "{}\n")
        started = time.monotonic()
        result = sensor(layout).execute({"dag_run": dag_test_run})
        assert result["status"] == "not_watched" and result["decisions"] == []
        assert time.monotonic() - started < 1
    # Under the scheduler the same sensor defers to its trigger.
    with pytest.raises(TaskDeferred):
        sensor(layout).execute({**CONTEXT, "dag_run": SimpleNamespace(triggering_user_name="admin")})


def test_greedy_verdict_rewrites_the_plan_then_requests_the_stop(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    payload = raised_payload(layout)
    decision = sensor(layout).execute_complete(CONTEXT, payload)
    assert decision["action"] == "switch" and decision["policy"] == "greedy"
    state = read_state(layout)
    assert state is not None
    assert [(p["protocol"], p["until_step"], p["origin"]) for p in state["plan"]] == [
        ("bsp", 100, "plan"),
        ("asp", 100, "online"),
        ("asp", 400, "plan"),
    ]
    [recorded] = state["decisions"]
    assert recorded["action"] == "switch" and recorded["workers"] == [1] and recorded["plan_changed"]
    assert recorded["reason"] in storage.read_text(layout.stop_request(0))

    # The online ASP slot starts its detector straggling, so it reports when the straggler clears.
    with pytest.raises(TaskDeferred) as deferred:
        sensor(layout, slot=1).execute(CONTEXT)
    kwargs = deferred.value.trigger.serialize()[1]
    assert (kwargs["protocol"], kwargs["straggling_since"]) == ("asp", payload["verdict"]["since"])
    assert kwargs["straggling_workers"] == [1]


def test_a_retried_switch_is_not_inserted_twice(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    item = {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"}
    record = {"segment": 0, "action": "switch", "reason": "test"}
    apply_switch(layout, item, record)
    state = apply_switch(layout, item, record)
    assert len(state["plan"]) == 3
    assert [d["plan_changed"] for d in state["decisions"]] == [True, False]


def test_a_switch_that_comes_after_the_segments_result_changes_nothing(layout: RunLayout) -> None:
    """The result's trigger may have launched the next entry already: the plan stands and nothing is
    stopped (the sensor then records a stay)."""
    start_run(layout, "greedy")
    record_segment(layout, 0, {"index": 0, "protocol": "bsp", "end_step": 100.0, "stopped_early": False})
    item = {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"}
    before = read_state(layout)
    assert apply_switch(layout, item, {"segment": 0, "action": "switch", "reason": "test"}) is None
    after = read_state(layout)
    assert after is not None and before is not None
    assert after["plan"] == before["plan"] and not after.get("decisions")
    assert not storage.exists(layout.stop_request(0))


def test_policy_none_records_the_detection_and_keeps_watching(layout: RunLayout) -> None:
    start_run(layout, "none")
    payload = raised_payload(layout)
    with pytest.raises(TaskDeferred) as deferred:
        sensor(layout).execute_complete(CONTEXT, payload)
    state = read_state(layout)
    assert state is not None and len(state["plan"]) == 2
    assert not storage.exists(layout.stop_request(0))
    [recorded] = state["decisions"]
    assert (recorded["action"], recorded["reason"], recorded["change"]) == ("stay", "policy none", "raised")
    kwargs = deferred.value.trigger.serialize()[1]
    assert kwargs["start_after"] == payload["verdict"]["window_end"]
    assert kwargs["straggling_since"] == payload["verdict"]["since"]
    assert kwargs["recheck_seconds"] == 0.0  # nothing to weigh again under policy none


def test_elastic_declines_a_fresh_straggler_and_asks_to_hear_of_it_again(layout: RunLayout) -> None:
    start_run(layout, "elastic")
    payload = raised_payload(layout)
    with pytest.raises(TaskDeferred) as deferred:
        sensor(layout).execute_complete(CONTEXT, payload)
    state = read_state(layout)
    assert state is not None
    [recorded] = state["decisions"]
    assert recorded["action"] == "stay"
    assert recorded["saving"] <= recorded["cost"] == 2 * DEFAULT_SWITCH_GAP_SECONDS  # switch and back
    assert recorded["switch_gap_source"] == "default estimate"
    assert deferred.value.trigger.serialize()[1]["recheck_seconds"] == 5.0


def test_a_verdict_arriving_after_the_segment_ended_changes_nothing(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    payload = raised_payload(layout)
    storage.write_json(layout.segment_result(0, "bsp"), {"index": 0})
    result = sensor(layout).execute_complete(CONTEXT, payload)
    assert result["status"] == "segment_ended"
    assert [d["reason"] for d in result["decisions"]] == ["segment already ended"]
    assert not storage.exists(layout.stop_request(0))


def test_a_verdict_about_another_protocol_changes_nothing(layout: RunLayout) -> None:
    start_run(layout, "greedy")
    # The plan moved under this slot (a switch in an earlier slot): what it watched is gone.
    moved = sensor(layout).execute_complete(CONTEXT, {"status": "verdict", "index": 0, "protocol": "asp"})
    assert moved["status"] == "plan_changed"
    state = read_state(layout)
    assert state is not None and state["decisions"] == [] and len(state["plan"]) == 2


@pytest.fixture(autouse=True)
def _no_stray_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leftover = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not leftover, f"threads left running: {leftover}"


@pytest.mark.airflow
def test_the_plan_s_last_watcher_skips_every_later_slot_s_tasks(dag, layout: RunLayout) -> None:  # noqa: ANN001
    """In the DAG: resumed at the end of the plan's last segment (entry 1 of "10"), the watcher skips
    the tasks of slots 2 and after in one request, so that none of them starts."""
    start_run(layout, "greedy")
    storage.write_json(layout.segment_result(1, "asp"), {"index": 1})
    watcher = dag.get_task("segment_1.watch_stragglers")
    watcher.run_dir = layout.root  # rendered from the plan task's XCom in a run
    with pytest.raises(DownstreamTasksSkipped) as skipped:
        watcher.execute_complete(CONTEXT, {"status": "plan_ended", "index": 1, "protocol": "asp"})
    names = (*PROTOCOLS, "watch_stragglers")
    assert sorted(skipped.value.tasks) == sorted(
        f"segment_{slot}.{name}" for slot in range(2, MAX_SEGMENTS) for name in names
    )
    # Not the last: the watcher of entry 0 ends without skipping anything.
    storage.write_json(layout.segment_result(0, "bsp"), {"index": 0})
    first = dag.get_task("segment_0.watch_stragglers")
    first.run_dir = layout.root
    assert first.execute(CONTEXT)["status"] == "segment_ended"
