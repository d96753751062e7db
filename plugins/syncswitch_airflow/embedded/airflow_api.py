"""A client of one Airflow's REST API (``/api/v2``), logged in as one user: DAG runs, task instances,
backfills. It knows nothing of how that Airflow runs (``syncswitch_airflow.embedded.airflow`` owns the
processes of the embedded one and hands out its client as ``EmbeddedAirflow.api``); its transport,
the login and the retries are ``airflow_http.AirflowSession``'s.

Every call rides out an api-server that does not answer for a while (a supervisor restarting a hung
one; a 5xx: its database restarting, failing over or locked): it tries again for up to two minutes.
A trigger is retried too: its run id is its own, so a retry that finds that id taken with this conf
has found the run its lost first try started. Exceptions: the boot-time probes (``health``,
``import_errors``: their callers poll), a clear (sent again only when nothing can have happened) and
a backfill's creation (its own retries, ``create_backfill``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from syncswitch_airflow.embedded.airflow_http import (
    AirflowError,
    AirflowSession,
    AirflowUnavailable,
    error_text,
    quote,
    raise_for,
)

__all__ = [
    "FINISHED_TASK_STATES",
    "TERMINAL_RUN_STATES",
    "AirflowApi",
    "AirflowError",
    "AirflowUnavailable",
    "TriggerRejected",
    "quote",
]

TERMINAL_RUN_STATES = ("success", "failed")
# Task instance states after which a task of a run ends and will not run again.
FINISHED_TASK_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")
BACKFILL_ATTEMPTS = 4
BACKFILL_RETRY_SECONDS = 5.0


class TriggerRejected(AirflowError):
    """The API refused a DAG run (HTTP 400/422): the message is the API's own text, naming the param."""


