"""The one place that reads ``/proc`` and sends signals to process groups (Linux only).

Used by the fork server, the local cluster backend, the remote host agent and the embedded Airflow:
each finds "its" processes by a marker in their initial environment (``VAR=value``), by process
group, or by pid plus start time (so that a reused pid is never mistaken for ours).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` we need."""

    pid: int
    state: str
    ppid: int
    pgid: int
    start_ticks: int
    threads: int = 1

    @property
    def alive(self) -> bool:
        # A zombie has exited; it only waits for its parent to reap it. But a killed process's main
        # thread shows as a zombie while its other threads still exit (TensorFlow's pools): until
        # the last has, it still holds its memory and ports, and its parent cannot reap it yet.
        return self.state not in ("Z", "X") or self.threads > 1


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; the rest follows the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[19]), int(fields[17]))
    except (IndexError, ValueError):
        return None


def is_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs and (when given) started at ``start_ticks``, i.e. was not reused."""
    stat = read_stat(pid)
    return bool(stat and stat.alive and (start_ticks is None or stat.start_ticks == start_ticks))


def live_processes() -> Iterator[ProcStat]:
    """Every live (non-zombie) process but this one."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            stat = read_stat(int(entry))
            if stat is not None and stat.alive:
                yield stat


def children_of(pid: int) -> list[ProcStat]:
    """The direct children of ``pid``, zombies included (a parent must still reap those)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None and stat.ppid == pid:
                found.append(stat)
    return found


def has_env(pid: int, variable: str, value: str) -> bool:
    """True if the process was started with ``variable=value`` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{variable}={value}".encode() in f.read().split(b"\0")
    except OSError:  # gone, or another user's process
        return False


# The value a process starts with for a marker it learns later (a cluster's fork server, forked from a
# standby by a claim): rewrite_initial_env overwrites it in place with a value of up to this many characters.
ENV_PLACEHOLDER = "_" * 1024


def rewrite_initial_env(variable: str, value: str) -> None:
    """Overwrite ``variable``'s value in this process's initial environment, in place: what
    ``/proc/<pid>/environ`` shows (so ``has_env`` finds the process by the new value) and what every
    process it forks from now on starts with. The process must have started with ``variable`` set to
    a value at least as long (``ENV_PLACEHOLDER``); ValueError otherwise. The old value's surplus
    becomes empty entries. (setproctitle rewrites the command line the same way.)"""
    address, room = _initial_env_value(variable)
    encoded = value.encode()
    if b"\0" in encoded or len(encoded) > room:
        raise ValueError(f"{variable}: {len(encoded)} bytes do not fit the {room} the process started with")
    ctypes.memmove(address, encoded + b"\0" * (room - len(encoded)), room)
    os.environ[variable] = value


def initial_env_room(variable: str) -> int:
    """How many bytes ``rewrite_initial_env`` may write for ``variable`` (ValueError if it is unset)."""
    return _initial_env_value(variable)[1]


def _initial_env_value(variable: str) -> tuple[int, int]:
    """(address, length) of ``variable``'s value in this process's initial environment block."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    # The fields after the command's closing parenthesis start with field 3; env_start and env_end
    # are fields 50 and 51 (proc(5)).
    fields = stat[stat.rindex(b")") + 2 :].split()
    start, end = int(fields[47]), int(fields[48])
    block = ctypes.string_at(start, end - start)
    key = variable.encode() + b"="
    # Each entry follows a NUL; so does the first, once one is put before the block.
    entry = (b"\0" + block).find(b"\0" + key)
    if entry < 0:
        raise ValueError(f"{variable} is not in this process's initial environment")
    value_start = entry + len(key)
    return start + value_start, block.index(b"\0", value_start) - value_start


def processes_with_env(variable: str, value: str) -> list[ProcStat]:
    """Live processes whose initial environment holds ``variable=value``."""
    return [p for p in live_processes() if has_env(p.pid, variable, value)]


def processes_in_group(pgid: int) -> list[int]:
    return [p.pid for p in live_processes() if p.pgid == pgid]


def listening_pids(port: int) -> set[int] | None:
    """Pids holding a TCP socket that listens on ``port`` (IPv4); None where /proc lacks it."""
    inodes = set()
    try:
        with open("/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        fields = row.split()
        address, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(address.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
            inodes.add(f"socket:[{inode}]")
    owners = set()
    for proc in live_processes():
        try:
            fds = os.listdir(f"/proc/{proc.pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{proc.pid}/fd/{fd}") in inodes:
                    owners.add(proc.pid)
                    break
    return owners


def signal_pid(pid: int, signum: int) -> bool:
    """Send ``signum``; False if the process is gone."""
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False


def kill(pid: int) -> bool:
    """SIGCONT then SIGKILL: a stopped process (an injected straggler) must not linger stopped."""
    signal_pid(pid, signal.SIGCONT)
    return signal_pid(pid, signal.SIGKILL)


def wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.1) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def mem_available_gb() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` so far (its reaped children excluded)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
