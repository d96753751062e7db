"""Task processes that start warm, under the LocalExecutor and under Celery.

Airflow runs each task in a process forked from an executor's worker: a LocalExecutor worker is
itself forked from the scheduler, a Celery pool process from the Celery worker's main process.
``WARM_IMPORTS`` (Airflow's task runner and DAG parsing, our DAG's modules) are imported in that
parent before it forks, so no task process imports them again: a run's task processes share the
cores of its training. Each task still parses its DAG file, so a changed job file or DAG file shows
at once; a changed *module* of this package shows once the scheduler (or Celery worker) restarts, as
with any executor that keeps its workers.

The WarmLocalExecutor starts the next task as soon as one ends, where the scheduler would notice the
end only on its next loop, after an idle sleep (``[scheduler] scheduler_idle_sleep_time``), and every
switch gap holds such a change-over. Its heartbeat waits up to ``RESULT_WAIT_SECONDS`` for a
worker's result unless it has just handed out work, and the embedded Airflow's idle sleep is the rest
of the scheduler's loop. The wait ends at once when

- a worker reports a task's end;
- the task states of the running DAG runs change (how many task instances are in each state: one
  grouped count, read every ``DEFERRED_LOOK_SECONDS`` while any is deferred), as a task that ends on
  the triggerer (a segment task: ``end_from_trigger``) and a state that the scheduler or a user sets
  send no result to a worker;
- a DAG run newer than the newest one the last look saw exists (read with the states, every
  ``QUEUED_LOOK_SECONDS`` while no task is deferred), as a newly triggered run sends nothing either.

What a look saw is remembered from one wait to the next, so a change made while the scheduler was
busy (its own ``upstream_failed`` after a failed segment) ends the next wait at once. What none of
these covers (a scheduled run's creation, the scheduler's timers) waits for the loop's end.

``reap_exiting_processes`` makes Airflow's supervisor wait for a task process whose sockets have all
closed, rather than sleep its heartbeat interval (``[workers] min_heartbeat_interval``): the process
closes them as its last act, a moment before it can be reaped, so a poll that comes first leaves its
next ``select()`` nothing to wake it. The triggerer's supervisor has the same race when it stops its
trigger runner (``kill``: a select() on no socket until the escalation delay is out), so the embedded
triggerer applies it too (``embedded/triggerer.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# An executor and the scheduler's metadata database are Airflow's core, which airflow.sdk (the task
# authors' interface) does not expose; its states are core's too (the SDK has classes of its own).
from airflow.executors.local_executor import LocalExecutor
from airflow.utils.state import DagRunState, TaskInstanceState

log = logging.getLogger(__name__)

# Longest an executor heartbeat waits for a worker's result; with the embedded Airflow's idle sleep
# (embedded/instance.py: IDLE_SLEEP_SECONDS) it makes the scheduler's idle loop. Everything a run waits
# for ends the wait (a task's end, a deferred task's end, a new run), so the loop can be long, and
# a long loop costs the scheduler less CPU beside training.
RESULT_WAIT_SECONDS = 4.8
# How often that wait looks at the database (the deferred tasks' count on the ti_state index, the
# newest run's primary key): while a task is deferred, and while none is.
DEFERRED_LOOK_SECONDS = 0.2
QUEUED_LOOK_SECONDS = 0.5
# How often the executor makes sure a standby fork server waits for the next local cluster.
STANDBY_LOOK_SECONDS = 2.0
# Longest a supervisor waits for a task process whose sockets have all closed (it is exiting, and is
# reaped within milliseconds); after it, the supervisor goes on as Airflow's own.
EXITING_PROCESS_WAIT_SECONDS = 0.5

# What a task process needs before it runs a line of ours, then our DAG files' own modules, then
# what the report task draws with (every run's report task imports it).
WARM_IMPORTS = (
    "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.task_runner",
    "airflow.dag_processing.bundles.manager",
    "airflow.dag_processing.dagbag",
    "syncswitch_airflow.dag_factory",
    "syncswitch_airflow.job_files",
    "syncswitch_airflow.report",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)


def import_warm_modules() -> None:
    """Import ``WARM_IMPORTS`` into this process (and so into every process it forks later)."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)


def reap_exiting_processes() -> None:
    """Make Airflow's supervisors (of task processes and of the trigger runner, in this process and
    those it forks) wait for a process whose sockets have all closed, instead of polling for its exit
    a heartbeat interval (or, when stopping it, an escalation delay) later."""
    from airflow.sdk.execution_time.supervisor import WatchedSubprocess

    if reaps_exiting_processes():
        return
    check_exit = WatchedSubprocess._check_subprocess_exit

    @functools.wraps(check_exit)
    def check_exit_of_exiting_process(self: Any, *args: Any, **kwargs: Any) -> int | None:
        if self._exit_code is None and not self._open_sockets:
            # Every socket closed: the process is in its last moment (os._exit). One that closed them
            # and goes on costs this wait's timeout, then the supervisor polls on as Airflow's does.
            with contextlib.suppress(self._process.TimeoutExpired):
                self._process.wait(timeout=EXITING_PROCESS_WAIT_SECONDS)
        return check_exit(self, *args, **kwargs)

    check_exit_of_exiting_process.waits_for_exiting_process = True  # type: ignore[attr-defined]
    WatchedSubprocess._check_subprocess_exit = check_exit_of_exiting_process


