"""The files, ports and settings of one embedded Airflow instance (``embedded.EmbeddedAirflow`` runs
it): its home folder and what it keeps there, the pid file's record, and the environment of every one
of its processes. Every setting is passed to Airflow as an ``AIRFLOW__SECTION__KEY`` variable, so
``airflow.cfg`` keeps only Airflow's generated secrets. No Airflow import.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from syncswitch_airflow.embedded import sqlite_settings
from syncswitch_airflow.embedded.airflow_api import AirflowError

ADMIN_USER = "admin"
# A fixed password so the CLI, the tests and the README agree on it. The API listens on 127.0.0.1
# only; this is the embedded development instance, not a deployment (see docker-compose.yaml).
ADMIN_PASSWORD = "syncswitch"
PREFERRED_PORT = 8080
# Every process of one instance carries this marker; stop() kills by it. It starts with AIRFLOW so
# that the cluster backends, which strip Airflow's variables from training processes, strip it too.
INSTANCE_ENV = "AIRFLOW_EMBEDDED_INSTANCE"
WARM_EXECUTOR = "syncswitch_airflow.warm_start.WarmLocalExecutor"
# With the WarmLocalExecutor, whose heartbeat waits for a task to end (warm_start.RESULT_WAIT_SECONDS),
# the idle sleep is the rest of the scheduler's idle loop; other executors sleep the default (the
# loop's CPU: see settings()).
IDLE_SLEEP_SECONDS = {WARM_EXECUTOR: "0.2"}
DEFAULT_IDLE_SLEEP_SECONDS = "2.0"
# The DAG files of an installed provider package (in a checkout, a link to the repository's dags/:
# plugins/pyproject.toml); a checkout serves its own dags/ instead.
PACKAGED_DAGS = Path(__file__).resolve().parents[1] / "dags"


@dataclass(frozen=True)
class InstanceRecord:
    """What the pid file records about a running supervisor."""

    pid: int
    port: int  # the API server (UI and REST)
    worker_log_port: int  # log servers: fixed by default, so two instances on one machine would clash
    trigger_log_port: int
    home: str
    started_at: float


@dataclass(frozen=True)
class InstanceHome:
    """An instance's AIRFLOW_HOME, the project it serves, and the interpreter whose ``airflow`` runs it
    (another environment's: a deployment that installed the packages from their wheels)."""

    home: Path
    project_dir: Path
    python: str = sys.executable

    @property
    def dags_folder(self) -> Path:
        """A checkout's dags/, else (an installed package run from any folder) the DAG files it carries."""
        own = self.project_dir / "dags"
        return own if own.is_dir() else PACKAGED_DAGS

    @property
    def plugins_folder(self) -> Path:
        return self.project_dir / "plugins"

    @property
    def password_file(self) -> Path:
        return self.home / "simple_auth_manager_passwords.json.generated"

    def env(self, record: InstanceRecord, overrides: dict[str, str]) -> dict[str, str]:
        """The environment every Airflow process of the instance ``record`` runs with; ``overrides``
        (``SECTION__KEY`` -> value) go over our settings."""
        env = dict(os.environ)
        # A caller's own Airflow settings must not leak into the embedded instance.
        for key in [k for k in env if k.startswith("AIRFLOW__") or k in ("AIRFLOW_HOME", "AIRFLOW_CONFIG")]:
            del env[key]
        env.update({f"AIRFLOW__{key}": value for key, value in self.settings(record, overrides).items()})
        env["AIRFLOW_HOME"] = str(self.home)
        env[INSTANCE_ENV] = instance_marker(record)
        # Components run as plain `airflow ...`: our interpreter's bin comes first.
        env["PATH"] = os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def settings(self, record: InstanceRecord, overrides: dict[str, str]) -> dict[str, str]:
        """The instance's Airflow settings (``SECTION__KEY`` -> value), ``overrides`` over ours."""
        base_url = f"http://127.0.0.1:{record.port}"
        settings = {
            "CORE__DAGS_FOLDER": str(self.dags_folder),
            "CORE__PLUGINS_FOLDER": str(self.plugins_folder),
            "CORE__LOAD_EXAMPLES": "False",
            # LocalExecutor, its workers forked after the task side's imports (warm_start).
            "CORE__EXECUTOR": WARM_EXECUTOR,
            # Sized for a small machine, where more pre-forked workers cost memory and only contend
            # for CPU.
            "CORE__PARALLELISM": "4",
            "CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.password_file),
            "CORE__EXECUTION_API_SERVER_URL": f"{base_url}/execution/",
            "DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home / 'airflow.db'}",
            "API__HOST": "127.0.0.1",
            "API__PORT": str(record.port),
            "API__BASE_URL": base_url,
            "API__WORKERS": "1",
            # Each scheduler timer that comes due between two idle sleeps cuts the sleep short: one
            # more whole scheduling loop, so these four come due rarely. No deferral of ours has a
            # timeout, a dead task is failed by its heartbeat timeout anyway (below), and stale DAGs
            # (the dag-processor's check too), orphaned assets and connection tests can wait minutes.
            "SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "60",
            "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "30",
            "SCHEDULER__PARSING_CLEANUP_INTERVAL": "300",
            "CONNECTION_TEST__REAPER_INTERVAL": "300",
            # Look for new DAG files every minute but reparse a known file only every 10 minutes:
            # each parse imports the operators, CPU that training needs. A new instance's
            # dag-processor parses every file as it starts, and start() reserializes a reused one's
            # (boot.wait_for_dags), so every `syncswitch run` sees the current DAG files.
            "DAG_PROCESSOR__REFRESH_INTERVAL": "60",
            "DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            # The instance runs niced (supervisor.NICENESS), so on a machine kept busy by other work
            # a parse's wall time is many times its CPU time; a parse past these limits would make
            # its DAGs import errors.
            "CORE__DAGBAG_IMPORT_TIMEOUT": "300",
            "DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "330",
            # A restarted triggerer takes over the deferred tasks of a dead one once that one has
            # missed its heartbeats for this long (default 30 s); heartbeats come every 5 s.
            "TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
            # A task whose process died with a killed scheduler is failed (and retried) after this
            # long without a heartbeat, rather than the default 5 minutes.
            "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "120",
            "DATABASE__SQL_ALCHEMY_CONNECT_ARGS": sqlite_settings.CONNECT_ARGS_PATH,
            # Tasks talk to the api-server; when it restarts (or boots after the scheduler on a busy
            # machine) they retry for ~5 minutes (waits 1, 2, 4 ... 90 s) instead of ~15 s, rather
            # than fail a healthy run.
            "WORKERS__EXECUTION_API_RETRIES": "10",
            # A task's supervisor waits for its process in select() for up to this long (default 5 s),
            # and when the process's sockets close just before it can be reaped, that select has
            # nothing left to wake it: the task's end is reported that much later. Our tasks run for
            # seconds (segments and watchers defer), so a heartbeat a second costs little. Failed
            # heartbeats are tolerated as long as by default (3 x 5 s).
            "WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "WORKERS__MAX_FAILED_HEARTBEATS": "15",
            "LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "LOGGING__WORKER_LOG_SERVER_PORT": str(record.worker_log_port),
            "LOGGING__TRIGGER_LOG_SERVER_PORT": str(record.trigger_log_port),
            # Every component signs and checks task and API tokens with the same key; Airflow's own
            # generated one is short enough to log an InsecureKeyLengthWarning on every request.
            "API_AUTH__JWT_SECRET": self.secret("jwt_secret"),
            # The api-server fetches a task's log from the worker's log server with a token signed
            # with this key: each component generating its own (Airflow's default) refuses every
            # fetch from another machine (a Celery worker) with 403.
            "API__SECRET_KEY": self.secret("api_secret_key"),
            **self._project_settings(),
            **overrides,
        }
        # The scheduler's loop is most of the embedded Airflow's CPU while a segment trains; a longer
        # idle sleep costs less, down to where its timers (above) wake it between sleeps anyway
        # (bench/bench_airflow_cpu.py measures it).
        settings.setdefault(
            "SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME",
            IDLE_SLEEP_SECONDS.get(settings["CORE__EXECUTOR"], DEFAULT_IDLE_SLEEP_SECONDS),
        )
        if not settings["DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite"):
            del settings["DATABASE__SQL_ALCHEMY_CONNECT_ARGS"]  # SQLite's (a deployment on Postgres)
        return settings

    def _project_settings(self) -> dict[str, str]:
        """The packaged DAG files sit in site-packages, so their folder cannot hold runs and job files:
        those default to the project folder (where ``syncswitch run`` was started)."""
        if self.dags_folder != PACKAGED_DAGS:
            return {}
        return {
            "SYNCSWITCH__BUCKET_DIR": str(self.project_dir / "runs"),
            "SYNCSWITCH__JOBS_DIR": str(self.project_dir / "jobs"),
        }

    def secret(self, name: str) -> str:
        """A random secret of this instance, made once and kept (0600) in its home."""
        path = self.home / name
        if not path.exists():
            path.write_text(secrets.token_urlsafe(64))
            path.chmod(0o600)
        return path.read_text().strip()

    def write_password_file(self) -> None:
        self.password_file.write_text(json.dumps({ADMIN_USER: ADMIN_PASSWORD}) + "\n")
        self.password_file.chmod(0o600)


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
