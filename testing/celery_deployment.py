#!/usr/bin/env python3
"""A distributed Airflow on this machine, for real: PostgreSQL, Redis, the CeleryExecutor, and Celery
workers on separate testbed hosts that share no disk.

    .venv/bin/python -m celery_deployment [--name dist] [--workers 2] [--hosts 3]
        starts it all, prints where everything is, and tears it all down on Ctrl-C or SIGTERM
    .venv/bin/python -m celery_deployment down [--name dist]
        removes what a killed one left (its processes, its testbed, its folder)

What runs (docs/deployment.md maps it to Cloud Composer and to docker-compose.yaml):

- PostgreSQL (Debian's package) as the metadata database and Celery's result backend, and Redis
  (Debian's) as the Celery broker, both with passwords, on the testbed's gateway;
- the scheduler, dag-processor, triggerer and api-server on this machine, supervised as the embedded
  Airflow's are (``syncswitch_airflow.embedded.supervisor``), with the CeleryExecutor;
- N Celery workers, each on its own testbed host: its own network namespace (address), UTS namespace
  (host name) and mount namespace, where a private tmpfs covers ``/tmp`` and the deployment's folder.
  A worker's AIRFLOW_HOME, task logs and cluster work folder live on that tmpfs: no other worker and
  not the scheduler can see them, and it sees none of theirs. Worker ``i`` serves Airflow's
  ``default`` queue and a queue of its own, ``w<i>`` (a cluster policy can pin tasks to a worker);
- the packages as a deployment installs them: both wheels (the runtime and the provider, built from
  this checkout with ``uv build``) installed into a virtualenv of their own at the lock's versions,
  which every component runs from, with the provider's packaged DAG files as the DAGs folder. The
  workers do not see the checkout at all (their mount namespace covers it), so nothing of a run can
  come from it; the training hosts run the runtime of that virtualenv too;
- the GCS emulator on the gateway: the bucket, the one storage every component shares;
- M more testbed hosts for training clusters (the ``hosts`` backend), reached over SSH.

Every component shares one Fernet key, one JWT secret and one API secret key, as a real deployment's
must. The task instances' host names are the workers' addresses (``[core] hostname_callable``), so
the api-server reaches each worker's log server, which accepts its token.

Longer than the usual module: one deployment's lifecycle (its services, their installation, their
start and their teardown in reverse) is read in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import testbed as tb
import wheels
from background import Poller
from gcs_emulator import GcsEmulator, free_port, free_ports
from syncswitch import procs, storage
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow

PROJECT_DIR = Path(__file__).resolve().parent.parent  # the checkout: its dags/ and plugins/

DB_USER = "airflow"
DB_NAME = "airflow"
WORKER_CONCURRENCY = 4
# Airflow requeues a task queued this long (seconds; default 600), checked this often (default 120).
QUEUED_TASK_SETTINGS = {
    "SCHEDULER__TASK_QUEUED_TIMEOUT": "120",
    "SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "15",
}
WORKER_READY_S = 180.0
AIRFLOW_BOOT_S = 900.0
SERVICE_READY_S = 30.0
STOP_GRACE_S = 30.0
# The installed packages: outside /tmp and the deployment's folder, which the workers do not see.
INSTALL_ROOT = Path("/var/tmp")
# What the deploy dependency group adds to the provider for the CeleryExecutor on PostgreSQL.
DEPLOY_REQUIREMENTS = ("celery[redis]", "psycopg2-binary", "asyncpg")
PRIVATE_HOME = "/tmp/airflow"  # a worker's AIRFLOW_HOME, on its private tmpfs
PRIVATE_WORK = "/tmp/syncswitch"  # its [syncswitch] work_dir, likewise


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} celery deployment: {message}", flush=True)


def _postgres_bin(program: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{program}"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    return found[-1]


def missing_prerequisites() -> str | None:
    """Why this machine cannot run the deployment, or None."""
    if not glob.glob("/usr/lib/postgresql/*/bin/postgres"):
        return "PostgreSQL is not installed (apt-get install postgresql)"
    if shutil.which("redis-server") is None:
        return "Redis is not installed (apt-get install redis-server)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    try:
        import airflow.providers.celery  # noqa: F401
    except ImportError:
        return "apache-airflow-providers-celery is not installed (uv sync installs the deploy group)"
    return tb.ensure_prerequisites()


class Service:
    """A process the deployment started, with its log file."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], log_path: Path, log_offset: int) -> None:
        self.name, self.process, self.log_path, self.log_offset = name, process, log_path, log_offset

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        """What this process wrote (the file may hold an earlier one's before it)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` of what this process wrote."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, grace: float = STOP_GRACE_S) -> None:
        """``sig`` to its process group, SIGKILL after ``grace``; waits until the group is gone."""
        pgid = self.process.pid
        if self.alive():
            procs.signal_group(pgid, sig)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                if sig != signal.SIGKILL:
                    log(f"{self.name} still running {grace:.0f} s after signal {sig}: SIGKILL")
        procs.signal_group(pgid, signal.SIGKILL)
        self.process.wait(timeout=10)
        procs.wait_until(lambda: not procs.processes_in_group(pgid), 10.0)


def _spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Service:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        offset = out.tell()
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stop() reaches its children too
        )
    return Service(name, process, log_path, offset)


def _wait_for(what: str, ready: Any, service: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not service.alive():
            raise RuntimeError(f"{what} exited with {service.process.returncode}:\n{service.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout:.0f} s:\n{service.log_tail()}")
        time.sleep(0.5)


class Installation:
    """The runtime and the provider installed from their wheels into a virtualenv of their own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.venv = folder / "venv"
        self.python = self.venv / "bin" / "python"
        purelib = sysconfig.get_path("purelib", vars={"base": str(self.venv), "platbase": str(self.venv)})
        self.dags_folder = Path(purelib) / "syncswitch_airflow" / "dags"
        self.plugins_folder = folder / "airflow-plugins"  # empty: no checkout on Airflow's sys.path

    def install(self) -> None:
        """Build both wheels, install them with the lock's versions of everything they need (from
        uv's cache, which the lock's sync filled: seconds)."""
        started = time.monotonic()
        shutil.rmtree(self.folder, ignore_errors=True)
        built = wheels.build_wheels(self.folder / "dist")
        constraints = wheels.lock_constraints(self.folder / "constraints.txt")
        runtime, provider = built[wheels.RUNTIME], built[wheels.PROVIDER]
        wheels.fresh_venv(self.venv, constraints, runtime, f"{provider}[celery]", *DEPLOY_REQUIREMENTS)
        self.plugins_folder.mkdir()
        took = time.monotonic() - started
        log(f"installed {runtime.name} and {provider.name} into {self.venv} in {took:.1f} s")


