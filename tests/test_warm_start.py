"""The WarmLocalExecutor's wait for a task's end: a worker's result, a deferred task that ended on the
triggerer, any other change of the running runs' task states (the scheduler's own upstream_failed,
a mark in the UI) or a newly triggered run ends it (a change since the previous wait ends the next
one at once); the database is asked every 0.2 s while a task is deferred and every 0.5 s otherwise. And
Airflow's task supervisor, which reaps a task process that closed its sockets without waiting out
a heartbeat interval."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from syncswitch_airflow.warm_start import (
    WaitingWork,
    reap_exiting_processes,
    reaps_exiting_processes,
    wait_for_an_end,
)


def work(deferred: int, newest_run: int, **states: int) -> WaitingWork:
    """What a look sees: ``deferred`` deferred task instances (and ``states``) in the running runs."""
    counts = {"deferred": deferred, **states} if deferred else states
    return WaitingWork(newest_run, tuple(sorted(counts.items())))


class Looks:
    """(deferred tasks, newest run id) as the database would answer, look after look (None: it did
    not answer)."""

    def __init__(self, *answers: tuple[int, int] | WaitingWork | None) -> None:
        self.answers = [work(*a) if isinstance(a, tuple) else a for a in answers]
        self.calls = 0

    def __call__(self) -> WaitingWork | None:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


def test_a_workers_result_ends_the_wait() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    timer = threading.Timer(0.1, writer.send, args=("task ended",))
    timer.start()
    try:
        assert wait_for_an_end(reader.poll, Looks((0, 7)), seconds=30.0)[0]
    finally:
        timer.cancel()
    assert reader.recv() == "task ended", "the wait must leave the result for the executor to read"


def test_a_deferred_task_that_ends_on_the_triggerer_ends_the_wait() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((2, 7), (2, 7), (2, 7), (1, 7))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, deferred_look_seconds=0.01) == (True, work(1, 7))
    assert looks.calls == 4


def test_a_triggered_run_ends_the_wait() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((0, 7), (0, 7), (0, 8))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, queued_look_seconds=0.01) == (True, work(0, 8))
    assert looks.calls == 3


def test_a_run_triggered_between_two_waits_ends_the_next_at_once() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((0, 8))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, since=work(0, 7)) == (True, work(0, 8))
    assert looks.calls == 1
    # Nothing new since the last look: the wait runs its time.
    assert wait_for_an_end(reader.poll, Looks((0, 8)), seconds=0.2, since=work(0, 8)) == (False, work(0, 8))


def test_a_state_the_scheduler_set_before_the_wait_ends_it_at_once() -> None:
    """The scheduler marks one slot upstream_failed per loop after a failed segment: each such change,
    made before the executor's wait, ends that wait at once, so that the next slot follows in the next
    loop rather than 5 s later. So does a clear or a mark in the UI during a wait."""
    reader, _writer = multiprocessing.Pipe(duplex=False)
    before = work(1, 7, failed=1, none=12)
    marked = work(1, 7, failed=1, upstream_failed=3, none=9)
    assert wait_for_an_end(reader.poll, Looks(marked), seconds=30.0, since=before) == (True, marked)
    cleared = work(1, 7, none=13)
    looks = Looks(marked, marked, cleared)
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, since=marked, deferred_look_seconds=0.01) == (
        True,
        cleared,
    )


LOOKING_DAG = """
import json, sys
from airflow.sdk import DAG, task
from syncswitch_airflow.warm_start import waiting_work

with DAG("warm_start_look", schedule=None) as dag:

    @task
    def before():
        pass

    @task
    def look():
        print("LOOK " + json.dumps(waiting_work().__dict__), file=sys.stderr)

    @task
    def after():
        pass

    before() >> look() >> after()
"""


@pytest.mark.usefixtures("airflow_db")
def test_a_look_counts_the_task_states_of_the_running_runs_in_airflows_database(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look's query against a real metadata database, from a task of a running run (dag.test()
    runs it in this process): its own task running, the one before it done, the one after it not yet
    scheduled. A look that failed would return None, and the wait would fall back to the plain one."""
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "warm_start_look.py").write_text(LOOKING_DAG)
    bundle = {"path": str(tmp_path), "refresh_interval": 0}
    classpath = "airflow.dag_processing.bundles.local.LocalDagBundle"
    # dag.test() finds the DAG through the configured bundles: this test's folder, for this test only.
    monkeypatch.setenv(
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST",
        json.dumps([{"name": "warm-start-look", "classpath": classpath, "kwargs": bundle}]),
    )
    bag = DagBag(dag_folder=str(tmp_path))
    assert bag.import_errors == {}
    bag.dags["warm_start_look"].test()
    [line] = [x for x in capfd.readouterr().err.splitlines() if x.startswith("LOOK ")]
    work = WaitingWork(**json.loads(line.removeprefix("LOOK ")))
    assert work.newest_run > 0
    assert {s: n for s, n in work.task_states} == {"success": 1, "running": 1, "none": 1}, work
    assert work.deferred == 0


def test_nothing_deferred_is_asked_less_often_and_a_silent_database_changes_nothing() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    idle, busy, silent = Looks((0, 7)), Looks((3, 7)), Looks(None, (0, 7), None)
    timing = {"seconds": 0.3, "deferred_look_seconds": 0.01, "queued_look_seconds": 0.1}
    assert wait_for_an_end(reader.poll, idle, **timing) == (False, work(0, 7))
    assert wait_for_an_end(reader.poll, busy, **timing) == (False, work(3, 7))
    assert 2 <= idle.calls <= 5 and busy.calls > 10
    assert not wait_for_an_end(reader.poll, silent, **timing)[0]


