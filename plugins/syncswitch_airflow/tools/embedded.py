"""An embedded Airflow in the project folder: its processes, supervised; its REST API as ``.api``.

    airflow = EmbeddedAirflow(project_dir)
    airflow.start()                       # or reuse the one already running in <project>/.airflow
    run_id = airflow.api.trigger("sync_switch", conf)     # syncswitch_airflow.tools.airflow_api.AirflowApi
    airflow.api.wait("sync_switch", run_id)
    airflow.stop()

The instance lives in ``<project>/.airflow`` (AIRFLOW_HOME): SQLite, LocalExecutor, the project's
``dags/`` and ``plugins/``, sized for a 2-core machine. Its components (scheduler, dag-processor,
triggerer, api-server) run under ``syncswitch_airflow.tools.airflow_supervisor``, which restarts any that
dies and says so in ``embedded.log``. Every setting is passed to Airflow as an
``AIRFLOW__SECTION__KEY`` variable (``env()``), so ``airflow.cfg`` keeps only Airflow's generated
secrets. This module talks to Airflow over HTTP and processes only; it never imports Airflow, so the
CLI starts fast and bad flags fail before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncswitch import procs

from syncswitch_airflow.tools.airflow_api import (
    AirflowApi,
    AirflowError,
    quote,
)
from syncswitch_airflow.tools.airflow_supervisor import read_status

ADMIN_USER = "admin"
# A fixed password so the CLI, the tests and the README agree on it. The API listens on 127.0.0.1
# only; this is the embedded development instance, not a deployment (see docker-compose.yaml).
ADMIN_PASSWORD = "syncswitch"
PREFERRED_PORT = 8080
BOOT_TIMEOUT_ENV = "SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT"
# Every process of one instance carries this marker; stop() kills by it. It starts with AIRFLOW so
# that the cluster backends, which strip Airflow's variables from training processes, strip it too.
INSTANCE_ENV = "AIRFLOW_EMBEDDED_INSTANCE"
# Booting takes 25-50 s on an idle 2-core machine and several minutes on a loaded one; the limit only
# guards against waiting forever, and is configurable.
DEFAULT_BOOT_TIMEOUT_S = 1800.0
_BOOT_PROGRESS_EVERY_S = 15.0
# While the api-server restarts, requests are refused for a few seconds: keep asking this long.


class DagImportError(AirflowError):
    """A DAG file in the project's dags folder does not import; the message holds the traceback."""


class AirflowGone(AirflowError):
    """The embedded Airflow (its supervisor) is no longer running."""


@dataclass(frozen=True)
class InstanceRecord:
    """What the pid file records about a running supervisor."""

    pid: int
    port: int  # the API server (UI and REST)
    worker_log_port: int  # log servers: fixed by default, so two instances on one machine would clash
    trigger_log_port: int
    home: str
    started_at: float


# The DAG files of an installed provider package (plugins/pyproject.toml ships the repository's dags/
# there); a checkout serves its own dags/ instead.
PACKAGED_DAGS = Path(__file__).resolve().parents[1] / "dags"


