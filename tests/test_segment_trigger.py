"""SegmentTrigger against real run folders of both protocols, with a real launcher record.

The launcher is a real detached process started through the local backend (a sleeper standing in for
``syncswitch train``); a writer thread plays the segment's chief through the real EventWriter: worker 0
in BSP (``worker-0.jsonl``), the coordinator in ASP (``chief-0.jsonl``). The trigger's ``run()`` runs
under asyncio.run; no Airflow database is needed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.triggers.base import TaskFailedEvent, TaskSuccessEvent, TriggerEvent
from proc_utils import wait_for
from syncswitch import storage
from syncswitch.events import EventTail, EventWriter
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch.state import new_state, read_state, record_cluster, update_state
from syncswitch_airflow.backends.local import LocalBackend
from syncswitch_airflow.triggers.segment import (
    STATUS_POLL_MAX_S,
    SegmentTrigger,
    launch_next,
    status_interval,
)

CHIEF = {"bsp": ("worker", 0), "asp": ("chief", 0)}


class ChiefWriter:
    """Emits the chief's `step` events every ``interval`` s until stopped (or ``steps`` are done)."""

    def __init__(self, layout: RunLayout, protocol: str, interval: float, steps: int | None = None) -> None:
        role, task = CHIEF[protocol]
        self.events = EventWriter(
            layout.segment_events(0, protocol, role, task),
            run_id="r",
            segment=0,
            protocol=protocol,
            role=role,
            task=task,
            flush_seconds=0,
        )
        self.interval, self.steps = interval, steps
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        step = 0
        while not self.stop.wait(self.interval) and (self.steps is None or step < self.steps):
            step += 1
            self.events.emit(
                "step", global_step=float(step), samples=64 * step, loss=1.0, examples_per_sec=320.0
            )

    def __enter__(self) -> ChiefWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.events.close()


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    return RunLayout.for_run(str(tmp_path / "runs"), "job", "r")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A live launcher record of segment 0 on a local cluster handle; stopped afterwards."""
    backend = LocalBackend(str(tmp_path / "work"))
    handle = {"backend": "local", "run": "r", "work_dir": str(tmp_path / "work" / "r")}
    backend.launch_command(handle, 0, [sys.executable, "-c", "import time; time.sleep(120)"])
    yield handle
    backend.stop_segment(handle, 0, grace_seconds=2)


def first_event(trigger: SegmentTrigger, timeout: float = 60.0) -> TriggerEvent:
    async def first() -> TriggerEvent:
        async for event in trigger.run():
            return event
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


def trigger(layout: RunLayout, protocol: str, handle: dict[str, Any], stall_seconds: float) -> SegmentTrigger:
    """A trigger of segment 0 of a run on the cluster ``handle`` (recorded in state.json, where the
    trigger reads it)."""
    run_on_cluster(layout, handle)
    return SegmentTrigger(
        run_dir=layout.root,
        index=0,
        protocol=protocol,
        until_step=1000,
        stall_seconds=stall_seconds,
        stall_grace_seconds=0.0,
        poll_seconds=0.05,
        progress_seconds=0.1,
        log_seconds=0.5,
    )


@pytest.mark.parametrize("protocol", ["bsp", "asp"])
def test_a_segment_that_keeps_stepping_past_the_stall_limit_is_not_failed(
    layout: RunLayout, launcher: dict, protocol: str, capfd: pytest.CaptureFixture
) -> None:
    stall_seconds = 1.0
    with ChiefWriter(layout, protocol, interval=0.2):
        timer = threading.Timer(
            4 * stall_seconds,
            lambda: storage.write_json(layout.segment_result(0, protocol), {"index": 0, "end_step": 20}),
        )
        timer.start()
        started = time.monotonic()
        event = first_event(trigger(layout, protocol, launcher, stall_seconds))
        timer.join()
    # The task ends on the triggerer, with the result recorded in state.json and the summary as XCom.
    assert isinstance(event, TaskSuccessEvent)
    assert event.xcoms["return_value"]["end_step"] == 20
    assert read_state(layout)["segments"]["0"] == {"index": 0, "end_step": 20}
    assert time.monotonic() - started >= 4 * stall_seconds
    # The task log shows the chief's steps in both protocols (BSP's chief is worker 0).
    logged = capfd.readouterr()
    assert re.search(r"segment 0 \((bsp|asp)\): step \d+ / 1,000, 320 examples/s", logged.out + logged.err)


@pytest.mark.parametrize("protocol", ["bsp", "asp"])
def test_a_segment_whose_steps_stop_is_failed_after_the_limit(
    layout: RunLayout, launcher: dict, protocol: str, capfd: pytest.CaptureFixture
) -> None:
    with ChiefWriter(layout, protocol, interval=0.1, steps=5):
        started = time.monotonic()
        event = first_event(trigger(layout, protocol, launcher, stall_seconds=1.5))
    assert isinstance(event, TaskFailedEvent)
    assert time.monotonic() - started >= 1.5
    logged = capfd.readouterr()
    assert re.search(r"failed: no new step for \d+ s \(at step 5", logged.out + logged.err)
    # Nothing of the segment is left running, so that the retry starts cleanly.
    assert LocalBackend(launcher["work_dir"]).segment_status(launcher, 0).state == "exited"


def test_a_retry_shows_its_own_steps_not_those_of_the_try_it_replaces(
    layout: RunLayout, launcher: dict, capfd: pytest.CaptureFixture
) -> None:
    """The killed try got to step 50 and its retry resumes from an earlier checkpoint: the retry's
    watcher reports the retry's steps (the operator hands it where they begin), never step 50."""
    with ChiefWriter(layout, "bsp", interval=0.001, steps=50) as killed_try:
        killed_try.thread.join()
    offsets = EventTail(layout.segment_metrics(0, "bsp")).skip_existing()
    with ChiefWriter(layout, "bsp", interval=0.3, steps=3):
        timer = threading.Timer(
            1.5, lambda: storage.write_json(layout.segment_result(0, "bsp"), {"index": 0, "end_step": 3})
        )
        timer.start()
        retry = trigger(layout, "bsp", launcher, stall_seconds=30.0)
        retry = SegmentTrigger(**{**retry.serialize()[1], "event_offsets": offsets})
        event = first_event(retry)
        timer.join()
    assert isinstance(event, TaskSuccessEvent)
    logged = capfd.readouterr()
    lines = logged.out + logged.err
    progress = re.findall(r"segment 0 \(bsp\): (waiting for the first step|step [\d.]+) ", lines)
    assert progress, lines[-2000:]
    assert "step 50" not in progress
    assert progress[0] == "waiting for the first step"  # the killed try's last step before it
    assert {"step 1", "step 2"} & set(progress)


