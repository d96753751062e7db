"""An embedded Airflow in the project folder: its processes, supervised; its REST API as ``.api``.

    airflow = EmbeddedAirflow(project_dir)
    airflow.start()                       # or reuse the one already running in <project>/.airflow
    run_id = airflow.api.trigger("sync_switch", conf)     # syncswitch_airflow.embedded.airflow_api.AirflowApi
    airflow.api.wait("sync_switch", run_id)
    airflow.stop()

The instance lives in ``<project>/.airflow`` (AIRFLOW_HOME): SQLite, LocalExecutor, the project's
``dags/`` and ``plugins/``, sized for a 2-core machine. Its components (scheduler, dag-processor,
triggerer, api-server) run under ``syncswitch_airflow.embedded.supervisor``, which restarts any that
dies and says so in ``embedded.log``. Its files, ports and settings are ``instance.py``'s; waiting
for it to serve is ``boot.py``'s; its REST client is ``airflow_api.py``'s. This module talks to
Airflow over HTTP and processes only; it never imports Airflow, so the CLI starts fast and bad flags
fail before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from syncswitch import procs

from syncswitch_airflow.embedded import boot
from syncswitch_airflow.embedded.airflow_api import AirflowApi, AirflowError
from syncswitch_airflow.embedded.instance import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    INSTANCE_ENV,
    InstanceHome,
    InstanceRecord,
    free_ports,
    instance_marker,
    pick_port,
)
from syncswitch_airflow.embedded.supervisor import clock, read_status


class AirflowGone(AirflowError):
    """The embedded Airflow (its supervisor) is no longer running."""


# Process states in which a component cannot serve and nothing of the instance will change that.
STUCK_STATES = {"T": "stopped (T)", "t": "stopped by a tracer (t)", "Z": "a zombie (Z)"}


class EmbeddedAirflow:
    """One supervised Airflow (a process group) serving ``project_dir``'s DAGs on 127.0.0.1."""

    def __init__(
        self,
        project_dir: str | os.PathLike[str],
        home: str | os.PathLike[str] | None = None,
        port: int | None = None,
        settings: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        """``port``: the API port for a new instance; None = 8080 when free, else any; 0 = any free.
        ``settings``: ``SECTION__KEY`` -> value, over ours (benchmarks compare settings with it).
        ``python``: the interpreter of another environment to run Airflow from (default: this one)."""
        self.project_dir = Path(project_dir).resolve()
        self.requested_port = port
        self.settings_overrides = dict(settings or {})
        self.home = Path(home).resolve() if home is not None else self.project_dir / ".airflow"
        self.python = python or sys.executable
        self.files = InstanceHome(self.home, self.project_dir, self.python)
        self.dags_folder = self.files.dags_folder
        self.log_path = self.home / "embedded.log"
        self.pid_file = self.home / "embedded.json"
        self._lock_file = self.home / "embedded.lock"
        self._log = logging.getLogger(__name__)
        self._process: subprocess.Popen[bytes] | None = None
        self._record: InstanceRecord | None = None
        self._api: AirflowApi | None = None
        self.started_here = False

    # ---- configuration ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.record().port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, record: InstanceRecord | None = None) -> dict[str, str]:
        """The environment every Airflow process of this instance runs with (``instance.InstanceHome``)."""
        return self.files.env(record or self.record(), self.settings_overrides)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, wait_for_dags: tuple[str, ...] = ("sync_switch",), timeout: float | None = None) -> None:
        """Start (or reuse) the instance, wait for health, then for ``wait_for_dags`` parsed from the
        DAG files as they are now (``boot.wait_for_dags``).

        ``timeout`` (default ``$SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT`` or 30 minutes) bounds the whole boot;
        a progress line every 15 s says what it is still waiting for."""
        self.home.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + (timeout if timeout is not None else boot.boot_timeout())
        with self._start_lock():
            record = self.running_instance()
            spawned_at = None
            if record is not None:
                self._record = record
                self._log.info("reusing embedded Airflow pid %d at %s", record.pid, self.url)
            else:
                spawned_at = time.time()
                self._spawn()
            boot.wait_healthy(self, deadline)
        boot.wait_for_dags(self, wait_for_dags, deadline, spawned_at)

    def _spawn(self) -> None:
        api_port = pick_port(self.requested_port)
        log_ports = free_ports(2, exclude={api_port})
        record = InstanceRecord(0, api_port, *log_ports, str(self.home), time.time())
        self.files.write_password_file()
        self._log.info("starting the embedded Airflow on 127.0.0.1:%d, home %s", api_port, self.home)
        with open(self.log_path, "ab") as log:
            # Own session: stop() can wait for (and at worst SIGKILL) the whole process group, and a
            # Ctrl-C in the terminal reaches only the CLI, which then stops Airflow in order.
            self._process = subprocess.Popen(
                [self.python, "-m", "syncswitch_airflow.embedded.supervisor"],
                cwd=self.project_dir,
                env=self.env(record),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._record = dataclasses.replace(record, pid=self._process.pid)
        self.pid_file.write_text(json.dumps(dataclasses.asdict(self._record)) + "\n")
        self.started_here = True

    @contextlib.contextmanager
    def _start_lock(self) -> Iterator[None]:
        # Two CLIs started at once must not both spawn a standalone in the same home.
        with open(self._lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def running_instance(self) -> InstanceRecord | None:
        """The record of a live standalone of this home, or None (a stale pid file is ignored)."""
        try:
            record = InstanceRecord(**json.loads(self.pid_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        if record.home != str(self.home) or not procs.has_env(
            record.pid, INSTANCE_ENV, instance_marker(record)
        ):
            return None
        return record

    def is_running(self) -> bool:
        return self.running_instance() is not None

    def record(self) -> InstanceRecord:
        """The running instance's record (following one that another process restarted), or raise."""
        if self._record is None or not procs.is_alive(self._record.pid):
            self._adopt(self.running_instance())
        if self._record is None:
            raise AirflowError(f"no embedded Airflow is running in {self.home}")
        return self._record

    def _adopt(self, record: InstanceRecord | None) -> None:
        """Follow the instance that runs in our home now (another process may have restarted it)."""
        if record != self._record:
            self._record = record
            if self._api is not None:
                self._api.log_out()  # the new instance's token, on the client its callers already hold
            if self._process is not None and (record is None or record.pid != self._process.pid):
                self._process.poll()  # reap it if it was ours
                self._process = None

    def component_restarts(self) -> dict[str, dict[str, Any]]:
        """name -> {restarts, last_exit} of every component the supervisor restarted."""
        status = read_status(self.home) or {}
        return {
            name: {"restarts": c.get("restarts", 0), "last_exit": c.get("last_exit")}
            for name, c in status.get("components", {}).items()
            if c.get("restarts")
        }

    def component_problems(self) -> list[str]:
        """One line per component that does not run as it should: not running, stopped or a zombie,
        or (the probed api-server) not answered since its start. Empty when all look well."""
        status = read_status(self.home) or {}
        problems = []
        for name, component in sorted(status.get("components", {}).items()):
            pid = component.get("pid")
            stat = procs.read_stat(pid) if pid else None
            last = component.get("last_answer_at")
            answered = f", its last answer at {clock(last)}" if last else ""
            if not component.get("running") or stat is None:
                problems.append(f"{name} not running (restarts {component.get('restarts', 0)})")
            elif stat.state in STUCK_STATES:
                problems.append(f"{name} pid {pid} {STUCK_STATES[stat.state]}{answered}")
            elif component.get("answered") is False:
                started = clock(component.get("started_at"))
                problems.append(f"{name} pid {pid} has not answered since its start at {started}")
        return problems

    def check_alive(self) -> None:
        """Raise AirflowGone when no supervisor of this home runs any more (waits poll it)."""
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
            self._adopt(self.running_instance())  # someone else may have started it again
            if self._record is None:
                raise AirflowGone(f"the embedded Airflow exited with {code}:\n{self.log_tail()}")
        if self._process is None and not self.is_running():
            raise AirflowGone(f"the embedded Airflow in {self.home} is no longer running")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {self.log_path.name})"

    def stop(self, timeout: float = 45.0) -> None:
        """SIGTERM the instance's supervisor, wait (it gives its components 30 s), SIGKILL what is
        left; fail if any process of the instance survives. Holds the start lock, so a start in
        another process waits for a stop under way instead of racing it."""
        if not self.home.is_dir():
            self._log.info("no embedded Airflow in %s (no such folder)", self.home)
            return
        with self._start_lock():
            record = self.running_instance() or self._record
            if record is None:
                self._log.info("no embedded Airflow running in %s", self.home)
            else:
                self._stop_instance(record, timeout)
            if self._process is not None:
                self._process.wait(timeout=10)
                self._process = None
            with contextlib.suppress(FileNotFoundError):
                self.pid_file.unlink()
            self._record = None
            self._api = None

    def _stop_instance(self, record: InstanceRecord, timeout: float) -> None:
        self._log.info("stopping embedded Airflow pid %d", record.pid)
        # A stopped process (SIGSTOP, a detached debugger) takes no SIGTERM until it is continued.
        for process in self._processes(record):
            procs.signal_pid(process, signal.SIGCONT)
        # The supervisor alone, which stops each component once: a SIGTERM to the whole group would
        # reach every component twice (directly and from the supervisor), and Airflow's triggerer
        # takes a second one as "force exit", leaving its runner to be SIGKILLed.
        procs.signal_pid(record.pid, signal.SIGTERM)
        if not self._wait_group_gone(record.pid, timeout):
            self._log.info("process group %d still alive after %.0f s: SIGKILL", record.pid, timeout)
            procs.signal_group(record.pid, signal.SIGKILL)
            self._wait_group_gone(record.pid, 10.0)
        # Anything that left the group (a process that called setsid) still carries the marker.
        for pid in self._processes(record):
            self._log.info("killing leftover process %d of %s", pid, self.home)
            procs.kill(pid)
        procs.wait_until(lambda: not self._processes(record), 10.0)
        left = self._processes(record)
        if left:
            raise AirflowError(f"processes of {self.home} survived SIGKILL: {left}")
        self._log.info("embedded Airflow stopped")

    def _processes(self, record: InstanceRecord) -> list[int]:
        """Every live process of one instance: they all carry its marker (INSTANCE_ENV). Training
        processes never do (the cluster backends strip Airflow's variables), so they survive, and
        neither does an instance started in the same home after this one."""
        return [p.pid for p in procs.processes_with_env(INSTANCE_ENV, instance_marker(record))]

    def _wait_group_gone(self, pgid: int, timeout: float) -> bool:
        def gone() -> bool:
            if self._process is not None:
                self._process.poll()  # reap our own child so it does not linger as a zombie
            return not procs.processes_in_group(pgid)

        return procs.wait_until(gone, timeout)

    # ---- clients -----------------------------------------------------------------------------

    def command(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """An ``airflow`` CLI command against this instance (its home, database and settings)."""
        return subprocess.run(
            [str(Path(self.python).parent / "airflow"), *args],
            cwd=self.project_dir,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    @property
    def api(self) -> AirflowApi:
        """The REST client of the running instance (its URL; log in as the admin user)."""
        if self._api is None:
            # The URL as a callable: a client handed out before a restart follows the new instance.
            self._api = AirflowApi(lambda: self.url, ADMIN_USER, ADMIN_PASSWORD, check_alive=self.check_alive)
        return self._api
