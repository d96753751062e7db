"""A warm process that has imported TensorFlow once and forks cluster processes on request.

Every process of a cluster is forked from it, so TensorFlow is imported once per server, not once per
process: that import is most of a process's start, and a segment starts several processes at once. The
local backend starts one per cluster when it provisions it, so every segment's processes are forked
warm; a launcher given none starts its own, so even a lone segment imports TensorFlow once.

    python -m syncswitch.forkserver DIR     serve until SIGTERM, until DIR is removed, or until no
                                            node has run for IDLE_EXIT_S (--idle-exit; 0: never)
    python -m syncswitch.forkserver DIR --listen ADDRESS[:PORT] --token-file FILE
                                            also serve launchers on other hosts, over TCP
    python -m syncswitch.forkserver DIR --standby
                                            import, then wait to be claimed by a cluster (below)

This module is the server; launchers and backends start, claim and use one through
syncswitch.forkserver_client.

DIR holds the server's files:
    forkserver.pid    written at start (the server is alive, maybe still importing)
    forkserver.json   written once it accepts requests: {"pid", "address", "preload_seconds", "tcp"}
    forkserver.log    its own output (nodes log to the files their requests name)

Protocol: a Unix socket in the abstract namespace (no 108-byte path limit, nothing left on disk;
reachable only from this host's network namespace; bound before the import, so one server per folder
and host: another started for it exits at once), and with ``--listen`` a TCP socket bound to the
host's cluster-internal address only. One connection per node, one JSON object per line:
    client -> server  {"argv": [node args], "env": {...}, "log": PATH, "cpu": N or null, "name": "worker-1",
                       "files": {PATH: TEXT}, "program": "node" | "linkdelay" | "preflight",
                       "token": T}
    server -> client  {"pid": 1234}              once the node is forked
    client -> server  {"signal": 19}             any number of times: signal the node (SIGSTOP/CONT/KILL)
    server -> client  {"returncode": 0}          when it exits (Popen's convention: -N = killed by signal N)
or, for a launcher placing a cluster on this host:
    client -> server  {"ports": 3, "token": T}
    server -> client  {"ports": [41011, 41012, 41013]}   free on the listening address
or, for a launcher copying a node's log from this host (only a log a node forked here writes):
    client -> server  {"read_log": PATH, "offset": N, "limit": M, "token": T}
    server -> client  {"text": T, "offset": N2}  up to M bytes from N (T: UTF-8 decoded with
                                                 surrogateescape, so the bytes come back exact)
or, for a cluster claiming a standby server (Unix socket only):
    client -> server  {"claim": {"dir": NEW_DIR, "env": {VAR: VALUE}}}
    server -> client  {"claimed": 1234}          the server forked for NEW_DIR, where it listens
``files`` are written (folders made) before the fork: a node on another host gets its segment spec so.
A TCP request must carry the cluster's token (the file's content, compared in constant time); the
Unix socket needs none. The connection is the node's lease: when the client goes away (even by
SIGKILL, or its host by TCP keepalive) the server kills the node, as PR_SET_PDEATHSIG does for a
process the client started itself. Nodes get PR_SET_PDEATHSIG on the server, so nothing outlives it.

A standby server imports before any cluster asks for it (the local backend keeps one, so that the
first segment's nodes need not wait for the import). It starts with a placeholder for each marker of
its initial environment (``procs.ENV_PLACEHOLDER``) and dies with the process that started it. A
cluster's claim forks it: the child serves from the cluster's folder, in a session of its own, and
writes the cluster's markers over the placeholders (``procs.rewrite_initial_env``), so it and every
node it forks are found by them as if the cluster had started it; it outlives the standby's starter,
as any cluster's server does. The standby stands by again, so TensorFlow is imported once for every
local cluster its starter's lifetime sees (a sweep of many runs, a day of scheduled ones), not once
per cluster.

A cluster's server is stopped by its teardown. One whose run never tears down (its Airflow stopped for
good, its run deleted) exits once no node has run on it for ``IDLE_EXIT_S``, rather than holding a
TensorFlow process's memory, and on the local backend the machine's cluster slot, forever. A live run
leaves its server idle only between segments and for a retry's delay (seconds to minutes); a segment
launched after the server has gone starts another (the local launcher a private one, the hosts
backend the host's).

Forking is safe here because the server only imports: it never creates a TensorFlow context, thread
pool or gRPC channel, so a child starts with a clean runtime and sets its own thread counts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import hmac
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from syncswitch import storage
from syncswitch.peers import host_port
from syncswitch.procs import (
    initial_env_room,
    read_stat,
    rewrite_initial_env,
)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
TICK_SECONDS = 0.2
READY_FILE = "forkserver.json"
# A cluster's server with no node for this long exits (module docstring); a standby waits as long as
# its starter lives.
IDLE_EXIT_S = 1800.0
PID_FILE = "forkserver.pid"
LOG_FILE = "forkserver.log"
LOG_CHUNK = 256 * 1024  # the most of a node's log one read_log answers with (the JSON line stays small)


# Keepalive on every lease over TCP: a peer that vanished (its host lost, no RST) ends its lease after
# TCP_KEEPIDLE + TCP_KEEPINTVL x TCP_KEEPCNT seconds of silence, not never.
KEEPALIVE = ((socket.SO_KEEPALIVE, 1),)
TCP_KEEPALIVE = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 4))


def keep_alive(conn: socket.socket) -> None:
    for option, value in KEEPALIVE:
        conn.setsockopt(socket.SOL_SOCKET, option, value)
    for name, value in TCP_KEEPALIVE:
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


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


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    _prctl(PR_SET_PDEATHSIG, signum)


# What a forked child runs, by the request's "program": "module:function", a ``function(argv) -> exit
# code`` imported in the child only: a cluster process, a network straggler, a launcher's checks of a
# segment with user code (syncswitch.preflight.warm_preflight). A link delay must restore the link
# when it ends, so it gets SIGTERM, not SIGKILL, when its lease or the server goes away.
PROGRAMS = {
    "node": "syncswitch.node:main",
    "linkdelay": "syncswitch.linkdelay:main",
    "preflight": "syncswitch.preflight:main",
}
STOP_SIGNALS = {"node": signal.SIGKILL, "linkdelay": signal.SIGTERM, "preflight": signal.SIGKILL}


# ---- server -------------------------------------------------------------------------------------


# Keras and TensorFlow import these at their own import when they are installed, for Keras's plotting
# helpers, DataFrame input and scikit-learn wrappers and TF 1 Keras's sparse input, which no node
# uses: the server imports without them, since every cluster's server on every host pays its import.
# (The digits problem reads scikit-learn's data file without importing it. A node's user code imports
# any of them as usual; only those features stay unavailable in a node.)
KERAS_OPTIONAL_IMPORTS = ("matplotlib", "pandas", "sklearn", "scipy")


def preload() -> None:
    """Import what every node needs, without creating a TensorFlow context."""
    with _without_modules(KERAS_OPTIONAL_IMPORTS):
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        from syncswitch import asp, bsp, models, node, optim, problems, trainer  # noqa: F401


@contextlib.contextmanager
def _without_modules(names: tuple[str, ...]) -> Iterator[None]:
    """Imports of ``names`` raise ImportError inside (what Keras takes for "not installed"); after it a
    node's user code imports them as usual."""
    blocked = [name for name in names if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment] - the import system's "not found"
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name) is None:
                del sys.modules[name]