class EmbeddedAirflow:
    """One supervised Airflow (a process group) serving ``project_dir``'s DAGs on 127.0.0.1."""

    def __init__(
        self,
        project_dir: str | os.PathLike[str],
        home: str | os.PathLike[str] | None = None,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        """``port``: the API port for a new instance; None = 8080 when free, else any; 0 = any free.
        ``settings``: ``SECTION__KEY`` -> value, over ours (benchmarks compare settings with it)."""
        self.project_dir = Path(project_dir).resolve()
        self.requested_port = port
        self.settings_overrides = dict(settings or {})
        self.home = Path(home).resolve() if home is not None else self.project_dir / ".airflow"
        # A checkout's dags/, else (an installed package run from any folder) the DAG files it carries.
        own_dags = self.project_dir / "dags"
        self.dags_folder = own_dags if own_dags.is_dir() else PACKAGED_DAGS
        self.plugins_folder = self.project_dir / "plugins"
        self.log_path = self.home / "embedded.log"
        self.pid_file = self.home / "embedded.json"
        self.password_file = self.home / "simple_auth_manager_passwords.json.generated"
        self._lock_file = self.home / "embedded.lock"
        self._log = logging.getLogger(__name__)
        self._process: subprocess.Popen[bytes] | None = None
        self._record: InstanceRecord | None = None
        self._api: AirflowApi | None = None
        self.started_here = False

    # ---- configuration ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._require_record().port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, record: InstanceRecord | None = None) -> dict[str, str]:
        """The environment every Airflow process of this instance runs with."""
        record = record or self._require_record()
        base_url = f"http://127.0.0.1:{record.port}"
        bin_dir = str(Path(sys.executable).parent)
        settings = {
            "CORE__DAGS_FOLDER": str(self.dags_folder),
            "CORE__PLUGINS_FOLDER": str(self.plugins_folder),
            "CORE__LOAD_EXAMPLES": "False",
            "CORE__EXECUTOR": "LocalExecutor",
            # 2 cores: the default 32 pre-forked workers cost 1.65 GB and only contend for CPU.
            "CORE__PARALLELISM": "4",
            "CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.password_file),
            "CORE__EXECUTION_API_SERVER_URL": f"{base_url}/execution/",
            "DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home / 'airflow.db'}",
            "API__HOST": "127.0.0.1",
            "API__PORT": str(record.port),
            "API__BASE_URL": base_url,
            "API__WORKERS": "1",
            # The scheduler's loop is most of the embedded Airflow's CPU while a segment trains: 0.24
            # cores at a 0.1 s idle sleep, 0.04 at 1 s, 0.03 at 2 s and no less at 3 s (its timers
            # wake it between sleeps: see below; bench/bench_airflow_cpu.py). Segments end from the
            # triggerer (no task process to resume), which pays for the longer sleep.
            "SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "2.0",
            # Each scheduler timer that comes due between two idle sleeps cuts the sleep short: one
            # more whole scheduling loop. These four came due ~13 times a minute; relaxed, ~3. No
            # deferral of ours has a timeout, a dead task is failed after 120 s anyway (below), and
            # stale DAGs (the dag-processor's check too), orphaned assets and connection tests can
            # wait minutes.
            "SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "60",
            "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "30",
            "SCHEDULER__PARSING_CLEANUP_INTERVAL": "300",
            "CONNECTION_TEST__REAPER_INTERVAL": "300",
            # Look for new DAG files every minute but reparse a known file only every 10 minutes:
            # each parse imports the operators, CPU that training needs on 2 cores. start()
            # reserializes, so a fresh start (every `syncswitch run`) sees the current DAG files.
            "DAG_PROCESSOR__REFRESH_INTERVAL": "60",
            "DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            # A restarted triggerer takes over the deferred tasks of a dead one once that one has
            # missed its heartbeats for this long (default 30 s); heartbeats come every 5 s.
            "TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
            # A task whose process died with a killed scheduler is failed (and retried) after this
            # long without a heartbeat, rather than the default 5 minutes.
            "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "120",
            "DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "syncswitch_airflow.tools.sqlite_settings.CONNECT_ARGS",
            # Tasks talk to the api-server; when it restarts (or boots after the scheduler on a busy
            # machine: 45 s and more) they retry for ~5 minutes (waits 1, 2, 4 ... 90 s) instead of
            # ~15 s and failing a healthy run.
            "WORKERS__EXECUTION_API_RETRIES": "10",
            "LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "LOGGING__WORKER_LOG_SERVER_PORT": str(record.worker_log_port),
            "LOGGING__TRIGGER_LOG_SERVER_PORT": str(record.trigger_log_port),
            # Every component signs and checks task and API tokens with the same key; Airflow's own
            # generated one is short enough to log an InsecureKeyLengthWarning on every request.
            "API_AUTH__JWT_SECRET": self._secret("jwt_secret"),
            # The api-server fetches a task's log from the worker's log server with a token signed
            # with this key: each component generating its own (Airflow's default) refuses every
            # fetch from another machine (a Celery worker) with 403.
            "API__SECRET_KEY": self._secret("api_secret_key"),
            **self._project_settings(),
            **self.settings_overrides,
        }
        if not settings["DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite"):
            del settings["DATABASE__SQL_ALCHEMY_CONNECT_ARGS"]  # SQLite's (a deployment on Postgres)
        env = dict(os.environ)
        # A caller's own Airflow settings must not leak into the embedded instance.
        for key in [k for k in env if k.startswith("AIRFLOW__") or k in ("AIRFLOW_HOME", "AIRFLOW_CONFIG")]:
            del env[key]
        env.update({f"AIRFLOW__{key}": value for key, value in settings.items()})
        env["AIRFLOW_HOME"] = str(self.home)
        env[INSTANCE_ENV] = instance_marker(record)
        # Components run as plain `airflow ...`: our interpreter's bin comes first.
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _project_settings(self) -> dict[str, str]:
        """The packaged DAG files sit in site-packages, so their folder cannot hold runs and job files:
        those default to the project folder (where ``syncswitch run`` was started)."""
        if self.dags_folder != PACKAGED_DAGS:
            return {}
        return {
            "SYNCSWITCH__BUCKET_DIR": str(self.project_dir / "runs"),
            "SYNCSWITCH__JOBS_DIR": str(self.project_dir / "jobs"),
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, wait_for_dags: tuple[str, ...] = ("sync_switch",), timeout: float | None = None) -> None:
        """Start (or reuse) the instance, wait for health, reserialize DAGs, wait for ``wait_for_dags``.

        ``timeout`` (default ``$SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT`` or 30 minutes) bounds the whole boot;
        a progress line every 15 s says what it is still waiting for."""
        self.home.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + (timeout if timeout is not None else boot_timeout())
        with self._start_lock():
            record = self.running_instance()
            if record is not None:
                self._record = record
                self._log.info("reusing embedded Airflow pid %d at %s", record.pid, self.url)
            else:
                self._spawn()
            self._wait_healthy(deadline)
        self.reserialize(deadline)
        for dag_id in wait_for_dags:
            self.wait_for_dag(dag_id, deadline)

    def _spawn(self) -> None:
        api_port = pick_port(self.requested_port)
        log_ports = free_ports(2, exclude={api_port})
        record = InstanceRecord(0, api_port, *log_ports, str(self.home), time.time())
        self._write_password_file()
        self._log.info("starting the embedded Airflow on 127.0.0.1:%d, home %s", api_port, self.home)
        with open(self.log_path, "ab") as log:
            # Own session: stop() can wait for (and at worst SIGKILL) the whole process group, and a
            # Ctrl-C in the terminal reaches only the CLI, which then stops Airflow in order.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "syncswitch_airflow.tools.airflow_supervisor"],
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

    def _secret(self, name: str) -> str:
        """A random secret of this instance, made once and kept (0600) in its home."""
        path = self.home / name
        if not path.exists():
            path.write_text(secrets.token_urlsafe(64))
            path.chmod(0o600)
        return path.read_text().strip()

    def _write_password_file(self) -> None:
        self.password_file.write_text(json.dumps({ADMIN_USER: ADMIN_PASSWORD}) + "\n")
        self.password_file.chmod(0o600)

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

    def _require_record(self) -> InstanceRecord:
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

    def health(self) -> dict[str, Any]:
        return self.api.get_json("/api/v2/monitor/health", auth=False)

    def _wait_healthy(self, deadline: float) -> None:
        started = time.monotonic()
        next_report = started + _BOOT_PROGRESS_EVERY_S
        waiting_for = "no answer yet"
        while True:
            self._check_alive()
            try:
                health = self.health()
            except (OSError, AirflowError):
                waiting_for = "the api-server to answer"
            else:
                unhealthy = sorted(
                    name
                    for name in ("metadatabase", "scheduler", "triggerer", "dag_processor")
                    if (health.get(name) or {}).get("status") != "healthy"
                )
                if not unhealthy:
                    self._check_port_is_ours()
                    self._log.info("embedded Airflow healthy at %s", self.url)
                    return
                waiting_for = f"{', '.join(unhealthy)} to report healthy"
            now = time.monotonic()
            if now >= deadline:
                raise AirflowError(
                    f"Airflow not healthy after {now - started:.0f} s: waiting for {waiting_for} "
                    f"(raise ${BOOT_TIMEOUT_ENV} on a busy machine); see {self.log_path}"
                )
            if now >= next_report:
                next_report = now + _BOOT_PROGRESS_EVERY_S
                self._log.info(
                    "embedded Airflow booting for %.0f s (%s): waiting for %s",
                    now - started,
                    self.supervisor_phase(),
                    waiting_for,
                )
            time.sleep(1.0)

    def supervisor_phase(self) -> str:
        status = read_status(self.home)
        return status.get("phase", "starting") if status else "starting"

    def component_restarts(self) -> dict[str, dict[str, Any]]:
        """name -> {restarts, last_exit} of every component the supervisor restarted."""
        status = read_status(self.home) or {}
        return {
            name: {"restarts": c.get("restarts", 0), "last_exit": c.get("last_exit")}
            for name, c in status.get("components", {}).items()
            if c.get("restarts")
        }

    def _check_port_is_ours(self) -> None:
        """A healthy answer on our port could come from another Airflow that took the port between
        pick_port() and our api-server's bind; then everything we do would go to the wrong instance."""
        record = self._require_record()
        owners = procs.listening_pids(record.port)
        if owners is not None and not owners & set(procs.processes_in_group(record.pid)):
            raise AirflowError(
                f"port {record.port} is served by process(es) {sorted(owners)}, not by this Airflow in "
                f"{self.home}; our api-server could not bind it (see {self.log_path}). Run again."
            )

    def _check_alive(self) -> None:
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

    def reserialize(self, deadline: float) -> None:
        """Parse the dags folder now instead of waiting for the dag-processor's next refresh."""
        self._log.info("reserializing DAGs from %s", self.dags_folder)
        try:
            result = self.command("dags", "reserialize", timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise AirflowError("`airflow dags reserialize` did not finish in time") from None
        if result.returncode != 0:
            raise AirflowError(
                f"`airflow dags reserialize` failed:\n{(result.stderr or result.stdout)[-3000:]}"
            )

    def import_errors(self) -> list[dict[str, Any]]:
        return self.api.get_json("/api/v2/importErrors?limit=100").get("import_errors", [])

    def wait_for_dag(self, dag_id: str, deadline: float) -> None:
        """Wait until ``dag_id`` is serialized, active and free of import errors."""
        while time.monotonic() < deadline:
            self._check_alive()
            errors = self.import_errors()
            if errors:
                raise DagImportError(
                    "DAG import errors in the dags folder:\n"
                    + "\n".join(f"{e.get('filename')}:\n{e.get('stack_trace', '').rstrip()}" for e in errors)
                )
            status, dag = self.api.request("GET", f"/api/v2/dags/{quote(dag_id)}")
            if status == 200 and not dag.get("is_stale", False):
                self._log.info("DAG %s is ready", dag_id)
                return
            time.sleep(1.0)
        raise AirflowError(f"DAG {dag_id!r} did not appear in {self.dags_folder}; see {self.log_path}")

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
        # The supervisor alone: it stops each component once. A SIGTERM to the whole group reached
        # every component twice (directly and from the supervisor), and Airflow's triggerer takes a
        # second one as "force exit", which left its runner to be SIGKILLed 5 s later.
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

    # ---- REST ------------------------------------------------------------------------------

    def command(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """An ``airflow`` CLI command against this instance (its home, database and settings)."""
        return subprocess.run(
            [str(Path(sys.executable).parent / "airflow"), *args],
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
            self._api = AirflowApi(
                lambda: self.url, ADMIN_USER, ADMIN_PASSWORD, check_alive=self._check_alive
            )
        return self._api


# ---- helpers ------------------------------------------------------------------------------------


def pick_port(requested: int | None = None) -> int:
    """``requested`` (0: any free port); by default 8080 when it is free on 127.0.0.1, else any."""
    for port in (PREFERRED_PORT, 0) if requested is None else (requested,):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise AirflowError(f"port {requested} is in use on 127.0.0.1" if requested else "no free TCP port")


def free_ports(count: int, exclude: set[int]) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1, none of them in ``exclude``."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in exclude and port not in ports:
            ports.append(port)
    return ports


def instance_marker(record: InstanceRecord) -> str:
    return f"{record.home}@{record.started_at!r}"


def boot_timeout() -> float:
    """``$SYNCSWITCH_AIRFLOW_BOOT_TIMEOUT`` seconds, or 30 minutes."""
    raw = os.environ.get(BOOT_TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_BOOT_TIMEOUT_S
    except ValueError:
        raise AirflowError(f"{BOOT_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
