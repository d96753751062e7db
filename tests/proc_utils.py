"""Process-table checks for tests that start real processes (cluster launcher, DAG teardown).

The machine is shared with other test runs, so callers should match on something unique to their
test (a tmp path, a run id, a port) rather than on a bare program name.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from background import Poller


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


def wait_for(  # noqa: ANN001
    predicate, timeout: float = 20.0, what: str | Callable[[], str] = "condition", poll: float = 0.05
) -> None:
    """Poll ``predicate`` until it is true; fail after ``timeout`` seconds naming ``what`` (a callable
    is called then, so that the message says where things stood at the end, not at the start)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(poll)


def environ(pid: int) -> dict[str, str]:
    """The environment a process was started with (a forked child shows its fork server's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode("utf-8", errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _sep, value in pairs}


class ProgressThrottle(Poller):
    """CPU slowness tied to a run's progress rather than to the clock: inside its ``with`` block it
    runs the processes that ``find_pids`` names at 1/``slowdown`` speed (SIGSTOP/SIGCONT over 0.2 s
    cycles, as the launcher's injector does) from the moment they appear until ``cleared()`` is true.
    One pid makes a straggler; all of a segment's nodes, stopped and continued together, make the
    whole segment slower without making any worker look slower than the others. A clock-timed
    episode means something else on a machine twice as slow (it can end before the first step).
    ``hold()`` stops them outright from then on (a SIGKILL still ends them; the exit continues them)."""

    CYCLE_SECONDS = 0.2

    def __init__(
        self, find_pids: Callable[[], list[int]], cleared: Callable[[], bool], slowdown: float = 4.0
    ) -> None:
        super().__init__(every=0.0)
        self.find_pids, self.cleared, self.slowdown = find_pids, cleared, slowdown
        self.slowed: set[int] = set()
        self.held = False

    def hold(self) -> None:
        """No progress at all from now on, however long what follows takes."""
        self.held = True

    def poll(self) -> bool:
        """One duty cycle; True (done) once cleared."""
        if self.cleared():
            return True
        pids = self.find_pids()
        if not pids:
            self._stop.wait(0.5)
            return False
        run_for = self.CYCLE_SECONDS / self.slowdown
        self.slowed.update(pids)
        self._signal(pids, signal.SIGSTOP)
        self._stop.wait(self.CYCLE_SECONDS - run_for)
        if not self.held:
            self._signal(pids, signal.SIGCONT)
        self._stop.wait(run_for)
        return False

    @staticmethod
    def _signal(pids: list[int] | set[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._signal(self.slowed, signal.SIGCONT)  # a SIGSTOPped process must not outlive the test
