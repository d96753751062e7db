"""The embedded Airflow supervisor's log rotation, with a real writer holding its log open as the
components do (stdout in append mode), its migration stamp on a real migrated database, its
api-server probe against real sockets (the probe's kill and restart of a hung api-server:
test_airflow_faults), and the boot's wait for a DAG through an API that answers late."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from proc_utils import wait_for
from syncswitch_airflow.embedded import airflow_api, airflow_http, boot, sqlite_settings
from syncswitch_airflow.embedded.instance import InstanceRecord
from syncswitch_airflow.embedded.supervisor import (
    BOOT_SECONDS,
    BOOT_SECONDS_ENV,
    CONNECT_ARGS_ENV,
    HUNG_SECONDS,
    HUNG_SECONDS_ENV,
    MigrationStamp,
    ProbeLimits,
    answers,
    component_env,
    grown_limit,
    read_status,
    rotate_log,
)

WRITER = """
import sys, time
for i in range(1_000_000):
    print(f"line {i}", flush=True)
    time.sleep(0.002)
"""


def test_a_rotated_log_keeps_its_old_lines_and_the_writer_goes_on_at_the_start(tmp_path: Path) -> None:
    path = tmp_path / "api-server.log"
    with open(path, "ab") as out:
        writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: path.stat().st_size > 20_000, timeout=30, what="the writer to write 20 kB")
        before = path.stat().st_size
        rotate_log(str(path))
        kept = (tmp_path / "api-server.log.1").read_text()
        assert len(kept) >= before and kept.startswith("line 0\n")
        time.sleep(0.5)
    finally:
        writer.kill()
        writer.wait()
    after = path.read_bytes()
    # Appended at the new end (0), not at the old offset: no hole of NUL bytes, and much smaller.
    assert after and b"\0" not in after and len(after) < len(kept)
    first = int(after.decode().splitlines()[0].split()[1])
    last_kept = int(kept.splitlines()[-1].split()[1])
    assert first > last_kept  # the lines go on from where the copy ended (a few may fall between)


# ---- the migration skipped where it would change nothing ---------------------------------------------


def _migrated_copy(tmp_path: Path) -> dict[str, str]:
    """A copy of the session's migrated SQLite database, and the settings of an instance on it."""
    from airflow.configuration import conf

    source = conf.get("database", "sql_alchemy_conn").removeprefix("sqlite:///")
    shutil.copyfile(source, tmp_path / "airflow.db")
    (tmp_path / "airflow.cfg").write_text("[core]\n")
    return {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__API__PORT": "8080",
        "PATH": "/usr/bin",
    }


@pytest.mark.usefixtures("airflow_db")
def test_a_migration_is_skipped_only_while_the_revision_packages_and_settings_are_those_it_left(
    tmp_path: Path,
) -> None:
    environ = _migrated_copy(tmp_path)
    assert not MigrationStamp(tmp_path, environ).is_current()  # never recorded
    MigrationStamp(tmp_path, environ).record()
    assert MigrationStamp(tmp_path, environ).is_current()
    # A port the next start picks, a section without tables, or a variable that is not Airflow's: nothing.
    same = {
        **environ,
        "AIRFLOW__API__PORT": "8081",
        "AIRFLOW__SYNCSWITCH__GCP_CONN_ID": "x",
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "PATH": "/bin",
    }
    assert MigrationStamp(tmp_path, same).is_current()
    # Any other Airflow setting, or airflow.cfg, might (the log template, the auth manager's tables).
    assert not MigrationStamp(tmp_path, {**environ, "AIRFLOW__CORE__PARALLELISM": "8"}).is_current()
    assert not MigrationStamp(tmp_path, {**environ, "AIRFLOW__CORE__AUTH_MANAGER": "x.Y"}).is_current()
    (tmp_path / "airflow.cfg").write_text("[logging]\nlog_filename_template = x\n")
    assert not MigrationStamp(tmp_path, environ).is_current()
    (tmp_path / "airflow.cfg").write_text("[core]\n")
    assert MigrationStamp(tmp_path, environ).is_current()
    # The database at another revision (another Airflow migrated or downgraded it), or gone.
    with contextlib.closing(sqlite3.connect(tmp_path / "airflow.db")) as db, db:
        db.execute("UPDATE alembic_version SET version_num = 'abc123'")
    assert not MigrationStamp(tmp_path, environ).is_current()
    (tmp_path / "airflow.db").unlink()
    assert not MigrationStamp(tmp_path, environ).is_current()