class AirflowApi(AirflowSession):
    """Airflow's REST API at ``url`` as ``username`` (``AirflowSession``): runs, tasks, backfills."""

    def health(self) -> dict[str, Any]:
        """Every component's status (``/api/v2/monitor/health``; no login needed). One try."""
        return self.get_once("/api/v2/monitor/health", auth=False)

    def import_errors(self) -> list[dict[str, Any]]:
        """The DAG files that do not import, with their tracebacks. One try."""
        return self.get_once("/api/v2/importErrors?limit=100").get("import_errors", [])

    def unpause(self, dag_id: str) -> None:
        self.set_paused(dag_id, False)

    def pause(self, dag_id: str) -> None:
        self.set_paused(dag_id, True)

    def set_paused(self, dag_id: str, paused: bool) -> None:
        def patch() -> None:
            status, body = self.request("PATCH", f"/api/v2/dags/{quote(dag_id)}", {"is_paused": paused})
            if status != 200:
                what = "pausing" if paused else "unpausing"
                raise_for(status, f"{what} {dag_id} answered {status}: {error_text(body)}")

        self.answered(patch)

    def trigger(self, dag_id: str, conf: dict[str, Any], unpause: bool = True) -> str:
        """Unpause ``dag_id`` (unless told not to: a paused DAG's run stays queued) and start a run
        with ``conf``; returns the run id."""
        if unpause:
            self.unpause(dag_id)
        # Due at once: the scheduler starts a run once run_after <= the database's now(), which
        # SQLite compares as text in whole seconds ("12:00:03" < "12:00:03.000000"), so Airflow's
        # default (now, with microseconds) made every run wait for the next second or two. The
        # second before this one is past by any clock. The run id keeps Airflow's form and the
        # microseconds, so that runs triggered within one second (a sweep) still get distinct ids.
        now = datetime.datetime.now(datetime.UTC)
        due = now.replace(microsecond=0) - datetime.timedelta(seconds=1)
        request = {
            "dag_run_id": f"manual__{now.isoformat()}",
            "logical_date": None,
            "run_after": due.isoformat(),
            "conf": conf,
        }
        run_id = self.answered(lambda: self._post_run(dag_id, request))
        self._log.info("triggered %s run %s", dag_id, run_id)
        return run_id

    def _post_run(self, dag_id: str, request: dict[str, Any]) -> str:
        """One try of a trigger. A 409 for its own run id with its own conf means that an earlier try
        got in and only its answer was lost (a timeout, a restart): that run is the one asked for."""
        status, body = self.request("POST", f"/api/v2/dags/{quote(dag_id)}/dagRuns", request)
        if status in (400, 422):
            raise TriggerRejected(error_text(body))
        if status == 409:
            found = self.get_once(f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(request['dag_run_id'])}")
            if found.get("conf") == request["conf"]:
                self._log.info("run %s of %s was started by an earlier try", found["dag_run_id"], dag_id)
                return found["dag_run_id"]
        if status != 200:
            raise_for(status, f"triggering {dag_id} answered {status}: {error_text(body)}")
        return body["dag_run_id"]

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """One run's record: state, conf, and Airflow's own timestamps (queued_at, start_date, end_date)."""
        return self.get_json(f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}")

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.dag_run(dag_id, run_id)["state"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        """task_id -> state (None before the scheduler looks at it) for the run's task instances."""
        body = self.get_json(f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}/taskInstances?limit=1000")
        return {ti["task_id"]: ti.get("state") for ti in body.get("task_instances", [])}

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        """Every run of ``dag_id`` (run id, state, conf, logical date, run type)."""
        return self.get_json(f"/api/v2/dags/{quote(dag_id)}/dagRuns?limit=1000").get("dag_runs", [])

    def backfills(self, dag_id: str) -> list[dict[str, Any]]:
        """The backfills of ``dag_id``; ``completed_at`` is set by the scheduler (every 30 s) once all
        their runs have finished, and only then may another backfill of the DAG be created."""
        return self.get_json(f"/api/v2/backfills?dag_id={quote(dag_id)}&limit=1000").get("backfills", [])

    def create_backfill(
        self,
        dag_id: str,
        from_date: str,
        to_date: str,
        *,
        reprocess_behavior: str = "none",
        max_active_runs: int = 10,
    ) -> dict[str, Any]:
        """``POST /api/v2/backfills``: runs of ``dag_id`` for the schedule's dates in [from, to].

        On SQLite (the embedded Airflow) a write that meets the scheduler's is refused with 503
        "Database is locked". Airflow has committed the backfill itself by then, rolls its runs back
        and deletes it "so the user can retry" (models/backfill.py), but that clean-up can meet the
        lock too and leave the backfill, unfinished and empty, in the way of any other. This tries
        again, a few times: first cancelling what its own refused request left (a backfill that
        was not there before, while no run of the DAG was queued afresh), or returning it where its
        runs did get in after all."""
        request = {
            "dag_id": dag_id,
            "from_date": from_date,
            "to_date": to_date,
            "reprocess_behavior": reprocess_behavior,
            "max_active_runs": max_active_runs,
        }
        known = {backfill["id"] for backfill in self.backfills(dag_id)}
        queued_before = self._queued_at(dag_id)
        for attempt in range(1, BACKFILL_ATTEMPTS + 1):
            status, body = self.request("POST", "/api/v2/backfills", request)
            locked = status == 503 and "locked" in error_text(body).lower()
            if not locked or attempt == BACKFILL_ATTEMPTS:
                break
            self._log.info("creating a backfill of %s met a locked database; again (%d)", dag_id, attempt)
            time.sleep(BACKFILL_RETRY_SECONDS)
            left = [b for b in self.backfills(dag_id) if not b.get("completed_at") and b["id"] not in known]
            if left and self._queued_at(dag_id) != queued_before:
                status, body = 200, left[0]  # its runs got in: the backfill is there after all
                break
            for backfill in left:
                self._cancel_backfill(backfill["id"])
        if status != 200:
            raise AirflowError(f"creating a backfill of {dag_id} answered {status}: {error_text(body)}")
        self._log.info("backfill %s of %s from %s to %s", body.get("id"), dag_id, from_date, to_date)
        return body

    def _queued_at(self, dag_id: str) -> dict[str, str | None]:
        """run id -> when it was last queued: a backfill's new or cleared runs change it."""
        return {run["dag_run_id"]: run.get("queued_at") for run in self.dag_runs(dag_id)}

    def _cancel_backfill(self, backfill_id: int) -> None:
        """Cancel an empty backfill that a refused create left behind (see create_backfill)."""
        status, body = self.request("PUT", f"/api/v2/backfills/{backfill_id}/cancel")
        if status == 200:
            self._log.info("cancelled backfill %s, left empty by a refused create", backfill_id)
        else:  # the next attempt is refused while it stays, and says so
            self._log.info("cancelling backfill %s answered %s: %s", backfill_id, status, error_text(body))

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, new_state: str) -> None:
        """Mark one task instance by hand, as the UI's "Mark as" does."""
        path = f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}/taskInstances/{quote(task_id)}"

        def patch() -> None:
            status, body = self.request("PATCH", path, {"new_state": new_state})
            if status != 200:
                raise_for(status, f"marking {task_id} {new_state} answered {status}: {error_text(body)}")

        self.answered(patch)
        self._log.info("marked %s of run %s %s", task_id, run_id, new_state)

    def clear_tasks(
        self, dag_id: str, run_id: str, task_ids: list[str], include_downstream: bool = False
    ) -> list[str]:
        """Clear task instances of a run, as the UI's "Clear" does (with its "Downstream" option:
        ``include_downstream``); returns what was cleared."""
        payload = {
            "dag_run_id": run_id,
            "task_ids": task_ids,
            "dry_run": False,
            "only_failed": False,
            "include_downstream": include_downstream,
        }

        def post() -> dict[str, Any]:
            status, body = self.request("POST", f"/api/v2/dags/{quote(dag_id)}/clearTaskInstances", payload)
            if status != 200:
                raise_for(status, f"clearing {task_ids} answered {status}: {error_text(body)}")
            return body

        # Tried again after a 5xx (the clear was rolled back), not after a lost answer: a clear that
        # did happen, done again, would clear the tasks it had started again.
        body = self.answered(post, resend_unanswered=False)
        cleared = sorted(ti["task_id"] for ti in body.get("task_instances", []))
        self._log.info("cleared %s of run %s", ", ".join(cleared), run_id)
        return cleared

    def mark_failed(self, dag_id: str, run_id: str) -> None:
        """Fail the run by hand, as the UI's "Mark run as failed" does: Airflow fails its running
        tasks and skips the pending ones but the teardown tasks, which run; with a teardown pending
        the run's state is left to them (and to the leaves) rather than set at once."""
        status, body = self.request(
            "PATCH", f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}", {"state": "failed"}
        )
        if status != 200:
            raise_for(status, f"marking {run_id} failed answered {status}: {error_text(body)}")
        self._log.info("marked %s run %s failed", dag_id, run_id)

    def fail_run(
        self, dag_id: str, run_id: str, teardown_seconds: float = 120.0, poll_seconds: float = 2.0
    ) -> bool:
        """Fail the run by hand and wait until it has ended, and every task of it: Airflow runs its
        teardown tasks after the mark, and a cluster must not outlive its run. Whether it did within
        ``teardown_seconds``."""
        # A Ctrl-C during an api-server restart must still stop the run: the mark and the polls wait
        # for the API. Marking again after a reset is harmless (the state is the same).
        self.answered(lambda: self.mark_failed(dag_id, run_id))
        deadline = time.monotonic() + teardown_seconds
        while time.monotonic() < deadline:
            state, tasks = self._run_and_tasks(dag_id, run_id)
            if state in TERMINAL_RUN_STATES and all(task in FINISHED_TASK_STATES for task in tasks.values()):
                return True
            time.sleep(poll_seconds)
        return False

    def wait(
        self,
        dag_id: str,
        run_id: str,
        timeout: float = 3600.0,
        poll_seconds: float = 2.0,
        on_poll: Callable[[str, dict[str, str | None]], None] | None = None,
    ) -> str:
        """Poll until the run is success or failed; returns that state. ``on_poll`` sees every poll.

        An api-server that does not answer for a while (the supervisor is restarting it) is waited
        for; AirflowGone when the instance itself is gone."""
        deadline = time.monotonic() + timeout
        while True:
            state, tasks = self._run_and_tasks(dag_id, run_id)
            if on_poll is not None:
                on_poll(state, tasks)
            if state in TERMINAL_RUN_STATES:
                return state
            if time.monotonic() >= deadline:
                raise AirflowError(f"run {run_id} still {state} after {timeout:.0f} s")
            time.sleep(poll_seconds)

    def _run_and_tasks(self, dag_id: str, run_id: str) -> tuple[str, dict[str, str | None]]:
        return self.run_state(dag_id, run_id), self.task_states(dag_id, run_id)