class CeleryDeployment:
    """The deployment as one object: ``up()``, its parts, its faults, ``down()``; see the module doc.

    ``bed``: a testbed with at least ``workers`` hosts; the first ``workers`` run the Celery workers.
    ``storage``: the GCS emulator every component uses (on the testbed's gateway).
    ``settings``: more ``SECTION__KEY`` settings for every Airflow component.
    ``local_settings``: the scheduler side's ``airflow_local_settings.py`` (cluster policies, such as
    one that routes tasks to the workers' queues).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        bed: tb.Testbed,
        storage: GcsEmulator,
        workers: int = 2,
        settings: dict[str, str] | None = None,
        local_settings: str = "",
    ) -> None:
        if len(bed.hosts) < workers:
            raise ValueError(f"testbed {bed.name} has {len(bed.hosts)} host(s), the workers need {workers}")
        self.root = Path(root).resolve()
        self.bed, self.storage = bed, storage
        self.worker_hosts = list(bed.hosts[:workers])
        self.gateway = bed.gateway
        self.pg_port, self.redis_port, self.api_port = free_ports(3)
        self.password = secrets.token_hex(16)
        self.fernet_key = _fernet_key()
        self.extra_settings = dict(settings or {})
        self.local_settings = local_settings
        self.postgres: Service | None = None
        self.redis: Service | None = None
        self.workers: dict[int, Service] = {}
        self.installation = Installation(INSTALL_ROOT / f"syncswitch-celery-{self.root.name}")
        self.airflow = EmbeddedAirflow(
            PROJECT_DIR,
            home=self.root / "scheduler",
            port=self.api_port,
            settings=self.airflow_settings(),
            python=str(self.installation.python),
        )

    # ---- configuration ---------------------------------------------------------------------------

    @property
    def database_url(self) -> str:
        return f"postgresql+psycopg2://{DB_USER}:{self.password}@{self.gateway}:{self.pg_port}/{DB_NAME}"

    def airflow_settings(self) -> dict[str, str]:
        """What every Airflow component of the deployment shares (``AIRFLOW__<key>``)."""
        return {
            "CORE__EXECUTOR": "CeleryExecutor",
            "DATABASE__SQL_ALCHEMY_CONN": self.database_url,
            "CELERY__BROKER_URL": f"redis://:{self.password}@{self.gateway}:{self.redis_port}/0",
            "CELERY__RESULT_BACKEND": f"db+postgresql+psycopg2://{DB_USER}:{self.password}@{self.gateway}:"
            f"{self.pg_port}/{DB_NAME}",
            "CELERY__WORKER_CONCURRENCY": str(WORKER_CONCURRENCY),
            # Every task process starts with Airflow's DAG parsing and our operators imported.
            "CELERY__CELERY_CONFIG_OPTIONS": "syncswitch_airflow.celery_config.CELERY_CONFIG",
            # A connection written by the UI is read by the tasks: one key for every component.
            "CORE__FERNET_KEY": self.fernet_key,
            # Workers reach the api-server at the gateway; it listens on every address of this machine.
            "API__HOST": "0.0.0.0",
            "CORE__EXECUTION_API_SERVER_URL": f"http://{self.gateway}:{self.api_port}/execution/",
            # A task instance's host is its worker's address: the api-server fetches its log from there.
            "CORE__HOSTNAME_CALLABLE": "airflow.utils.net.get_host_ip_address",
            # A worker lost with a task it had taken from the broker but not started leaves that task
            # queued (its message unacknowledged in Redis for the 6 h visibility timeout); the
            # scheduler requeues it after this long, instead of 10 minutes.
            **QUEUED_TASK_SETTINGS,
            # The installed provider's DAG files, and no plugins folder of the checkout's.
            "CORE__DAGS_FOLDER": str(self.installation.dags_folder),
            "CORE__PLUGINS_FOLDER": str(self.installation.plugins_folder),
            **self.extra_settings,
        }

    # ---- lifecycle -------------------------------------------------------------------------------

    def up(self) -> None:
        """Everything, in order; on a failure everything started so far is stopped again."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.local_settings:
            config = self.airflow.home / "config"
            config.mkdir(parents=True, exist_ok=True)
            (config / "airflow_local_settings.py").write_text(self.local_settings)
        try:
            self.installation.install()
            self._start_postgres()
            self._start_redis()
            log(f"starting Airflow (CeleryExecutor) on http://{self.gateway}:{self.api_port}")
            self.airflow.start(timeout=AIRFLOW_BOOT_S)
            # Spawned together, then waited for: each imports Airflow and the provider before its
            # pool forks (syncswitch_airflow.celery_config), one core each.
            spawned = [self._spawn_worker(index) for index in range(len(self.worker_hosts))]
            for index, service in enumerate(spawned):
                self._wait_until_ready(index, service)
        except BaseException:
            self.down()
            raise
        log(
            f"up: api-server http://{self.gateway}:{self.api_port}, workers "
            + ", ".join(f"{h.name} ({h.address}, queue w{i})" for i, h in enumerate(self.worker_hosts))
        )

    def down(self) -> None:
        """Stop the workers, Airflow, Redis and PostgreSQL; fail if any process of them is left."""
        for index in list(self.workers):
            self.stop_worker(index)
        if self.airflow.home.is_dir():
            self.airflow.stop()
        for service in (self.redis, self.postgres):
            if service is not None:
                service.stop(signal.SIGINT if service is self.postgres else signal.SIGTERM)
        self.redis = self.postgres = None
        shutil.rmtree(self._pg_dir, ignore_errors=True)
        shutil.rmtree(self.installation.folder, ignore_errors=True)
        left = procs.processes_with_env("SYNCSWITCH_DEPLOYMENT", str(self.root))
        if left:
            raise RuntimeError(f"processes of the deployment in {self.root} survived: {left}")
        log("down")

    def __enter__(self) -> CeleryDeployment:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- PostgreSQL ------------------------------------------------------------------------------

    @property
    def _pg_dir(self) -> Path:
        # Outside the deployment's folder: the postgres user must reach it, and pytest's are 0700.
        return Path("/var/tmp") / f"syncswitch-pg-{self.root.name}-{self.pg_port}"

    def _start_postgres(self) -> None:
        data = self._pg_dir
        if not (data / "PG_VERSION").exists():
            shutil.rmtree(data, ignore_errors=True)
            data.mkdir(parents=True, mode=0o700)
            (data.parent / f"{data.name}.pw").write_text(self.password)
            shutil.chown(data, "postgres", "postgres")
            shutil.chown(data.parent / f"{data.name}.pw", "postgres", "postgres")
            _as_postgres(
                _postgres_bin("initdb"),
                "-D",
                str(data / "db"),
                "-U",
                DB_USER,
                "--auth=scram-sha-256",
                f"--pwfile={data.parent / f'{data.name}.pw'}",
            )
            (data.parent / f"{data.name}.pw").unlink()
            with open(data / "db" / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {self.bed.subnet} scram-sha-256\n")
            (data / "PG_VERSION").write_text("initialised\n")
        self._run_postgres()
        import psycopg2

        with contextlib.closing(
            psycopg2.connect(
                host=self.gateway, port=self.pg_port, user=DB_USER, password=self.password, dbname="postgres"
            )
        ) as conn:
            conn.autocommit = True
            with conn.cursor() as cursor:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,))
                if cursor.fetchone() is None:
                    cursor.execute(f"CREATE DATABASE {DB_NAME}")
        log(f"PostgreSQL on {self.gateway}:{self.pg_port}")

    def _run_postgres(self) -> None:
        data = self._pg_dir / "db"
        self.postgres = _spawn(
            "postgres",
            [
                "runuser",
                "-u",
                "postgres",
                "--",
                _postgres_bin("postgres"),
                *("-D", str(data), "-p", str(self.pg_port), "-k", str(data)),
                *("-c", f"listen_addresses={self.gateway}", "-c", "max_connections=200"),
            ],
            self.root / "logs" / "postgres.log",
            env={**os.environ, "SYNCSWITCH_DEPLOYMENT": str(self.root)},
        )
        _wait_for("PostgreSQL", lambda: _accepts(self.gateway, self.pg_port), self.postgres, SERVICE_READY_S)

    def restart_postgres(self, down_seconds: float = 0.0) -> None:
        """Stop PostgreSQL (fast shutdown: open sessions are cut), wait, start it again."""
        assert self.postgres is not None
        log("restarting PostgreSQL")
        self.postgres.stop(signal.SIGINT)
        time.sleep(down_seconds)
        self._run_postgres()

    # ---- Redis -----------------------------------------------------------------------------------

    def _start_redis(self) -> None:
        folder = self.root / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "redis.conf"
        # The password in a 0600 file, not on a command line that `ps` shows.
        config.write_text(
            f"port {self.redis_port}\nbind {self.gateway}\nrequirepass {self.password}\n"
            f'dir {folder}\nsave ""\nappendonly no\n'
        )
        config.chmod(0o600)
        self.redis = _spawn(
            "redis",
            ["redis-server", str(config)],
            self.root / "logs" / "redis.log",
            env={**os.environ, "SYNCSWITCH_DEPLOYMENT": str(self.root)},
        )
        _wait_for("Redis", lambda: _accepts(self.gateway, self.redis_port), self.redis, SERVICE_READY_S)
        log(f"Redis on {self.gateway}:{self.redis_port}")

    # ---- Celery workers --------------------------------------------------------------------------

    def worker_env(self, index: int) -> dict[str, str]:
        """The scheduler's environment, with the worker's own home, temp and work folders."""
        env = {k: v for k, v in self.airflow.env().items() if not k.startswith("SYNCSWITCH_WORK")}
        env.update(
            AIRFLOW_HOME=PRIVATE_HOME,
            AIRFLOW__LOGGING__BASE_LOG_FOLDER=f"{PRIVATE_HOME}/logs",
            AIRFLOW__SYNCSWITCH__WORK_DIR=PRIVATE_WORK,
            TMPDIR="/tmp",
            SYNCSWITCH_DEPLOYMENT=str(self.root),
        )
        return env

    def start_worker(self, index: int, host: tb.TestHost | None = None) -> Service:
        """Worker ``index`` (queue ``w<index>``) on its testbed host, or on ``host`` (a replacement
        machine), in namespaces of its own, with an empty disk; returns when Celery is ready."""
        return self._wait_until_ready(index, self._spawn_worker(index, host))

    def _spawn_worker(self, index: int, host: tb.TestHost | None = None) -> Service:
        if host is not None:
            self.worker_hosts[index] = host
        host = self.worker_hosts[index]
        # The checkout too: the worker runs the installed packages, and fails loudly if it reached for
        # anything of the checkout's. What lies under /tmp is hidden by the private /tmp already (and
        # has no mount point left to cover: a checkout cloned to /tmp/x failed here).
        hidden = [path for path in (PROJECT_DIR, self.root) if not str(path).startswith("/tmp/")]
        setup = [
            f"hostname {shlex.quote(host.name)}",
            # Its own /tmp (and the deployment's folder hidden): nothing of the scheduler's or of
            # another worker's is visible, and nothing it writes there is visible to them.
            "mount -t tmpfs -o mode=1777 syncswitch-private /tmp",
            *(f"mount -t tmpfs syncswitch-hidden {shlex.quote(str(path))}" for path in hidden),
            # Its name resolves to its own address (hostname_callable reports that address).
            f"printf '127.0.0.1 localhost\\n{host.address} {host.name}\\n' > /tmp/hosts",
            "mount --bind /tmp/hosts /etc/hosts",
            f"mkdir -p {PRIVATE_HOME} {PRIVATE_WORK}",
            f"cd {PRIVATE_HOME}",
            "exec "
            + shlex.join(
                [
                    str(self.installation.python.parent / "airflow"),
                    *("celery", "worker", "--queues", f"w{index},default"),
                    *("--celery-hostname", f"w{index}@{host.name}"),
                    *("--concurrency", str(WORKER_CONCURRENCY), "--without-gossip", "--without-mingle"),
                ]
            ),
        ]
        argv = [
            *("ip", "netns", "exec", host.name),
            *("unshare", "--uts", "--mount", "--propagation", "private", "--"),
            *("/bin/sh", "-c", "set -e; " + "; ".join(setup)),
        ]
        service = _spawn(
            f"worker {index}", argv, self.root / "logs" / f"worker-{index}.log", self.worker_env(index)
        )
        self.workers[index] = service
        return service

    def _wait_until_ready(self, index: int, service: Service) -> Service:
        host = self.worker_hosts[index]
        _wait_for(
            f"Celery worker {index} on {host.name}",
            lambda: " ready." in service.log_tail(200),
            service,
            WORKER_READY_S,
        )
        log(f"Celery worker {index} ready on {host.name} ({host.address}), queue w{index}")
        return service

    def stop_worker(self, index: int) -> None:
        service = self.workers.pop(index, None)
        if service is not None:
            service.stop(signal.SIGTERM)
            self._kill_left_on(self.worker_hosts[index])

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` and every process of it: a machine lost, mid-task."""
        service = self.workers.pop(index)
        log(f"killing Celery worker {index} ({self.worker_hosts[index].name})")
        service.stop(signal.SIGKILL, grace=0.0)
        self._kill_left_on(self.worker_hosts[index])

    def _kill_left_on(self, host: tb.TestHost) -> None:
        """Every process of the deployment still on ``host`` (a task process in a session of its own)."""
        for pid in self.bed.processes(host):
            if procs.has_env(pid, "SYNCSWITCH_DEPLOYMENT", str(self.root)):
                procs.kill(pid)

    def worker_file(self, index: int, path: str) -> Path:
        """``path`` as worker ``index`` sees it (its private tmpfs, through /proc/<pid>/root)."""
        return Path(f"/proc/{self.workers[index].process.pid}/root") / path.lstrip("/")


class LedgerWatch(Poller):
    """Polls the deployment's capacity ledger (a bucket object) from a thread: for each run, when its
    lease was first and last seen and the hosts it named, and every moment two leases named one host.
    The clusters' real holding times, not inferred from task dates (provision_cluster runs beside
    plan, so the run's state is created before its cluster is held)."""

    def __init__(self, ledger: str, poll_seconds: float = 0.5) -> None:
        self.ledger = ledger
        self.held: dict[str, dict[str, Any]] = {}
        self.shared: list[tuple[str, str, str]] = []  # (host, run, run) seen in one snapshot
        super().__init__(every=poll_seconds)

    def poll(self) -> None:
        now = time.time()
        leases = (storage.read_json(self.ledger, default=None) or {}).get("leases", {})
        owners: dict[str, str] = {}
        for run, lease in leases.items():
            seen = self.held.setdefault(run, {"from": now, "hosts": set(lease.get("hosts", []))})
            seen["to"] = now
            for host in lease.get("hosts", []):
                if host in owners:
                    self.shared.append((host, owners[host], run))
                owners[host] = run

    def most_at_once(self) -> int:
        """The most leases held at one moment (each lease from its first to its last sighting)."""
        windows = [(h["from"], h["to"]) for h in self.held.values()]
        return max((sum(1 for a, b in windows if a <= t <= b) for t, _ in windows), default=0)


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def _as_postgres(*argv: str) -> None:
    result = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {result.stderr or result.stdout}")


def _accepts(address: str, port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1.0):
        return True
    return False


@contextlib.contextmanager
def deployment(name: str, workers: int, hosts: int, root: Path) -> Iterator[CeleryDeployment]:
    """The CLI's deployment: its own testbed and GCS emulator too."""
    bed = tb.Testbed(name, workers + hosts)
    bed.up()
    try:
        (root / "gcs").mkdir(parents=True, exist_ok=True)
        gcs = GcsEmulator(root / "gcs", free_port(), host=bed.gateway)
        gcs.start()
        os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
        try:
            with CeleryDeployment(root, bed, gcs, workers) as running:
                yield running
        finally:
            gcs.stop()
    finally:
        bed.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="?", choices=("up", "down"), default="up")
    parser.add_argument("--name", default="dist", help="testbed name (1-8 of [a-z0-9])")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers, one per testbed host")
    parser.add_argument("--hosts", type=int, default=3, help="more testbed hosts, for training clusters")
    args = parser.parse_args(argv)
    root = Path("/tmp") / f"syncswitch-celery-{args.name}"
    if args.command == "down":
        for pid in procs.processes_with_env("SYNCSWITCH_DEPLOYMENT", str(root)):
            procs.kill(pid)
        tb.Testbed.remove_leftovers(args.name)
        for pg in glob.glob(f"/var/tmp/syncswitch-pg-{root.name}-*"):
            shutil.rmtree(pg, ignore_errors=True)
        shutil.rmtree(INSTALL_ROOT / f"syncswitch-celery-{root.name}", ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        log(f"removed what deployment {args.name} left")
        return 0
    reason = missing_prerequisites()
    if reason:
        print(f"cannot run the deployment here: {reason}", file=sys.stderr)
        return 2
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    with deployment(args.name, args.workers, args.hosts, root) as running:
        training = [h for h in running.bed.hosts if h not in running.worker_hosts]
        log(
            f"UI http://{running.gateway}:{running.api_port} (admin / syncswitch); "
            f"GCS emulator {running.storage.url}"
        )
        log("training hosts: " + ", ".join(f"{h.name} {h.address} (key {h.key_path})" for h in training))
        log("Ctrl-C or SIGTERM tears it all down")
        try:
            while not stop["now"]:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
