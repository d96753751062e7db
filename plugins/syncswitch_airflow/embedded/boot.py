"""Waiting for a started embedded Airflow to serve: every component healthy on our own port, the
execution API built, the DAGs parsed and free of import errors (``EmbeddedAirflow.start``).

A boot's length depends on how loaded the machine is, so the deadline only guards against waiting
forever (``$SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT``), and a progress line every ``_PROGRESS_EVERY_S`` says
what the boot still waits for.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Protocol

from syncswitch import procs

from syncswitch_airflow.embedded.airflow_api import AirflowApi, AirflowError, AirflowUnavailable, quote
from syncswitch_airflow.embedded.instance import InstanceRecord
from syncswitch_airflow.embedded.supervisor import read_status


class Booting(Protocol):
    """What the wait for a started instance needs of it (``EmbeddedAirflow`` is one)."""

    home: Path
    log_path: Path
    dags_folder: Path

    @property
    def url(self) -> str: ...

    @property
    def api(self) -> AirflowApi: ...

    def record(self) -> InstanceRecord: ...

    def check_alive(self) -> None: ...

    def command(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]: ...


BOOT_TIMEOUT_ENV = "SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT"
DEFAULT_BOOT_TIMEOUT_S = 1800.0
_PROGRESS_EVERY_S = 15.0
_COMPONENTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")

_log = logging.getLogger(__name__)


class DagImportError(AirflowError):
    """A DAG file in the project's dags folder does not import; the message holds the traceback."""


def boot_timeout() -> float:
    """``$SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT`` seconds, or 30 minutes."""
    raw = os.environ.get(BOOT_TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_BOOT_TIMEOUT_S
    except ValueError:
        raise AirflowError(f"{BOOT_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None


def wait_for_dags(
    airflow: Booting, dag_ids: tuple[str, ...], deadline: float, spawned_at: float | None = None
) -> None:
    """Once healthy (:func:`wait_healthy`): ``dag_ids`` ready by ``deadline``, parsed from the files as
    they are now. An instance started at ``spawned_at`` (a time.time()) is waited for until its
    dag-processor has parsed them, which it does as it starts; a reused one (None) reserializes them."""
    # The api-server builds the execution API (the one tasks call) on its first request, which the
    # first task of the first run would wait for: build it while the DAGs parse.
    warm_up = threading.Thread(
        target=_warm_execution_api, args=(airflow,), name="warm-execution-api", daemon=True
    )
    warm_up.start()
    if spawned_at is None:  # a fresh one has just parsed them: no `airflow dags reserialize`
        reserialize(airflow, deadline)
    for dag_id in dag_ids:
        wait_for_dag(airflow, dag_id, deadline, parsed_after=spawned_at)
    warm_up.join(max(deadline - time.monotonic(), 0.0))


def wait_healthy(airflow: Booting, deadline: float) -> None:
    """Until the health endpoint reports every component healthy, on a port our api-server holds."""
    started = time.monotonic()
    next_report = started + _PROGRESS_EVERY_S
    waiting_for = "no answer yet"
    while True:
        airflow.check_alive()
        try:
            health = airflow.api.health()
        except (OSError, AirflowError):
            waiting_for = "the api-server to answer"
        else:
            unhealthy = sorted(c for c in _COMPONENTS if (health.get(c) or {}).get("status") != "healthy")
            if not unhealthy:
                _check_port_is_ours(airflow)
                _log.info("embedded Airflow healthy at %s", airflow.url)
                return
            waiting_for = f"{', '.join(unhealthy)} to report healthy"
        now = time.monotonic()
        if now >= deadline:
            raise AirflowError(
                f"Airflow not healthy after {now - started:.0f} s: waiting for {waiting_for} "
                f"(raise ${BOOT_TIMEOUT_ENV} on a busy machine); see {airflow.log_path}"
            )
        if now >= next_report:
            next_report = now + _PROGRESS_EVERY_S
            status = read_status(airflow.home)
            phase = status.get("phase", "starting") if status else "starting"
            _log.info(
                "embedded Airflow booting for %.0f s (%s): waiting for %s", now - started, phase, waiting_for
            )
        time.sleep(1.0)


def _check_port_is_ours(airflow: Booting) -> None:
    """A healthy answer on our port could come from another Airflow that took the port between
    pick_port() and our api-server's bind; then everything we do would go to the wrong instance."""
    record = airflow.record()
    owners = procs.listening_pids(record.port)
    if owners is not None and not owners & set(procs.processes_in_group(record.pid)):
        raise AirflowError(
            f"port {record.port} is served by process(es) {sorted(owners)}, not by this Airflow in "
            f"{airflow.home}; our api-server could not bind it (see {airflow.log_path}). Run again."
        )


def _warm_execution_api(airflow: Booting) -> None:
    try:
        airflow.api.request("GET", "/execution/health", auth=False)
    except (OSError, AirflowError) as exc:  # only a warm-up: the first task pays for it instead
        _log.debug("execution API warm-up failed: %s", exc)


def reserialize(airflow: Booting, deadline: float) -> None:
    """Parse the dags folder now instead of waiting for the dag-processor's next refresh."""
    _log.info("reserializing DAGs from %s", airflow.dags_folder)
    try:
        result = airflow.command("dags", "reserialize", timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        raise AirflowError("`airflow dags reserialize` did not finish in time") from None
    if result.returncode != 0:
        raise AirflowError(f"`airflow dags reserialize` failed:\n{(result.stderr or result.stdout)[-3000:]}")


def wait_for_dag(airflow: Booting, dag_id: str, deadline: float, parsed_after: float | None = None) -> None:
    """Until ``dag_id`` is serialized, active and free of import errors; with ``parsed_after`` (a
    time.time()), parsed since then, and only import errors recorded since then count: what a
    previous instance in the same home recorded is about files that may have changed."""
    unanswered = False
    while time.monotonic() < deadline:
        airflow.check_alive()
        try:
            errors = [e for e in airflow.api.import_errors() if _since(e.get("timestamp"), parsed_after)]
            status, dag = airflow.api.request("GET", f"/api/v2/dags/{quote(dag_id)}")
        # A healthy api-server can still be too busy to answer in time just after its start (on a
        # loaded machine): wait on for the DAG.
        except (OSError, AirflowUnavailable) as exc:
            if not unanswered:
                _log.info("the Airflow API did not answer (%s); waiting for DAG %s", exc, dag_id)
            unanswered = True
            time.sleep(1.0)
            continue
        if errors:
            raise DagImportError(
                "DAG import errors in the dags folder:\n"
                + "\n".join(f"{e.get('filename')}:\n{e.get('stack_trace', '').rstrip()}" for e in errors)
            )
        if (
            status == 200
            and not dag.get("is_stale", False)
            and _since(dag.get("last_parsed_time"), parsed_after)
        ):
            _log.info("DAG %s is ready", dag_id)
            return
        time.sleep(0.5)
    raise AirflowError(f"DAG {dag_id!r} did not appear in {airflow.dags_folder}; see {airflow.log_path}")


def _since(timestamp: str | None, moment: float | None) -> bool:
    """Whether an API timestamp (ISO 8601) is at or after ``moment`` (a time.time(); None: any)."""
    if moment is None:
        return True
    if not timestamp:
        return False
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() >= moment