@dataclass
class Lease:
    conn: socket.socket
    remote: bool  # over TCP: every request must carry the token
    buffer: bytes = b""
    pid: int | None = None
    name: str = "node"
    program: str = "node"


class ForkServer:
    def __init__(
        self,
        server_dir: str,
        listen: str = "",
        token: str = "",
        standby: bool = False,
        idle_exit: float = IDLE_EXIT_S,
    ) -> None:
        self.server_dir = server_dir
        self.listen, self.token = listen, token
        self.standby = standby  # until a cluster claims it
        self.idle_exit = idle_exit  # seconds without a node before it exits (0: never)
        self.ready: dict[str, Any] = {}
        # "host:port", or a host alone (any free port)
        self.tcp_host, self.tcp_port = host_port(listen) if ":" in listen else (listen, 0)
        self.selector = selectors.DefaultSelector()
        self.leases: dict[int, Lease] = {}  # by connection fd
        self.logs: set[str] = set()  # the logs of the nodes forked here: the only files read_log reads
        self.listeners: list[socket.socket] = []
        self.stopping = False

    def take_folder(self) -> socket.socket | None:
        """The folder's Unix socket, bound (not listening yet), or None where another process holds
        it. Bound before the import, it is this host's lock on the folder (the kernel frees it with
        its process): a second server started for a folder that one serves or starts for stops at
        once, instead of importing TensorFlow to fail at the bind."""
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            local.bind(address_for(self.server_dir))
        except OSError:
            local.close()
            return None
        return local

    def serve(self, local: socket.socket) -> int:
        """Import, listen on ``local`` (``take_folder``'s) and the TCP address, serve until stopped."""
        started = time.monotonic()
        preload()  # SIGTERM still kills at once here: nothing to clean up yet
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self._add_listener(local)
        tcp = ""
        if self.listen:
            # Bound to the cluster-internal address only: nothing else on the host may fork nodes.
            remote = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            remote.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            remote.bind((self.tcp_host, self.tcp_port))
            self._add_listener(remote)
            tcp = f"{self.tcp_host}:{remote.getsockname()[1]}"
        self.ready = {
            "pid": os.getpid(),
            "address": address_for(self.server_dir).replace("\0", "@"),
            "tcp": tcp,
            "preload_seconds": round(time.monotonic() - started, 2),
            "standby": self.standby,
        }
        if not write_in_own_folder(os.path.join(self.server_dir, READY_FILE), self.ready):
            log(f"pid {os.getpid()}: {self.server_dir} is gone (torn down while it started); not serving")
            self._shutdown()
            return 0
        log(f"pid {os.getpid()} ready in {time.monotonic() - started:.1f}s" + (f", tcp {tcp}" if tcp else ""))
        busy_at = time.monotonic()
        while not self.stopping and os.path.isdir(self.server_dir):
            for key, _ in self.selector.select(TICK_SECONDS):
                if key.fileobj in self.listeners:
                    self._accept(key.fileobj)
                elif key.fileobj.fileno() in self.leases:  # not one a claim's child has just closed
                    self._read(key.fileobj)
            self._reap()
            if self.leases or self.standby:
                busy_at = time.monotonic()
            elif self.idle_exit and time.monotonic() - busy_at >= self.idle_exit:
                log(f"pid {os.getpid()}: no node for {self.idle_exit:.0f}s, no teardown came: exiting")
                break
        self._shutdown()
        return 0

    def _add_listener(self, listener: socket.socket) -> None:
        listener.listen(64)
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        self.listeners.append(listener)

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = listener.accept()
            conn.setblocking(False)
            remote = listener.family == socket.AF_INET
            if remote:
                keep_alive(conn)
            self.leases[conn.fileno()] = Lease(conn, remote)
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
        while b"\n" in lease.buffer and lease.conn.fileno() in self.leases:
            line, lease.buffer = lease.buffer.split(b"\n", 1)
            try:
                self._handle(lease, json.loads(line))
            except (ValueError, KeyError, OSError) as exc:  # a bad request or a failed fork
                self._send(lease, {"error": f"{type(exc).__name__}: {exc}"})
                self._release(lease, kill=False)

    def _handle(self, lease: Lease, request: dict[str, Any]) -> None:
        if lease.pid is not None:  # the node's lease: only signals from here on
            if isinstance(request.get("signal"), int):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(lease.pid, request["signal"])
            return
        if lease.remote and not hmac.compare_digest(str(request.get("token", "")), self.token):
            log("refused a request without the cluster's token")
            raise ValueError("the request does not carry this cluster's token")
        if "ports" in request:
            self._send(lease, {"ports": free_ports(self.tcp_host, int(request["ports"]))})
            self._release(lease, kill=False)
            return
        if "read_log" in request:
            self._send(lease, self._read_log(request))
            self._release(lease, kill=False)
            return
        if "claim" in request:
            self._claim(lease, request["claim"])
            return
        self._fork(lease, request)

    def _read_log(self, request: dict[str, Any]) -> dict[str, Any]:
        """Part of a node's log: a launcher on another host keeps a copy as the node runs, so that
        its last lines are known even after this host is lost."""
        path = str(request["read_log"])
        if path not in self.logs:
            raise ValueError(f"{path} is not the log of a node forked here")
        offset, limit = int(request.get("offset", 0)), min(int(request.get("limit", LOG_CHUNK)), LOG_CHUNK)
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
        return {"text": data.decode("utf-8", "surrogateescape"), "offset": offset + len(data)}

    def _claim(self, lease: Lease, claim: dict[str, Any]) -> None:
        """Fork the server of the cluster whose folder is ``claim["dir"]``, found by its markers
        ``claim["env"]``, and go on standing by: the import is paid once for every cluster claimed."""
        if not self.standby or lease.remote:
            raise ValueError("only a standby server can be claimed, from its own host")
        new_dir, markers = str(claim["dir"]), {str(k): str(v) for k, v in dict(claim["env"]).items()}
        for variable, value in markers.items():
            if len(value.encode()) > initial_env_room(variable):
                raise ValueError(
                    f"{variable}: {value!r} is longer than the placeholder the server started with"
                )
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address_for(new_dir))  # a server of that folder already runs: refused
            with contextlib.suppress(FileExistsError):
                os.mkdir(new_dir)  # not its parents: a cluster folder torn down stays gone
        except OSError:
            listener.close()
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._serve_claimed(lease, listener, new_dir, markers)  # returns into the child's loop
            return
        listener.close()
        self._release(lease, kill=False)  # the child answers on its copy of the connection
        log(f"pid {os.getpid()} claimed: forked pid {pid} to serve {new_dir}; standing by again")

    def _serve_claimed(
        self, lease: Lease, listener: socket.socket, new_dir: str, markers: dict[str, str]
    ) -> None:
        """In the forked child of a claim: become the cluster's server, in a session of its own (an
        Airflow instance stopping signals its standby's group, not a cluster's), logging into its
        folder, found by the cluster's markers."""
        try:
            os.setsid()  # PR_SET_PDEATHSIG is not inherited: the standby's end is not this one's
            _output_to(os.path.join(new_dir, LOG_FILE))
            for variable, value in markers.items():
                rewrite_initial_env(variable, value)
            for other in list(self.leases.values()):
                if other is not lease:
                    other.conn.close()
            for old in self.listeners:
                old.close()
            self.selector.close()  # shared with the standby (epoll): this process gets its own
            self.selector, self.leases, self.listeners = selectors.DefaultSelector(), {}, []
            self._add_listener(listener)
            self.standby, self.server_dir = False, new_dir
            self.ready.update(pid=os.getpid(), address=address_for(new_dir).replace("\0", "@"), standby=False)
            write_in_own_folder(os.path.join(new_dir, PID_FILE), pid_record(os.getpid()))
            write_in_own_folder(os.path.join(new_dir, READY_FILE), self.ready)
            log(f"pid {os.getpid()} forked from the standby server (pid {os.getppid()}): serving {new_dir}")
            self._send(lease, {"claimed": os.getpid()})
            lease.conn.close()
        except BaseException:  # noqa: BLE001 - never return into the standby's loop half-claimed
            traceback.print_exc()
            os._exit(1)

    def _fork(self, lease: Lease, request: dict[str, Any]) -> None:
        if not isinstance(request.get("argv"), list) or not isinstance(request.get("log"), str):
            raise ValueError("a request needs 'argv' (a list) and 'log' (a path)")
        if request.setdefault("program", "node") not in PROGRAMS:
            raise ValueError(f"'program' must be one of {tuple(PROGRAMS)}, got {request['program']!r}")
        for path, text in dict(request.get("files") or {}).items():
            storage.write_text(path, str(text))
        os.makedirs(os.path.dirname(request["log"]) or ".", exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._close_inherited()
            run_node(request, server_pid)  # never returns
        lease.pid, lease.name, lease.program = pid, str(request.get("name", "node")), request["program"]
        self.logs.add(request["log"])
        self._send(lease, {"pid": pid})
        log(f"forked {lease.name} as pid {pid}")

    def _close_inherited(self) -> None:
        self.selector.close()
        for listener in self.listeners:
            listener.close()
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
            log(f"stopping {lease.name} (pid {lease.pid}): its lease was closed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(lease.pid, signal.SIGCONT)  # a SIGSTOPped straggler must not linger
                os.kill(lease.pid, STOP_SIGNALS[lease.program])
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
        program = request.get("program", "node")
        die_with_parent(STOP_SIGNALS[program])
        if os.getppid() != server_pid:  # the server died before the line above took effect
            return
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        _prctl(PR_SET_NAME, ctypes.c_char_p(request.get("name", "node").encode()[:15]))
        _output_to(request["log"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)
        os.environ.update(request.get("env", {}))
        if request.get("cpu") is not None:
            os.sched_setaffinity(0, {int(request["cpu"])})
        code = program_main(program)(request["argv"])
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


def program_main(program: str) -> Callable[[list[str]], int]:
    """The function a child runs for ``program`` (PROGRAMS), imported now."""
    module, _, function = PROGRAMS[program].partition(":")
    return getattr(importlib.import_module(module), function)


def _output_to(path: str) -> None:
    """This process's stdout and stderr append to ``path`` from now on."""
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)


def free_ports(host: str, count: int) -> list[int]:
    """Ports the OS hands out as free on ``host`` (held together so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncswitch.forkserver")
    parser.add_argument("server_dir")
    parser.add_argument("--listen", default="", help="ADDRESS[:PORT]: also serve over TCP on this address")
    parser.add_argument("--token-file", default="", help="the cluster's token, required with --listen")
    parser.add_argument("--standby", action="store_true", help="wait to be claimed by a cluster (local only)")
    parser.add_argument(
        "--idle-exit",
        type=float,
        default=IDLE_EXIT_S,
        metavar="SECONDS",
        help=f"exit once no node has run for this long (default {IDLE_EXIT_S:.0f}; 0: never)",
    )
    args = parser.parse_args(argv)
    token = ""
    if args.listen:
        if not args.token_file:
            parser.error("--listen needs --token-file")
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if len(token) < 16:
            parser.error(f"--token-file {args.token_file}: the token is shorter than 16 characters")
    if args.standby and args.listen:
        parser.error("--standby serves this host only: it takes no --listen")
    if args.idle_exit < 0:
        parser.error(f"--idle-exit must be 0 (never) or a number of seconds, got {args.idle_exit:g}")
    server = ForkServer(args.server_dir, args.listen, token, args.standby, args.idle_exit)
    local = server.take_folder()
    if local is None:
        log(f"pid {os.getpid()}: a fork server for {args.server_dir} runs or starts already; not serving")
        return 0
    if not write_in_own_folder(os.path.join(args.server_dir, PID_FILE), pid_record(os.getpid())):
        log(f"pid {os.getpid()}: {args.server_dir} is gone (torn down before it started); not serving")
        return 0
    return server.serve(local)


def write_in_own_folder(path: str, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` atomically unless its folder is gone (False). Whoever starts the
    server makes its folder and a teardown removes it; a server that made it again (storage's writes
    do) would serve in it with no one left to stop it."""
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(temp, path)
    except FileNotFoundError:
        return False
    return True


def pid_record(pid: int) -> dict[str, Any]:
    """``{"pid", "start_ticks"}``: the start time tells the server from a later process of that pid."""
    stat = read_stat(pid)
    return {"pid": pid, "start_ticks": stat.start_ticks if stat else None}


if __name__ == "__main__":
    sys.exit(main())
