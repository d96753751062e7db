"""The embedded Airflow's supervisor: runs its components and restarts any that dies or hangs.

    python -m syncswitch_airflow.embedded.supervisor      (started by EmbeddedAirflow, env included)

It replaces ``airflow standalone``, which starts each component once and never restarts it (a killed
triggerer would leave every deferred segment waiting for a person). The rules:

- the metadata database is migrated first, unless it is a SQLite file that a migration left at its
  revision under the same Airflow packages and settings (``MigrationStamp``);
- each component runs as ``airflow <component>``, its output in ``logs/components/<name>.log``,
  at nice 10 (a local cluster its tasks start inherits it), dying with the supervisor
  (PR_SET_PDEATHSIG);
- a component that exits is restarted after a backoff (1 s doubling up to 60 s, reset once it has
  run for 10 minutes), with one line in ``embedded.log`` saying which, how it ended and the
  how-many-th restart it is;
- the api-server is probed: its health endpoint is asked every ``PROBE_SECONDS``. It is SIGKILLed
  and restarted like a dead one when it has not answered within the *boot limit* of its start
  (``BOOT_SECONDS``, ``$SYNCSWITCH_AIRFLOW_API_BOOT_SECONDS``), or, once it has answered, for the
  *hung limit* (``HUNG_SECONDS``, ``$SYNCSWITCH_AIRFLOW_API_HUNG_SECONDS``). Every task talks to it
  (the execution API), so one that never serves would stall every run while its clusters train on.
  Each limit doubles with each kill of its kind in the last hour, up to ``LIMIT_GROWTH`` times, so
  that a merely overloaded api-server is not killed again and again. Any HTTP answer counts, even an
  error (a database error is not the api-server's to fix);
- ``components.json`` says where each component stands (phase, pid, restarts, last exit, and for the
  api-server whether it has answered since its start and when last);
- the supervisor is a child subreaper: what a dead component leaves behind (a SIGKILLed scheduler's
  executor workers) is killed before the component restarts; detached training processes (sessions
  of their own) are left alone and only reaped;
- SIGTERM stops the components in order (``Supervisor._shutdown``);
- a component log past ``LOG_BYTES`` is copied to ``<name>.log.1`` and truncated, so a week-long job
  keeps at most twice that per component.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncswitch import procs

from syncswitch_airflow.embedded import sqlite_settings

COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")
STATUS_FILE = "components.json"
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
HEALTHY_RUN_SECONDS = 600.0  # a component that ran this long gets its backoff reset
SECOND_SIGNAL_SECONDS = 10.0
SIGNAL_AGAIN = ("scheduler", "api-server")  # components that take a second SIGTERM as "stop waiting"
STOP_GRACE_SECONDS = 30.0
LEFTOVER_GRACE_SECONDS = 3.0
LOG_BYTES = 16 * 1024 * 1024
NICENESS = 10
PROBED = "api-server"
CONNECT_ARGS_ENV = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"
PROBE_SECONDS = 10.0
PROBE_TIMEOUT_SECONDS = 5.0
BOOT_SECONDS = 300.0  # no answer this long after its start: killed, restarted (a loaded boot takes minutes)
BOOT_SECONDS_ENV = "SYNCSWITCH_AIRFLOW_API_BOOT_SECONDS"
HUNG_SECONDS = 60.0  # unanswered this long (six probes) once it has answered: killed, restarted
HUNG_SECONDS_ENV = "SYNCSWITCH_AIRFLOW_API_HUNG_SECONDS"
LIMIT_WINDOW_SECONDS = 3600.0  # the kills that raise the next limit of their kind
LIMIT_GROWTH = 8  # a limit is at most this many times its base
_TICK_SECONDS = 1.0
_ORPHAN_SCAN_SECONDS = 60.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} embedded airflow: {message}", flush=True)


@dataclass(frozen=True)
class ProbeLimits:
    """When the probed component is killed: ``boot`` s without an answer since its start, ``hung`` s
    without one once it has answered; asked every ``interval`` s, each probe waiting ``timeout`` s."""

    boot: float = BOOT_SECONDS
    hung: float = HUNG_SECONDS
    interval: float = PROBE_SECONDS
    timeout: float = PROBE_TIMEOUT_SECONDS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProbeLimits:
        return cls(
            boot=seconds_setting(environ, BOOT_SECONDS_ENV, BOOT_SECONDS),
            hung=seconds_setting(environ, HUNG_SECONDS_ENV, HUNG_SECONDS),
        )


@dataclass
class Component:
    name: str
    log_path: str
    process: subprocess.Popen | None = field(default=None, repr=False)
    pid: int | None = None
    started_at: float | None = None
    restarts: int = 0
    last_exit: int | None = None
    next_start: float = 0.0
    backoff: float = FIRST_BACKOFF_SECONDS
    started_monotonic: float = 0.0
    probed: bool = False
    answered_at: float | None = None  # the last answer since its start (monotonic)
    last_answer_at: float | None = None  # the same, wall time, for people
    boot_kills: list[float] = field(default_factory=list)  # when it was killed for never answering
    hung_kills: list[float] = field(default_factory=list)  # when it was killed for no longer answering
    next_probe: float = 0.0

    def status(self) -> dict[str, Any]:
        status = {
            "pid": self.pid,
            "running": self.process is not None and self.process.poll() is None,
            "started_at": self.started_at,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "log": self.log_path,
        }
        if self.probed:
            status["answered"] = self.answered_at is not None  # since its start
            status["last_answer_at"] = self.last_answer_at
        return status


class Supervisor:
    """``commands``: each component's command line and ``migrate``'s (default: Airflow's); ``limits``:
    the api-server's probe (default: from ``environ``)."""

    def __init__(
        self,
        home: Path,
        environ: Mapping[str, str] | None = None,
        commands: Mapping[str, list[str]] | None = None,
        limits: ProbeLimits | None = None,
    ) -> None:
        self.home = home
        self.environ = dict(os.environ if environ is None else environ)
        self.commands = dict(commands or default_commands())
        self.log_dir = home / "logs" / "components"
        self.components = {
            name: Component(name, str(self.log_dir / f"{name}.log"), probed=name == PROBED)
            for name in COMPONENTS
        }
        self.phase = "starting"
        self.stopping = False
        self.health_url = _health_url(self.environ)
        self.limits = limits or ProbeLimits.from_environ(self.environ)
        self._status_written = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGTERM, self._stop_signal)
        signal.signal(signal.SIGINT, self._stop_signal)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._set_phase("migrating the metadata database")
        if not self._migrate():
            self._set_phase("failed: airflow db migrate")
            return 1
        self._set_phase("running")
        next_orphan_scan = 0.0
        while not self.stopping:
            now = time.monotonic()
            died = [c for c in self.components.values() if self._supervise(c, now)]
            # Orphans appear when a component dies; a scan of /proc is not free on a busy machine.
            if died or now >= next_orphan_scan:
                self._reap_orphans()
                next_orphan_scan = now + _ORPHAN_SCAN_SECONDS
            if died or now - self._status_written >= _ORPHAN_SCAN_SECONDS:
                self._write_status()
                self._rotate_logs()
            time.sleep(_TICK_SECONDS)
        self._shutdown()
        return 0

    def _stop_signal(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def _migrate(self) -> bool:
        stamp = MigrationStamp(self.home, self.environ)
        if stamp.is_current():
            log("the metadata database is migrated for these Airflow packages and settings: no migration")
            return True
        log("migrating the metadata database")
        stamp.forget()  # written again only once this migration has succeeded
        with open(self.log_dir / "db-migrate.log", "ab") as out:
            done = subprocess.run(
                self.commands["migrate"], env=self.environ, stdout=out, stderr=subprocess.STDOUT
            )
        if done.returncode != 0:
            log(f"`airflow db migrate` failed with {done.returncode}; see {self.log_dir / 'db-migrate.log'}")
            return False
        stamp.record()
        return True

    # ---- components ------------------------------------------------------------------------

    def _supervise(self, component: Component, now: float) -> bool:
        """Start, watch or restart one component; True if it was found dead just now."""
        if component.process is not None:
            code = component.process.poll()
            if code is None:
                if component.started_at and time.time() - component.started_at > HEALTHY_RUN_SECONDS:
                    component.backoff = FIRST_BACKOFF_SECONDS
                if component.probed and self.health_url:
                    self._probe(component, now)
                return False
            component.process, component.last_exit = None, code
            component.next_start = now + component.backoff
            log(
                f"{component.name} (pid {component.pid}) exited with {code}; restarting it in "
                f"{component.backoff:.0f} s (restart {component.restarts + 1})"
            )
            component.backoff = min(component.backoff * 2, MAX_BACKOFF_SECONDS)
            component.restarts += 1
            return True
        if now >= component.next_start:
            self._start(component)
            self._write_status()
        return False

    def _probe(self, component: Component, now: float) -> None:
        """Ask the health endpoint every ``limits.interval``; SIGKILL the component (the restart
        follows on the next tick) once it is past its boot or hung limit (``_overdue``)."""
        if now < component.next_probe:
            return
        component.next_probe = now + self.limits.interval
        answered = answers(self.health_url, self.limits.timeout)
        checked = time.monotonic()  # after the probe, which may have waited its timeout
        if answered:
            first = component.answered_at is None
            component.answered_at, component.last_answer_at = checked, time.time()
            if first:
                waited = checked - component.started_monotonic
                log(f"{component.name} (pid {component.pid}) answers, {waited:.0f} s after its start")
                self._write_status()
            return
        overdue = self._overdue(component, checked)
        if overdue:
            log(f"{component.name} (pid {component.pid}) {overdue}")
            component.process.kill()
            component.process.wait()

    def _overdue(self, component: Component, checked: float) -> str | None:
        """Why an unanswering component is to be killed now (and the kill counted), or None: no
        answer within the boot limit of its start, or within the hung limit of its last answer."""
        booting = component.answered_at is None
        kills = component.boot_kills if booting else component.hung_kills
        limit = grown_limit(self.limits.boot if booting else self.limits.hung, kills, checked)
        silent = checked - (component.started_monotonic if booting else component.answered_at)
        if silent < limit:
            return None
        kills.append(checked)
        if booting:
            return (
                f"started at {clock(component.started_at)}, no answer since ({silent:.0f} s, boot limit "
                f"{limit:.0f} s): killing it (no answer since its start)"
            )
        return (
            f"has not answered {self.health_url} since {clock(component.last_answer_at)} ({silent:.0f} s, "
            f"limit {limit:.0f} s): killing it (hung)"
        )

    def _start(self, component: Component) -> None:
        with open(component.log_path, "ab") as out:
            component.process = subprocess.Popen(
                self.commands[component.name],
                env=component_env(component.name, self.environ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_component_preexec,  # noqa: PLW1509 - only prctl and nice
            )
        component.pid, component.started_at = component.process.pid, time.time()
        component.started_monotonic = time.monotonic()
        component.answered_at, component.last_answer_at, component.next_probe = None, None, 0.0
        what = "started" if component.restarts == 0 else "restarted"
        log(f"{component.name} {what} as pid {component.pid} (log {component.log_path})")

    def _rotate_logs(self) -> None:
        for component in self.components.values():
            try:
                if os.path.getsize(component.log_path) > LOG_BYTES:
                    rotate_log(component.log_path)
            except OSError:
                continue

    def _reap_orphans(self) -> None:
        """Kill and reap processes left behind by a dead component (they are re-parented to us, the
        subreaper). Only those pids are waited for: a wait on any child would steal a component's
        exit status from its Popen."""
        components = {c.process.pid for c in self.components.values() if c.process is not None}
        group = os.getpgid(0)
        for child in procs.children_of(os.getpid()):
            if child.pid in components:
                continue
            # Detached training processes (segment launchers) land here too once the task that
            # started them exits: they run in sessions of their own and must live on. (Not told by
            # their environment: setproctitle writes an executor worker's title over its copy.)
            if child.alive and child.pgid == group:
                log(f"killing pid {child.pid}, left behind by a component that died")
                procs.kill(child.pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, os.WNOHANG)

    def _shutdown(self) -> None:
        """One SIGTERM each; a second one to the scheduler and the api-server if they still run
        after SECOND_SIGNAL_SECONDS (they then stop waiting for running tasks and for open
        connections: Airflow's and uvicorn's "signal again to force"); SIGKILL after
        STOP_GRACE_SECONDS. Never a second signal to the triggerer: it takes one at once as "force
        exit", and its trigger runner is then SIGKILLed."""
        self._set_phase("stopping")
        running = [c for c in self.components.values() if c.process is not None and c.process.poll() is None]
        for component in running:
            component.process.terminate()
        started = time.monotonic()
        procs.wait_until(lambda: all(c.process.poll() is not None for c in running), SECOND_SIGNAL_SECONDS)
        for component in running:
            if component.name in SIGNAL_AGAIN and component.process.poll() is None:
                log(f"{component.name} still runs {SECOND_SIGNAL_SECONDS:.0f} s after SIGTERM: SIGTERM again")
                component.process.terminate()
        deadline = started + STOP_GRACE_SECONDS
        for component in running:
            try:
                component.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log(f"{component.name} did not stop in {STOP_GRACE_SECONDS:.0f} s: SIGKILL")
                component.process.kill()
                component.process.wait()
        self._stop_leftovers()
        self._set_phase("stopped")
        log("stopped")

    def _stop_leftovers(self) -> None:
        """What no component took with it (a task process or an executor worker left to us, the
        subreaper, by a component that died or exited first; a SIGKILLed scheduler's workers ignore
        SIGTERM) gets one SIGTERM, then SIGKILL after LEFTOVER_GRACE_SECONDS, so that the instance's
        process group is gone when we are. Detached training processes run in sessions of their own
        and are not touched."""
        me = os.getpid()
        group = os.getpgid(me)

        def leftovers() -> list[int]:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap our dead children first
                    pass
            return [pid for pid in procs.processes_in_group(group) if pid != me]

        left = leftovers()
        if not left:
            return
        log(f"stopping {len(left)} leftover process(es) of the instance: {left}")
        for pid in left:
            procs.signal_pid(pid, signal.SIGTERM)
        if not procs.wait_until(lambda: not leftovers(), LEFTOVER_GRACE_SECONDS):
            for pid in leftovers():
                log(f"leftover pid {pid} still runs after {LEFTOVER_GRACE_SECONDS:.0f} s: SIGKILL")
                procs.kill(pid)

    # ---- status ------------------------------------------------------------------------------

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self._write_status()

    def _write_status(self) -> None:
        status = {
            "pid": os.getpid(),
            "phase": self.phase,
            "updated_at": time.time(),
            "components": {name: c.status() for name, c in self.components.items()},
        }
        tmp = self.home / f".{STATUS_FILE}.tmp"
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.home / STATUS_FILE)
        self._status_written = time.monotonic()


class MigrationStamp:
    """What the last successful ``airflow db migrate`` of a SQLite database left: the database's
    revision, and a digest of what a migration depends on (the installed apache-airflow packages,
    whose versions and database managers decide the schema, and the ``AIRFLOW__*`` settings and
    airflow.cfg, which decide the log template and the external managers it syncs). A migration is
    skipped only while all of them are unchanged; any other database (PostgreSQL) is always migrated."""

    FILE = "migrated.json"
    # Sections with no tables (this provider's; where metrics are sent): no migration depends on them.
    WITHOUT_TABLES = ("AIRFLOW__SYNCSWITCH__", "AIRFLOW__METRICS__")
    # Ports an instance picks as it starts: no migration depends on them.
    PER_START = frozenset(
        f"AIRFLOW__{key}"
        for key in (
            "API__PORT",
            "API__BASE_URL",
            "CORE__EXECUTION_API_SERVER_URL",
            "LOGGING__WORKER_LOG_SERVER_PORT",
            "LOGGING__TRIGGER_LOG_SERVER_PORT",
        )
    )

    def __init__(self, home: Path, environ: Mapping[str, str]) -> None:
        self.path = home / self.FILE
        self.home = home
        self.environ = environ
        url = environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
        self.database = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None

    def is_current(self) -> bool:
        if self.database is None:
            return False
        try:
            recorded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        revision = self._revision()
        return revision is not None and recorded == {"revision": revision, "digest": self._digest()}

    def record(self) -> None:
        revision = self._revision()
        if revision is not None:
            self.path.write_text(json.dumps({"revision": revision, "digest": self._digest()}))

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)

    def _revision(self) -> str | None:
        """The database's alembic revision (read-only, without importing Airflow); None if none."""
        if self.database is None or not self.database.is_file():
            return None
        try:
            with contextlib.closing(sqlite3.connect(f"file:{self.database}?mode=ro", uri=True)) as db:
                rows = db.execute("SELECT version_num FROM alembic_version").fetchall()
        except sqlite3.Error:
            return None
        return rows[0][0] if len(rows) == 1 else None

    def _digest(self) -> str:
        packages = sorted(
            f"{dist.metadata['Name']}=={dist.version}"
            for dist in importlib.metadata.distributions()
            if (dist.metadata["Name"] or "").lower().startswith("apache-airflow")
        )
        settings = sorted(
            f"{k}={v}"
            for k, v in self.environ.items()
            if k.startswith("AIRFLOW__") and k not in self.PER_START and not k.startswith(self.WITHOUT_TABLES)
        )
        try:
            config = (self.home / "airflow.cfg").read_text()
        except OSError:
            config = ""
        return hashlib.sha256("\n".join([*packages, *settings, config]).encode()).hexdigest()


