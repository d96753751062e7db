"""The fork server's client: what launchers and backends use to start a fork server
(syncswitch.forkserver), wait for it, claim a standby one, and have it fork nodes.

    start(DIR) / wait_ready(DIR, timeout) / status(DIR)       a server for a folder on this host
    claim(STANDBY_DIR, DIR, env, timeout)                     a cluster's server forked by a standby
    fork_node(server, argv, ...) -> ForkedProcess             a node (or another of forkserver.PROGRAMS)
    reserve_ports(ServerRef, count)                           free ports on a server's host
    read_log(ServerRef, path, offset)                         part of a node's log on a server's host

A ``ServerRef`` names a server: a folder on this host, or ``tcp`` with the cluster's token on another.
The protocol is in syncswitch.forkserver's docstring.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from syncswitch import forkserver, storage
from syncswitch.peers import host_port
from syncswitch.procs import is_alive, signal_pid, wait_until


class ForkServerUnavailable(RuntimeError):
    """No fork server answers for this folder (never started, died, or still importing past the wait)."""


@dataclass(frozen=True)
class ServerRef:
    """How a launcher reaches a fork server: its folder on this host, or ``tcp`` ("address:port") with
    the cluster's ``token`` on another host."""

    server_dir: str = ""
    tcp: str = ""
    token: str = ""

    def __str__(self) -> str:
        return f"tcp://{self.tcp}" if self.tcp else self.server_dir

    def connect(self, timeout: float) -> socket.socket:
        if not self.tcp:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout)
            conn.connect(forkserver.address_for(self.server_dir))
            return conn
        host, port = host_port(self.tcp)
        conn = socket.create_connection((host, port), timeout=timeout)
        forkserver.keep_alive(conn)
        return conn

    def stamp(self, request: dict[str, Any]) -> dict[str, Any]:
        return {**request, "token": self.token} if self.tcp else request


def start(
    server_dir: str,
    *,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
    standby: bool = False,
    idle_exit: float = forkserver.IDLE_EXIT_S,
) -> subprocess.Popen:
    """Start a server for ``server_dir`` in the background (it is ready later: see wait_ready).
    ``env`` is its whole environment (default: ours). ``die_with_parent`` ties it to the caller;
    otherwise it runs in a session of its own. A ``standby`` server waits for ``claim``; it runs in a
    session of its own too, since, once claimed, signals to its starter's process group (an Airflow
    instance stopping) must not reach the cluster's server. ``idle_exit``: see forkserver.IDLE_EXIT_S."""
    os.makedirs(server_dir, exist_ok=True)
    argv = [server_dir, *(["--standby"] if standby else []), "--idle-exit", f"{idle_exit:g}"]
    with open(os.path.join(server_dir, forkserver.LOG_FILE), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "syncswitch.forkserver", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "TF_CPP_MIN_LOG_LEVEL": "2"},
            start_new_session=standby or not die_with_parent,
            preexec_fn=forkserver.die_with_parent if die_with_parent else None,  # noqa: PLW1509 - only prctl
        )
    # Written here too, so that wait_ready sees the server starting from this moment on.
    storage.write_json(os.path.join(server_dir, forkserver.PID_FILE), forkserver.pid_record(proc.pid))
    return proc


def kill_started(server_dir: str, timeout: float = 10.0) -> int | None:
    """SIGKILL the server recorded in ``server_dir`` if that very process still runs, and wait for it
    to go; its pid, or None. A teardown's scan of /proc by environment misses a server started a few
    milliseconds before: Popen returns while the child's exec has not yet set up its environment."""
    record = storage.read_json(os.path.join(server_dir, forkserver.PID_FILE), default=None) or {}
    pid, ticks = record.get("pid"), record.get("start_ticks")
    if pid is None or ticks is None or not is_alive(pid, ticks):
        return None
    signal_pid(pid, signal.SIGKILL)
    wait_until(lambda: not is_alive(pid, ticks), timeout, poll=0.05)
    return pid


READY, STARTING, ABSENT = "ready", "starting", "absent"


def status(server_dir: str) -> str:
    """READY (accepting requests), STARTING (alive, still importing) or ABSENT."""
    ready = storage.read_json(os.path.join(server_dir, forkserver.READY_FILE), default=None)
    if ready is not None and is_alive(ready["pid"]):
        return READY
    starting = storage.read_json(os.path.join(server_dir, forkserver.PID_FILE), default=None)
    return STARTING if starting is not None and is_alive(starting["pid"]) else ABSENT