def _execution_api(request: httpx.Request) -> httpx.Response:
    """Airflow's execution API, as far as a supervisor asks it: the task's run context, then
    heartbeats and the final state."""
    if not request.url.path.endswith("/run"):
        return httpx.Response(204)
    now = "2026-01-01T00:00:00Z"
    dag_run = {
        "dag_id": "d", "run_id": "r", "logical_date": now, "start_date": now, "end_date": None,
        "data_interval_start": now, "data_interval_end": now, "run_after": now, "run_type": "manual",
        "state": "running", "partition_key": None, "consumed_asset_events": [],
    }  # fmt: skip
    return httpx.Response(200, json={"dag_run": dag_run, "max_tries": 0, "should_retry": False})


@pytest.fixture
def exit_check_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reap_exiting_processes`` wraps Airflow's exit check process-wide, by design: undone after
    the test."""
    from airflow.sdk.execution_time import supervisor

    monkeypatch.setattr(
        supervisor.WatchedSubprocess,
        "_check_subprocess_exit",
        supervisor.WatchedSubprocess._check_subprocess_exit,
    )


def _supervise(target: Callable[[], None]) -> Any:
    """Airflow's own task supervisor, forking a real process that runs ``target``."""
    from airflow.sdk.api.client import Client
    from airflow.sdk.api.datamodels._generated import BundleInfo, TaskInstance
    from airflow.sdk.execution_time import supervisor

    task = TaskInstance(
        id=uuid.uuid4(), task_id="t", dag_id="d", run_id="r", try_number=1, dag_version_id=uuid.uuid4()
    )
    execution_api = Client(
        base_url="http://execution-api", token="", transport=httpx.MockTransport(_execution_api)
    )
    return supervisor.ActivitySubprocess.start(
        what=task,
        dag_rel_path="d.py",
        bundle_info=BundleInfo(name="b", version=None),
        client=execution_api,
        target=target,
    )


def _close_every_socket_then_linger() -> None:
    """A task process's last moment, drawn out: its sockets to the supervisor are closed (as
    ``_fork_main``'s exit does), and it lives on for a moment before it exits."""
    os.closerange(0, 1024)
    time.sleep(0.2)


@pytest.mark.usefixtures("exit_check_restored")
def test_the_supervisor_reaps_a_task_process_once_its_sockets_have_closed() -> None:
    """Airflow's own supervisor, forking a real process: without the patch it would notice the exit
    only after a heartbeat interval (5 s by default) of select() on no socket at all."""
    from airflow.sdk.execution_time import supervisor

    reap_exiting_processes()
    reap_exiting_processes()  # a second call (a restarted executor) wraps nothing twice
    assert not hasattr(supervisor.WatchedSubprocess._check_subprocess_exit.__wrapped__, "__wrapped__")

    started = time.monotonic()
    process = _supervise(_close_every_socket_then_linger)
    assert process.wait() == 0
    assert time.monotonic() - started < supervisor.MIN_HEARTBEAT_INTERVAL


LISTENING_FILE_ENV = "SYNCSWITCH_TEST_LISTENING_FILE"


def _close_every_socket_when_interrupted_then_linger() -> None:
    """A trigger runner's stop, drawn out: on SIGINT it closes its sockets to the supervisor (its
    ``finally``) and lives on for a moment before it exits."""
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    with open(os.environ[LISTENING_FILE_ENV], "w"):  # the test signals it from now on
        pass
    deadline = time.monotonic() + 60
    while not interrupted and time.monotonic() < deadline:
        time.sleep(0.05)
    os.closerange(0, 1024)
    time.sleep(0.2)


@pytest.mark.usefixtures("exit_check_restored")
def test_the_supervisor_reaps_a_process_it_stops_once_its_sockets_have_closed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The triggerer stops its trigger runner with ``kill``: SIGINT, then a select() until the
    escalation delay is out. Without the patch, a runner that closed its sockets before it could be
    reaped was noticed only when that delay ran out (10 s, in one stop of the embedded Airflow in
    three)."""
    reap_exiting_processes()
    listening = tmp_path / "listening"
    monkeypatch.setenv(LISTENING_FILE_ENV, str(listening))
    process = _supervise(_close_every_socket_when_interrupted_then_linger)
    deadline = time.monotonic() + 60  # a SIGINT before its handler is in place kills it outright
    while not listening.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    escalation_delay = 10.0
    started = time.monotonic()
    process.kill(signal.SIGINT, escalation_delay=escalation_delay, force=True)
    assert process._exit_code == 0  # it ended on the SIGINT, not on an escalation
    assert time.monotonic() - started < escalation_delay / 2


@pytest.mark.usefixtures("exit_check_restored")
def test_the_embedded_triggerer_reaps_its_runner_once_its_sockets_have_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import airflow.__main__
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor
    from syncswitch_airflow.embedded import triggerer

    # Restored after the test: the patch is process-wide by design.
    monkeypatch.setattr(TriggerRunnerSupervisor, "start", TriggerRunnerSupervisor.start)
    monkeypatch.setattr(airflow.__main__, "main", lambda: 0)
    monkeypatch.setattr("sys.argv", ["triggerer"])
    assert not reaps_exiting_processes()
    assert triggerer.main() == 0
    assert reaps_exiting_processes()