def read_status(home: Path) -> dict[str, Any] | None:
    """The supervisor's ``components.json``, or None."""
    try:
        return json.loads((home / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def rotate_log(path: str) -> None:
    """Copy the log to ``<path>.1`` (replacing the one before) and truncate it in place: its writer
    keeps its append-mode descriptor and goes on at the start. Lines written between the copy and the
    truncation are lost (the same trade as logrotate's copytruncate)."""
    shutil.copyfile(path, f"{path}.1")
    os.truncate(path, 0)
    name = os.path.basename(path)
    log(f"{name} passed {LOG_BYTES // (1024 * 1024)} MB: the older lines are in {name}.1")


def _health_url(environ: Mapping[str, str]) -> str | None:
    """The api-server's health endpoint under the instance's own URL (``[api] base_url``, which
    instance.py writes as the address this machine reaches it at); None where it is not set."""
    base_url = environ.get("AIRFLOW__API__BASE_URL")
    return f"{base_url.rstrip('/')}/api/v2/monitor/health" if base_url else None


def seconds_setting(environ: Mapping[str, str], name: str, default: float) -> float:
    """``environ[name]`` as seconds, or ``default`` where unset or not a positive number."""
    raw = environ.get(name, "")
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    if raw:
        log(f"{name}={raw!r} is not a positive number of seconds: {default:.0f} s instead")
    return default


def grown_limit(base: float, kills: list[float], now: float) -> float:
    """``base``, doubled for each of ``kills`` (monotonic times) within the last
    LIMIT_WINDOW_SECONDS, up to LIMIT_GROWTH times ``base``."""
    recent = sum(1 for moment in kills if now - moment < LIMIT_WINDOW_SECONDS)
    return base * min(2**recent, LIMIT_GROWTH)


def clock(moment: float | None) -> str:
    """A wall time as the log's HH:MM:SS, or "never"."""
    return "never" if moment is None else time.strftime("%H:%M:%S", time.localtime(moment))


def answers(url: str, timeout: float) -> bool:
    """Whether ``url`` gives any HTTP answer (an error status too) within ``timeout`` seconds."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        with direct.open(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _component_preexec() -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    os.nice(NICENESS)


def component_env(name: str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment of component ``name``: the supervisor's, and for the api-server on SQLite a
    shorter wait for the database's write lock (``sqlite_settings``: a stall that it bounds)."""
    env = dict(env)
    if name == "api-server" and env.get(CONNECT_ARGS_ENV) == sqlite_settings.CONNECT_ARGS_PATH:
        env[CONNECT_ARGS_ENV] = sqlite_settings.API_SERVER_CONNECT_ARGS_PATH
    return env


def default_commands() -> dict[str, list[str]]:
    """``airflow <component>`` for each component (the triggerer through ``embedded/triggerer.py``,
    which builds its execution API as it starts) and ``airflow db migrate``."""
    airflow = str(Path(sys.executable).parent / "airflow")
    commands = {name: [airflow, name] for name in COMPONENTS}
    commands["triggerer"] = [sys.executable, "-m", "syncswitch_airflow.embedded.triggerer"]
    commands["migrate"] = [airflow, "db", "migrate"]
    return commands


def main() -> int:
    home = os.environ.get("AIRFLOW_HOME")
    if not home:
        print("airflow_supervisor: AIRFLOW_HOME must be set", file=sys.stderr)
        return 2
    return Supervisor(Path(home)).run()


if __name__ == "__main__":
    sys.exit(main())