def wait_ready(server_dir: str, timeout: float) -> None:
    """Wait for the server to accept requests; ForkServerUnavailable if it never started, died, or
    is not ready within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (state := status(server_dir)) != READY:
        if state == ABSENT:
            raise ForkServerUnavailable(f"no fork server is running for {server_dir}")
        if time.monotonic() >= deadline:
            raise ForkServerUnavailable(f"the fork server for {server_dir} was not ready in {timeout:.0f}s")
        time.sleep(forkserver.TICK_SECONDS)


def claim(standby_dir: str, server_dir: str, env: dict[str, str], timeout: float) -> int | None:
    """Have the standby server of ``standby_dir`` fork the server of ``server_dir``, found by the
    markers ``env``; waits up to ``timeout`` s for one still importing. The new server's pid, or None
    where none answers: none kept, one already serves ``server_dir``, or the markers do not fit the
    placeholders."""
    try:
        wait_ready(standby_dir, timeout)  # ForkServerUnavailable at once where none runs
        conn, answer, _ = _request(
            ServerRef(server_dir=standby_dir), {"claim": {"dir": server_dir, "env": env}}, "claim"
        )
    except ForkServerUnavailable:
        return None
    conn.close()
    return int(answer["claimed"]) if "claimed" in answer else None


def tcp_address(server_dir: str) -> str:
    """The "address:port" a ready server listens on over TCP ("" without --listen)."""
    ready = storage.read_json(os.path.join(server_dir, forkserver.READY_FILE), default=None) or {}
    return str(ready.get("tcp", ""))


class ForkedProcess:
    """A node forked by the server, with the part of subprocess.Popen's interface the launcher uses.
    Signals travel over the lease, so a node on another host is signalled the same way."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()  # the launcher polls from its main and straggler threads
        self.pid = pid
        self.returncode: int | None = None
        # The lease ended without a word from the server: it died, or its host is lost (TCP keepalive).
        self.lost = False

    def poll(self) -> int | None:
        with self._lock:
            return self._poll()

    def _poll(self) -> int | None:
        if self.returncode is None:
            self._parse()
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                data = self._conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                data = b""
            self._buffer += data
            self._parse()
            if not data and self.returncode is None:
                # The server died without a word, and PR_SET_PDEATHSIG took the node with it.
                self.returncode, self.lost = -signal.SIGKILL, True
        if self.returncode is not None:
            self._conn.close()
        return self.returncode

    def _parse(self) -> None:
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "returncode" in message:
                self.returncode = int(message["returncode"])

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"node pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self._poll() is not None:  # never signal a pid the node no longer owns
                return
            with contextlib.suppress(OSError):
                self._conn.setblocking(True)
                self._conn.sendall((json.dumps({"signal": int(signum)}) + "\n").encode())

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_node(
    server: str | ServerRef,
    argv: list[str],
    *,
    env: dict[str, str],
    log: str,
    name: str,
    cpu: int | None = None,
    files: dict[str, str] | None = None,
    program: str = "node",
) -> ForkedProcess:
    """Ask the server (a folder on this host, or a ServerRef) to fork a child running ``program`` (one
    of PROGRAMS: a node, a link delay, a preflight) with ``argv``, after writing ``files`` on the
    server's host."""
    ref = server if isinstance(server, ServerRef) else ServerRef(server_dir=server)
    request = {
        "argv": argv,
        "env": env,
        "log": log,
        "name": name,
        "cpu": cpu,
        "files": files or {},
        "program": program,
    }
    conn, answer, rest = _request(ref, request, f"fork {name}")
    if "pid" not in answer:
        conn.close()
        raise ForkServerUnavailable(f"the fork server {ref} refused {name}: {answer.get('error')}")
    process = ForkedProcess(conn, int(answer["pid"]))
    process._buffer = rest
    return process


def reserve_ports(server: ServerRef, count: int) -> list[int]:
    """``count`` ports free on the server's listening address, for the nodes it is about to fork."""
    conn, answer, _ = _request(server, {"ports": count}, "reserve ports")
    conn.close()
    if "ports" not in answer:
        raise ForkServerUnavailable(f"the fork server {server} refused ports: {answer.get('error')}")
    return [int(p) for p in answer["ports"]]


def read_log(server: ServerRef, path: str, offset: int, timeout: float = 5.0) -> tuple[bytes, int]:
    """Up to ``forkserver.LOG_CHUNK`` bytes of the log ``path`` of a node the server forked, from
    ``offset``; and the offset after them. ForkServerUnavailable where the server does not answer
    within ``timeout`` or refuses."""
    conn, answer, _ = _request(server, {"read_log": path, "offset": offset}, "read a log", timeout=timeout)
    conn.close()
    if "text" not in answer:
        raise ForkServerUnavailable(f"the fork server {server} refused to read {path}: {answer.get('error')}")
    return str(answer["text"]).encode("utf-8", "surrogateescape"), int(answer["offset"])


def _request(
    ref: ServerRef, request: dict[str, Any], what: str, timeout: float = 30.0
) -> tuple[socket.socket, dict[str, Any], bytes]:
    """Send one request and read the first answer line; the connection stays open for the caller."""
    conn: socket.socket | None = None
    try:
        conn = ref.connect(timeout=timeout)
        conn.sendall((json.dumps(ref.stamp(request)) + "\n").encode())
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                raise ForkServerUnavailable(f"the fork server {ref} closed without answering ({what})")
            reply += chunk
    except OSError as exc:
        if conn is not None:
            conn.close()
        raise ForkServerUnavailable(f"the fork server {ref} did not answer ({what}): {exc}") from exc
    conn.settimeout(None)
    line, rest = reply.split(b"\n", 1)
    return conn, json.loads(line), rest
