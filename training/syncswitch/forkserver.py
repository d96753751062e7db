"""A warm process that has imported TensorFlow once and forks cluster processes on request.

Starting a segment's cluster used to mean 3-4 fresh Python processes importing TensorFlow at the same
time: 15-50 s on 2 cores, most of a switch. The fork server pays that import once. The local backend
starts one per cluster when it provisions it, so every segment's processes are forked warm; a launcher
given none starts its own, so even a lone segment imports TensorFlow once instead of once per process.

    python -m syncswitch.forkserver DIR     serve until SIGTERM, or until DIR is removed

DIR holds the server's files:
    forkserver.pid    written at start (the server is alive, maybe still importing)
    forkserver.json   written once it accepts requests: {"pid", "address", "preload_seconds"}
    forkserver.log    its own output (nodes log to the files their requests name)

Protocol: a Unix socket in the abstract namespace (no 108-byte path limit, nothing left on disk), one
connection per node, one JSON object per line:
    client -> server  {"argv": [node args], "env": {...}, "log": PATH, "cpu": N or null, "name": "worker-1"}
    server -> client  {"pid": 1234}              once the node is forked
    server -> client  {"returncode": 0}          when it exits (Popen's convention: -N = killed by signal N)
The connection is the node's lease: when the client goes away (even by SIGKILL) the server kills the
node, as PR_SET_PDEATHSIG does for a process the client started itself. Nodes get PR_SET_PDEATHSIG
on the server, so nothing outlives it either.

Forking is safe here because the server only imports: it never creates a TensorFlow context, thread
pool or gRPC channel, so a child starts with a clean runtime and sets its own thread counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from syncswitch import storage
from syncswitch.procs import is_alive

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
TICK_SECONDS = 0.2
READY_FILE = "forkserver.json"
PID_FILE = "forkserver.pid"
LOG_FILE = "forkserver.log"


class ForkServerUnavailable(RuntimeError):
    """No fork server answers for this folder (never started, died, or still importing past the wait)."""


def address_for(server_dir: str) -> str:
    """The abstract socket name of the server for ``server_dir`` (derived, so clients need only DIR)."""
    digest = hashlib.sha256(os.path.realpath(server_dir).encode()).hexdigest()[:24]
    return f"\0syncswitch-forkserver-{digest}"


def _prctl(option: int, arg: Any) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)


def log(message: str) -> None:
    """One timestamped line in the server's log (forkserver.log)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"{stamp} forkserver: {message}", flush=True)


def _die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ---- server -------------------------------------------------------------------------------------


def preload() -> None:
    """Import what every node needs, without creating a TensorFlow context."""
    import keras  # noqa: F401
    import sklearn.datasets  # noqa: F401 - the digits problem's loader
    import sklearn.model_selection  # noqa: F401
    import tensorflow  # noqa: F401

    from syncswitch import asp, bsp, models, node, optim, problems, trainer  # noqa: F401


@dataclass
class Lease:
    conn: socket.socket
    buffer: bytes = b""
    pid: int | None = None
    name: str = "node"


class ForkServer:
    def __init__(self, server_dir: str) -> None:
        self.server_dir = server_dir
        self.selector = selectors.DefaultSelector()
        self.leases: dict[int, Lease] = {}  # by connection fd
        self.listener: socket.socket | None = None
        self.stopping = False

    def serve(self) -> int:
        started = time.monotonic()
        preload()  # SIGTERM still kills at once here: nothing to clean up yet
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address_for(self.server_dir))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        storage.write_json(
            os.path.join(self.server_dir, READY_FILE),
            {
                "pid": os.getpid(),
                "address": address_for(self.server_dir).replace("\0", "@"),
                "preload_seconds": round(time.monotonic() - started, 2),
            },
        )
        log(f"pid {os.getpid()} ready in {time.monotonic() - started:.1f}s")
        while not self.stopping and os.path.isdir(self.server_dir):
            for key, _ in self.selector.select(TICK_SECONDS):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._reap()
        self._shutdown()
        return 0

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = self.listener.accept()
            conn.setblocking(False)
            self.leases[conn.fileno()] = Lease(conn)
            self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        lease = self.leases[conn.fileno()]
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client is gone: so is the node's lease
            self._release(lease, kill=True)
            return
        lease.buffer += data
        if lease.pid is None and b"\n" in lease.buffer:
            line, lease.buffer = lease.buffer.split(b"\n", 1)
            try:
                self._fork(lease, json.loads(line))
            except (ValueError, KeyError, OSError) as exc:  # a bad request or a failed fork
                self._send(lease, {"error": f"{type(exc).__name__}: {exc}"})
                self._release(lease, kill=False)

    def _fork(self, lease: Lease, request: dict[str, Any]) -> None:
        if not isinstance(request.get("argv"), list) or not isinstance(request.get("log"), str):
            raise ValueError("a request needs 'argv' (a list) and 'log' (a path)")
        sys.stdout.flush()
        sys.stderr.flush()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._close_inherited()
            run_node(request, server_pid)  # never returns
        lease.pid, lease.name = pid, str(request.get("name", "node"))
        self._send(lease, {"pid": pid})
        log(f"forked {lease.name} as pid {pid}")

    def _close_inherited(self) -> None:
        self.selector.close()
        self.listener.close()
        for lease in self.leases.values():
            lease.conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            lease = next((x for x in self.leases.values() if x.pid == pid), None)
            if lease is not None:
                log(f"{lease.name} (pid {pid}) exited with {code}")
                self._send(lease, {"returncode": code})
                self._release(lease, kill=False)

    def _send(self, lease: Lease, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            lease.conn.setblocking(True)
            lease.conn.sendall((json.dumps(message) + "\n").encode())
            lease.conn.setblocking(False)

    def _release(self, lease: Lease, *, kill: bool) -> None:
        if kill and lease.pid is not None:
            log(f"killing {lease.name} (pid {lease.pid}): its lease was closed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(lease.pid, signal.SIGCONT)  # a SIGSTOPped straggler must not linger
                os.kill(lease.pid, signal.SIGKILL)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(lease.conn)
        self.leases.pop(lease.conn.fileno(), None)
        lease.conn.close()
        if kill:
            lease.pid = None  # reaped later without a lease

    def _shutdown(self) -> None:
        for lease in list(self.leases.values()):
            self._release(lease, kill=True)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.server_dir, READY_FILE))

    def stop(self, _signum: int = 0, _frame: Any = None) -> None:
        self.stopping = True


