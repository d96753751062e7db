"""Process-table checks for tests that start real processes (cluster launcher, DAG teardown).

The machine is shared with other test runs, so callers should match on something unique to their
test (a tmp path, a run id, a port) rather than on a bare program name.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    cmdline: str


def _read_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:  # the process ended while we were looking
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", errors="replace").strip()


def find_processes(pattern: str) -> list[ProcessInfo]:
    """Live processes whose command line matches the regex ``pattern`` (this process excluded).

    Zombies have an empty command line, so an exited-but-unreaped child does not count as running.
    """
    regex = re.compile(pattern)
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        cmdline = _read_cmdline(int(entry))
        if cmdline and regex.search(cmdline):
            found.append(ProcessInfo(int(entry), cmdline))
    return found


def assert_no_processes(pattern: str, timeout: float = 10.0, poll: float = 0.2) -> None:
    """Fail unless no process matches ``pattern`` within ``timeout`` seconds.

    Waits a little because a teardown that signals its processes returns before the kernel has
    finished tearing them down.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = find_processes(pattern)
        if not found:
            return
        if time.monotonic() >= deadline:
            listing = "\n".join(f"  {p.pid}: {p.cmdline}" for p in found)
            raise AssertionError(f"{len(found)} process(es) still match {pattern!r}:\n{listing}")
        time.sleep(poll)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition", poll: float = 0.05) -> None:  # noqa: ANN001
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)