def reaps_exiting_processes() -> bool:
    """Whether ``reap_exiting_processes`` is in effect in this process."""
    from airflow.sdk.execution_time.supervisor import WatchedSubprocess

    return bool(getattr(WatchedSubprocess._check_subprocess_exit, "waits_for_exiting_process", False))


class WarmLocalExecutor(LocalExecutor):
    """Airflow's LocalExecutor, whose workers fork from a scheduler that has imported
    ``WARM_IMPORTS``, whose heartbeat returns as soon as a task ends (see above), and which keeps a
    standby fork server for the next local cluster (``backends.local.StandbyForkServer``):
    ``[core] executor = syncswitch_airflow.warm_start.WarmLocalExecutor``."""

    def start(self) -> None:
        from syncswitch_airflow.backends.local import StandbyForkServer

        import_warm_modules()
        reap_exiting_processes()
        self._handed_out_work = False
        self._waiting: WaitingWork | None = None
        self._standby = StandbyForkServer()
        self._standby_looked_at = 0.0
        super().start()
        self._keep_standby()

    def _process_workloads(self, workload_list: Any) -> None:
        self._handed_out_work = True
        super()._process_workloads(workload_list)

    def sync(self) -> None:
        # Just handed out tasks: the scheduler may have more to schedule, so no wait.
        if not self._handed_out_work:
            # SimpleQueue.get() takes no timeout; its pipe's poll() (what SimpleQueue.empty() asks) does.
            _ended, self._waiting = wait_for_an_end(
                self.result_queue._reader.poll, waiting_work, RESULT_WAIT_SECONDS, since=self._waiting
            )
        self._handed_out_work = False
        super().sync()
        if time.monotonic() - self._standby_looked_at >= STANDBY_LOOK_SECONDS:
            self._keep_standby()

    def end(self) -> None:
        super().end()
        self._standby.stop()

    def terminate(self) -> None:
        super().terminate()
        self._standby.stop()

    def _keep_standby(self) -> None:
        self._standby_looked_at = time.monotonic()
        try:
            self._standby.keep()
        except Exception as exc:  # noqa: BLE001 - a shortcut too: it must never stop the scheduler
            log.warning("cannot keep a standby fork server: %s", exc)


@dataclass(frozen=True)
class WaitingWork:
    """What one look at the database saw: the newest DAG run's id, and how many task instances of the
    running DAG runs are in each state (``none`` for no state yet)."""

    newest_run: int
    task_states: tuple[tuple[str, int], ...] = ()

    @property
    def deferred(self) -> int:
        return dict(self.task_states).get(TaskInstanceState.DEFERRED.value, 0)


def waiting_work() -> WaitingWork | None:
    """What the running DAG runs wait for now; None where the database does not answer (the wait is
    then the plain one: this is only a shortcut, and must never stop the scheduler)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import and_, func

    of_its_run = and_(DagRun.dag_id == TaskInstance.dag_id, DagRun.run_id == TaskInstance.run_id)
    try:
        with create_session() as session:
            counts = (
                session.query(TaskInstance.state, func.count())
                .join(DagRun, of_its_run)
                .filter(DagRun.state == DagRunState.RUNNING)
                .group_by(TaskInstance.state)
                .all()
            )
            newest_run = session.query(DagRun.id).order_by(DagRun.id.desc()).limit(1).scalar()
        states = tuple(sorted((str(getattr(state, "value", state) or "none"), n) for state, n in counts))
        return WaitingWork(newest_run or 0, states)
    except Exception as exc:  # noqa: BLE001 - e.g. a locked or restarting database
        log.debug("cannot read the running runs' task states or the newest run: %s", exc)
        return None


def wait_for_an_end(
    result_ready: Callable[[float], bool],
    look: Callable[[], WaitingWork | None],
    seconds: float,
    *,
    since: WaitingWork | None = None,
    deferred_look_seconds: float = DEFERRED_LOOK_SECONDS,
    queued_look_seconds: float = QUEUED_LOOK_SECONDS,
) -> tuple[bool, WaitingWork | None]:
    """Wait up to ``seconds`` for a worker's result (``result_ready(timeout)``) or for ``look()``
    (``waiting_work``) to differ from what was seen ``since`` (the previous wait's last look; this
    one's first when None). Looks every ``deferred_look_seconds`` while a task is deferred,
    else every ``queued_look_seconds``. Returns (whether either came before the time was up, the
    last look), where a look that fails counts as no change."""
    deadline = time.monotonic() + seconds
    seen = look()
    if since is not None and seen is not None and seen != since:
        return True, seen
    while (left := deadline - time.monotonic()) > 0:
        interval = deferred_look_seconds if seen and seen.deferred else queued_look_seconds
        if result_ready(min(left, interval)):
            return True, seen
        now = look()
        if now is not None and seen is not None and now != seen:
            return True, now
        if seen is None:  # the first look failed: this one is the baseline
            seen = now
    return False, seen