def run_node(request: dict[str, Any], server_pid: int) -> None:
    """In the forked child: become the requested node, run it, and exit with its status."""
    code = 1
    try:
        _die_with_parent()
        if os.getppid() != server_pid:  # the server died before the line above took effect
            return
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        _prctl(PR_SET_NAME, ctypes.c_char_p(request.get("name", "node").encode()[:15]))
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)
        os.environ.update(request.get("env", {}))
        if request.get("cpu") is not None:
            os.sched_setaffinity(0, {int(request["cpu"])})
        from syncswitch import node

        code = node.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the server
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m syncswitch.forkserver DIR", file=sys.stderr)
        return 2
    server_dir = args[0]
    os.makedirs(server_dir, exist_ok=True)
    storage.write_json(os.path.join(server_dir, PID_FILE), {"pid": os.getpid()})
    return ForkServer(server_dir).serve()


# ---- client -------------------------------------------------------------------------------------


def start(
    server_dir: str, *, env: dict[str, str] | None = None, die_with_parent: bool = False
) -> subprocess.Popen:
    """Start a server for ``server_dir`` in the background (it is ready later: see wait_ready).
    ``env`` is its whole environment (default: ours). ``die_with_parent`` ties it to the caller;
    otherwise it runs in a session of its own."""
    os.makedirs(server_dir, exist_ok=True)
    with open(os.path.join(server_dir, LOG_FILE), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "syncswitch.forkserver", server_dir],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "TF_CPP_MIN_LOG_LEVEL": "2"},
            start_new_session=not die_with_parent,
            preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509 - only prctl
        )
    # Written here too, so that wait_ready sees the server starting from this moment on.
    storage.write_json(os.path.join(server_dir, PID_FILE), {"pid": proc.pid})
    return proc


READY, STARTING, ABSENT = "ready", "starting", "absent"


def status(server_dir: str) -> str:
    """READY (accepting requests), STARTING (alive, still importing) or ABSENT."""
    ready = storage.read_json(os.path.join(server_dir, READY_FILE), default=None)
    if ready is not None and is_alive(ready["pid"]):
        return READY
    starting = storage.read_json(os.path.join(server_dir, PID_FILE), default=None)
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
        time.sleep(TICK_SECONDS)


class ForkedProcess:
    """A node forked by the server, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()  # the launcher polls from its main and straggler threads
        self.pid = pid
        self.returncode: int | None = None

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
                self.returncode = -signal.SIGKILL
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
        if self.poll() is None:  # never signal a pid the node no longer owns
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_node(
    server_dir: str, argv: list[str], *, env: dict[str, str], log: str, name: str, cpu: int | None = None
) -> ForkedProcess:
    """Ask the server for ``server_dir`` to fork a node running ``syncswitch.node`` with ``argv``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(30)
        conn.connect(address_for(server_dir))
        request = {"argv": argv, "env": env, "log": log, "name": name, "cpu": cpu}
        conn.sendall((json.dumps(request) + "\n").encode())
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                raise ForkServerUnavailable(f"the fork server for {server_dir} closed without forking {name}")
            reply += chunk
    except OSError as exc:
        conn.close()
        raise ForkServerUnavailable(f"the fork server for {server_dir} did not answer: {exc}") from exc
    line, rest = reply.split(b"\n", 1)
    answer = json.loads(line)
    if "pid" not in answer:
        conn.close()
        raise ForkServerUnavailable(f"the fork server for {server_dir} refused {name}: {answer.get('error')}")
    process = ForkedProcess(conn, int(answer["pid"]))
    process._buffer = rest
    return process


if __name__ == "__main__":
    sys.exit(main())