def run_on_cluster(
    layout: RunLayout, handle: dict[str, Any], plan: list[dict[str, Any]] | None = None
) -> None:
    """The run's state.json: on the cluster ``handle``, with ``plan`` where given."""
    fields = {"plan": plan} if plan is not None else {}
    update_state(layout, lambda s: s.update(new_state(layout, "r", JobSpec().to_params()), **fields))
    record_cluster(layout, handle)


def run_with_next_entry(layout: RunLayout, handle: dict[str, Any]) -> None:
    """A run whose plan has segment 1 after segment 0, on the cluster ``handle``."""
    plan = [
        {"index": 0, "protocol": "bsp", "until_step": 100, "origin": "plan"},
        {"index": 1, "protocol": "asp", "until_step": 400, "origin": "plan"},
    ]
    run_on_cluster(layout, handle, plan)


def test_the_next_segment_is_not_launched_ahead_after_a_lost_node_or_twice(
    layout: RunLayout, launcher: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """launch_next leaves segment 1 to its task when segment 0 lost a node (the launch may have to
    repair the cluster first), never starts a segment that runs or ended already, and never raises."""
    backend, log = LocalBackend(launcher["work_dir"]), logging.getLogger("test.launch_next")
    run_with_next_entry(layout, launcher)
    stream = layout.segment_events(0, "bsp", "launcher", 0)
    for part in range(2):  # a retried launcher writes on in a new part
        with EventWriter(stream, run_id="r", segment=0, protocol="bsp", role="launcher", task=0) as events:
            events.emit("segment_start" if part == 0 else "node_lost", node="worker-1", exit_code=-9)
    with caplog.at_level(logging.INFO, logger="test.launch_next"):
        launch_next(layout.root, 0, "bsp", log)
    assert "segment 0 lost a node; its task launches segment 1" in caplog.text
    assert backend.segment_status(launcher, 1).state == "unknown"

    storage.write_json(layout.segment_result(1, "asp"), {"index": 1, "end_step": 400})
    launch_next(layout.root, 0, "asp", log)  # no lost node in this stream; segment 1 has ended
    assert backend.segment_status(launcher, 1).state == "unknown"

    storage.delete(layout.segment_result(1, "asp"))
    backend.launch_command(launcher, 1, [sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        running = backend.segment_status(launcher, 1)
        launch_next(layout.root, 0, "asp", log)
        assert backend.segment_status(launcher, 1).pid == running.pid
    finally:
        backend.stop_segment(launcher, 1, grace_seconds=2)

    # Whatever goes wrong is logged, never raised: the segment's task must end either way.
    record_cluster(layout, {**launcher, "backend": "no-such-backend"})
    with caplog.at_level(logging.INFO, logger="test.launch_next"):
        launch_next(layout.root, 0, "asp", log)
    assert "run r: segment 1 not launched ahead of its task" in caplog.text


def test_a_remote_status_is_asked_less_often_as_a_segment_ages_but_not_while_unknown() -> None:
    """Each status on hosts is an SSH login to the chief: every 3 s for a young segment (a launcher
    that cannot start dies early), then age / 20 up to once a minute, and back to every 3 s while
    the launcher is unknown, so that the 30 s grace before "lost" is counted at that pace."""
    assert status_interval(3.0, 10.0, "running") == 3.0
    assert status_interval(3.0, 600.0, "running") == 30.0
    assert status_interval(3.0, 86_400.0, "running") == STATUS_POLL_MAX_S == 60.0
    assert status_interval(3.0, 86_400.0, "unknown") == 3.0
    day = sum(1 for _ in _looks(3.0, 86_400.0))
    assert day < 1_600, day  # against 28,800 at a steady 3 s


def _looks(base: float, seconds: float) -> Iterator[float]:
    age = 0.0
    while age < seconds:
        yield age
        age += status_interval(base, age, "running")


# A launcher that fails as syncswitch.launcher does: its segment_failed event, then exit 1.
FAILING_LAUNCHER = """
import sys
from syncswitch.events import EventWriter
with EventWriter(sys.argv[1], run_id="r", segment=0, protocol="bsp", role="launcher", task=0) as events:
    events.emit(
        "segment_failed", reason="the chief exited with 1", node="worker-2", host="h3", exit_code=-9,
        lost=True, global_step=3100.0, last_lines=["worker 2 of segment 0 (bsp), pid 7", "step 3099"],
        log=sys.argv[2] + "/worker-2.log", logs=sys.argv[2],
    )
sys.exit(1)
"""


def test_a_failed_try_names_the_node_that_failed_first_with_its_last_lines(
    layout: RunLayout, tmp_path: Path, capfd: pytest.CaptureFixture, statsd_here: Any
) -> None:
    """The task log of a failed try says which node failed first, where and how, shows its last lines
    and where every node's log is (the launcher's ``segment_failed`` event), beside the launcher's log
    tail; the failure is a metric naming that node."""
    backend = LocalBackend(str(tmp_path / "work"))
    handle = {"backend": "local", "run": "r", "work_dir": str(tmp_path / "work" / "r")}
    logs = layout.segment_logs(0, "bsp")
    stream = layout.segment_events(0, "bsp", "launcher", 0)
    backend.launch_command(handle, 0, [sys.executable, "-c", FAILING_LAUNCHER, stream, logs])
    event = first_event(trigger(layout, "bsp", handle, stall_seconds=60.0))
    assert isinstance(event, TaskFailedEvent)
    logged = capfd.readouterr()
    text = logged.out + logged.err
    assert "failed: the launcher exited with code 1 before writing result.json" in text
    assert (
        "the node that failed first: worker-2 on host h3 (its host or fork server stopped answering) at step "
        "3,100; its last 2 lines:\n  | worker 2 of segment 0 (bsp), pid 7\n  | step 3099\n"
        f"its log: {logs}/worker-2.log; every node's log: {logs}/"
    ) in text, text[-3000:]
    wait_for(lambda: statsd_here.received("airflow.syncswitch.segment.failed"), what="the failure's metric")
    (failed,) = statsd_here.received("airflow.syncswitch.segment.failed")
    assert failed.tags == {"job_name": "digits-demo", "protocol": "bsp", "segment": "0", "node": "worker-2"}