@pytest.mark.usefixtures("airflow_db")
def test_a_database_other_than_sqlite_is_always_migrated(tmp_path: Path) -> None:
    environ = _migrated_copy(tmp_path)
    MigrationStamp(tmp_path, environ).record()
    postgres = {**environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://u:p@h:5432/db"}
    assert not MigrationStamp(tmp_path, postgres).is_current()


class _Failing(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_error(500, "database error")

    def log_message(self, *_args: object) -> None:
        pass


def test_the_api_server_probe_counts_any_http_answer_and_not_a_silent_or_closed_port() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert answers(f"http://127.0.0.1:{server.server_port}/api/v2/monitor/health", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    # A hung server: the kernel accepts the connection (the listen backlog), nothing answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        assert not answers(f"http://127.0.0.1:{silent.getsockname()[1]}/", timeout=0.5)
        assert time.monotonic() - started < 5
        closed = silent.getsockname()[1]
    assert not answers(f"http://127.0.0.1:{closed}/", timeout=0.5)


@pytest.mark.parametrize(
    ("raw", "factor"), [("", None), ("25", 25.0), ("0", None), ("x", None), ("-3", None)]
)
def test_the_api_servers_limits_are_positive_numbers_of_seconds(raw: str, factor: float | None) -> None:
    environ = {HUNG_SECONDS_ENV: raw, BOOT_SECONDS_ENV: raw} if raw else {}
    limits = ProbeLimits.from_environ(environ)
    assert (limits.hung, limits.boot) == ((factor, factor) if factor else (HUNG_SECONDS, BOOT_SECONDS))
    assert BOOT_SECONDS > HUNG_SECONDS  # a boot is slower than an answer


def _answer_json(handler: http.server.BaseHTTPRequestHandler, body: dict) -> None:
    """A 200 with ``body`` as JSON, as Airflow's REST API answers."""
    raw = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


class _SlowFirstLook(http.server.BaseHTTPRequestHandler):
    """Airflow's REST API as a loaded api-server just after its start serves it: the first look at
    the import errors comes after the client's timeout, then every answer comes at once."""

    looks: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.looks.append(self.path)
        if self.path.startswith("/api/v2/importErrors") and len(self.looks) == 1:
            time.sleep(1.5)
        body = {"import_errors": []} if "importErrors" in self.path else {"dag_id": "sync_switch"}
        _answer_json(self, body)

    def log_message(self, *_args: object) -> None:
        pass


@dataclass
class _ApiOnly:
    """A booting instance (``boot.Booting``) that is only its REST API."""

    api: airflow_api.AirflowApi
    home: Path = Path("home")
    log_path: Path = Path("log")
    dags_folder: Path = Path("dags")
    url: str = "http://127.0.0.1"

    def record(self) -> InstanceRecord:
        raise NotImplementedError

    def check_alive(self) -> None:
        pass

    def command(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        raise NotImplementedError


def test_the_wait_for_a_dag_outlasts_an_api_that_answers_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen on a loaded CI machine: a healthy api-server's first import-errors answer took over 30 s,
    # and the boot raised the client's TimeoutError instead of waiting on for the DAG.
    monkeypatch.setattr(airflow_http, "_HTTP_TIMEOUT_S", 0.5)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowFirstLook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = airflow_api.AirflowApi(f"http://127.0.0.1:{server.server_port}", "u", "p")
        monkeypatch.setattr(api, "token", lambda: "token")
        boot.wait_for_dag(_ApiOnly(api), "sync_switch", deadline=time.monotonic() + 30)
    finally:
        server.shutdown()
        server.server_close()
    assert _SlowFirstLook.looks[0].startswith("/api/v2/importErrors")
    assert "/api/v2/dags/sync_switch" in _SlowFirstLook.looks


class _KilledMidMark(http.server.BaseHTTPRequestHandler):
    """Airflow's REST API as the supervisor's kill of a hung api-server leaves it: the first "mark
    run failed" request is cut off without an answer, then the restarted api-server serves; the run
    has ended, every task finished."""

    requests: list[str] = []

    def do_PATCH(self) -> None:  # noqa: N802 - http.server's name
        self.requests.append(f"PATCH {self.path}")
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.requests.count(f"PATCH {self.path}") == 1:
            self.close_connection = True  # no answer: the client sees RemoteDisconnected
            return
        _answer_json(self, {"state": "failed"})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.requests.append(f"GET {self.path}")
        ended = {"task_instances": [{"task_id": "teardown_cluster", "state": "success"}]}
        _answer_json(self, ended if "/taskInstances" in self.path else {"state": "failed"})

    def log_message(self, *_args: object) -> None:
        pass


def test_failing_a_run_rides_out_an_api_server_killed_mid_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen in the suite: a sweep's Ctrl-C came as the supervisor killed a hung api-server, and the
    # mark's RemoteDisconnected ended the command with a traceback, the run left going.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KilledMidMark)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = airflow_api.AirflowApi(f"http://127.0.0.1:{server.server_port}", "u", "p")
        monkeypatch.setattr(api, "token", lambda: "token")
        assert api.fail_run("sync_switch", "r1", teardown_seconds=30, poll_seconds=0.1)
    finally:
        server.shutdown()
        server.server_close()
    mark = "PATCH /api/v2/dags/sync_switch/dagRuns/r1"
    assert _KilledMidMark.requests[:2] == [mark, mark], _KilledMidMark.requests
    assert "GET /api/v2/dags/sync_switch/dagRuns/r1/taskInstances?limit=1000" in _KilledMidMark.requests


class _LockedThenCut(http.server.BaseHTTPRequestHandler):
    """Airflow's clear endpoint: the first request meets a locked database (500, rolled back), the
    second is served but its answer is cut off, the third would be served."""

    requests: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.requests.append(self.path)
        if len(self.requests) == 1:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif len(self.requests) == 2:
            self.close_connection = True  # no answer: served or not, the client cannot tell
        else:
            _answer_json(self, {"task_instances": [{"task_id": "segment_0.bsp"}]})

    def log_message(self, *_args: object) -> None:
        pass


def test_a_clear_is_sent_again_after_a_database_error_but_not_after_a_lost_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clear done twice would clear again the tasks the first one restarted: the client repeats it
    after a 5xx (nothing happened) and not after a cut-off answer (it may have happened)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LockedThenCut)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = airflow_api.AirflowApi(f"http://127.0.0.1:{server.server_port}", "u", "p")
        monkeypatch.setattr(api, "token", lambda: "token")
        with pytest.raises(OSError):
            api.clear_tasks("sync_switch", "r1", ["segment_0.bsp"])
    finally:
        server.shutdown()
        server.server_close()
    assert _LockedThenCut.requests == ["/api/v2/dags/sync_switch/clearTaskInstances"] * 2


def test_only_the_api_server_on_sqlite_waits_less_for_the_write_lock() -> None:
    on_sqlite = {CONNECT_ARGS_ENV: sqlite_settings.CONNECT_ARGS_PATH, "PATH": "/bin"}
    api_server = component_env("api-server", on_sqlite)
    assert api_server == {**on_sqlite, CONNECT_ARGS_ENV: sqlite_settings.API_SERVER_CONNECT_ARGS_PATH}
    assert component_env("scheduler", on_sqlite) == on_sqlite
    # A deployment's own connect args (or none: PostgreSQL) are left as they are.
    assert component_env("api-server", {CONNECT_ARGS_ENV: "mine.ARGS"}) == {CONNECT_ARGS_ENV: "mine.ARGS"}
    assert component_env("api-server", {"PATH": "/bin"}) == {"PATH": "/bin"}
    assert sqlite_settings.API_SERVER_CONNECT_ARGS["timeout"] < sqlite_settings.CONNECT_ARGS["timeout"]


def test_a_limit_doubles_with_each_recent_kill_up_to_its_growth() -> None:
    """A live api-server on a machine so loaded that it goes the limit without answering is killed
    once; killed again at once after each restart, it would never serve: each kill in the last hour
    doubles the next limit."""
    now = 10_000.0
    assert grown_limit(20.0, [], now) == 20.0
    assert grown_limit(20.0, [now - 100], now) == 40.0
    assert grown_limit(20.0, [now - 300, now - 100], now) == 80.0
    assert grown_limit(20.0, [now - 500 + i for i in range(6)], now) == 160.0  # at most 8 x
    assert grown_limit(20.0, [now - 4000, now - 100], now) == 40.0  # over an hour ago: forgotten


# ---- the boot limit, with stand-in components ---------------------------------------------------------

STAND_IN_API_SERVER = """
import http.server, pathlib, socket, sys, time
port, starts = int(sys.argv[1]), pathlib.Path(sys.argv[2])
starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
if len(starts.read_text()) < 3:  # the first two starts wedge: the port open, no answer ever
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind(("127.0.0.1", port))
    silent.listen(8)
    time.sleep(3600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

SUPERVISOR_WITH_STAND_INS = """
import json, sys
from dataclasses import dataclass
from pathlib import Path
from syncswitch_airflow.embedded.supervisor import ProbeLimits, Supervisor
limits = ProbeLimits(boot=2.0, hung=60.0, interval=0.5, timeout=0.5)
sys.exit(Supervisor(Path(sys.argv[1]), commands=json.loads(sys.argv[2]), limits=limits).run())
"""


def test_an_api_server_that_never_answers_after_its_start_is_killed_at_a_growing_boot_limit(
    tmp_path: Path,
) -> None:
    """A real supervisor over stand-in components: an api-server that wedges before its first answer
    is killed once the boot limit has passed since its start (2 s here), the next one at twice
    that; the third start answers, and components.json says so."""
    from gcs_emulator import free_port

    port = free_port()
    (tmp_path / "api.py").write_text(STAND_IN_API_SERVER)
    idle = [sys.executable, "-c", "import time; time.sleep(3600)"]
    commands = {name: idle for name in ("scheduler", "dag-processor", "triggerer")}
    commands["api-server"] = [sys.executable, str(tmp_path / "api.py"), str(port), str(tmp_path / "starts")]
    commands["migrate"] = ["true"]
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}"}
    argv = [sys.executable, "-c", SUPERVISOR_WITH_STAND_INS, str(tmp_path), json.dumps(commands)]
    log = tmp_path / "embedded.log"
    with open(log, "wb") as out:
        # A session of its own, as EmbeddedAirflow starts it: at its stop it ends its whole group.
        supervisor = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(
            lambda: (read_status(tmp_path) or {}).get("components", {}).get("api-server", {}).get("answered"),
            timeout=90,
            what="the third api-server to answer",
        )
    finally:
        supervisor.terminate()
        supervisor.wait(timeout=60)
    kills = [line for line in log.read_text().splitlines() if "killing it" in line]
    assert len(kills) == 2, log.read_text()
    assert all("no answer since ((" not in k and "no answer since its start" in k for k in kills), kills
    assert all(re.search(r"started at \d\d:\d\d:\d\d, no answer since", k) for k in kills), kills
    assert [re.search(r"boot limit (\d+) s", k).group(1) for k in kills] == ["2", "4"], kills
    api_server = read_status(tmp_path)["components"]["api-server"]
    assert api_server["restarts"] == 2 and api_server["answered"] and api_server["last_answer_at"]
    assert "answered" not in read_status(tmp_path)["components"]["scheduler"]  # only the probed one
    assert supervisor.returncode == 0
    assert len((tmp_path / "starts").read_text()) == 3
