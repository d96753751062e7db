"""A segment launcher's process lifecycle on one host: start it detached, tell how it stands, stop a
scope of processes and verify they are gone. The local backend calls these functions; the hosts
backend runs the same code on each host over SSH through the CLI below (JSON out), so both backends
share one owner of these rules.

    python -m syncswitch.supervise wrap EXIT_FILE -- COMMAND...      run COMMAND, record how it ended
    python -m syncswitch.supervise launch SEG_DIR --marker VAR [--env K=V]... [--files-on-stdin]
                        [--listening HOST:PORT]... -- COMMAND...
                        detached; prints the record, or {"running": PID} while the segment runs
                        already, or {"not_checked": WHY} (nothing started) where a --listening
                        address does not accept a connection or the folder was launched before
    python -m syncswitch.supervise status SEG_DIR --marker VAR        prints {"state", "exit_code", "pid"}
    python -m syncswitch.supervise stop --marker VAR=VALUE [--records SEG_ROOT] [--grace S] [--remove DIR]

**wrap**: the wrapper a launch starts as the leader of a new session, detached from whoever launched
it. It waits for the command, forwards SIGTERM/SIGINT to it, and writes the exit status (shell
convention: 128 + signal number for a signal death) to EXIT_FILE atomically. A watcher in another
process (the triggerer) can then tell "exited with 3" (file) from "still running" (wrapper alive) from
"vanished" (neither, e.g. the wrapper was SIGKILLed).

A segment folder holds ``process.json`` (pid, process group, start time of the wrapper),
``exitcode``, ``launcher.log`` and ``launch.lock`` (held while a launch looks and starts). Every
process of a scope carries a marker variable in its environment (the cluster's or the segment's
folder), so a process that left its group, or whose launcher was SIGKILLed, is still found.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

from syncswitch import peers
from syncswitch.procs import ProcStat, is_alive, processes_with_env, read_stat, signal_group, signal_pid

COMMAND_NOT_FOUND = 127
RUNNING, EXITED, UNKNOWN = "running", "exited", "unknown"
VERIFY_TIMEOUT_S = 10.0
_POLL_S = 0.1


# ---- the wrapper ----------------------------------------------------------------------------------


def write_exit_status(path: str, status: int) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{status}\n")
    os.replace(tmp, path)


def run(exit_file: str, command: list[str]) -> int:
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"supervise: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_exit_status(exit_file, COMMAND_NOT_FOUND)
        return COMMAND_NOT_FOUND

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    status = code if code >= 0 else 128 - code
    write_exit_status(exit_file, status)
    return status


# ---- launch and status ----------------------------------------------------------------------------


class NotChecked(Exception):
    """A launch refused before anything was written: what it was asked to take for granted (its
    ``listening`` addresses) it could not."""


class SegmentRunning(Exception):
    """A launch refused: the segment launched in the folder before still runs (pid ``pid``)."""

    def __init__(self, seg_dir: str, pid: int) -> None:
        super().__init__(f"{seg_dir}: its segment is already running (pid {pid})")
        self.pid = pid


def launch(
    seg_dir: str,
    command: list[str],
    env: dict[str, str],
    marker: str,
    files: dict[str, str] | None = None,
    listening: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Write ``files`` (name: text) into ``seg_dir``, then start ``command`` detached (its own session)
    under the wrapper, output appended to ``launcher.log``; writes and returns ``process.json``'s
    record. ``env`` is its whole environment. Raises SegmentRunning, and writes nothing, while the
    segment launched in ``seg_dir`` before still runs (``marker``: as for status): a segment never
    trains twice at once, however often and from wherever its launch is retried.

    ``listening`` ("host:port", the servers the command will need) lets a caller skip looking at
    them itself: NotChecked, and nothing written, unless each accepts a connection and this is the
    folder's first launch. A relaunch follows a failure, which may have been those servers' (one
    restarted elsewhere, its old port taken), so its caller looks for itself."""
    os.makedirs(seg_dir, exist_ok=True)
    # Two launches of one segment may come at once (the trigger of the segment before and this
    # segment's task, or its retry): the look and the start are one step under a lock on the folder.
    with open(os.path.join(seg_dir, "launch.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _launch_unlocked(seg_dir, command, env, marker, files, listening)


def _launch_unlocked(
    seg_dir: str,
    command: list[str],
    env: dict[str, str],
    marker: str,
    files: dict[str, str] | None,
    listening: tuple[str, ...],
) -> dict[str, Any]:
    before = status(seg_dir, marker)
    if before["state"] == RUNNING:
        raise SegmentRunning(seg_dir, before["pid"])
    if listening:
        if before["pid"] is not None:
            raise NotChecked("a relaunch")
        # On the cluster's network a listening server answers in milliseconds; one that does not
        # within peers' connect timeout is as good as lost (the caller looks at it over SSH).
        silent = [address for address in listening if not peers.accepts(address)]
        if silent:
            raise NotChecked(f"nothing accepts a connection at {', '.join(silent)}")
    for name, text in (files or {}).items():
        with open(os.path.join(seg_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    exit_path = os.path.join(seg_dir, "exitcode")
    if os.path.exists(exit_path):
        os.unlink(exit_path)
    wrapper = [sys.executable, "-m", "syncswitch.supervise", "wrap", exit_path, "--", *command]
    log_path = os.path.join(seg_dir, "launcher.log")
    with open(log_path, "ab") as out:
        out.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} launch: {' '.join(command)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            wrapper,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    stat = read_stat(proc.pid)
    record = {
        "pid": proc.pid,
        "pgid": proc.pid,  # session leader: its pid is its process group id
        "start_ticks": stat.start_ticks if stat else None,
        "command": command,
        "log": log_path,
        "launched_at": time.time(),
    }
    write_json(os.path.join(seg_dir, "process.json"), record)
    return record


def status(seg_dir: str, marker: str) -> dict[str, Any]:
    """``{"state": running|exited|unknown, "exit_code", "pid"}`` of the launch in ``seg_dir``.
    ``marker`` is the variable whose value ``seg_dir`` marks the segment's processes."""
    record = read_json(os.path.join(seg_dir, "process.json"))
    if record is None:
        return {"state": UNKNOWN, "exit_code": None, "pid": None}
    exit_path = os.path.join(seg_dir, "exitcode")
    if not os.path.exists(exit_path) and is_alive(record["pid"], record.get("start_ticks")):
        return {"state": RUNNING, "exit_code": None, "pid": record["pid"]}
    # Checked again after the liveness test: the wrapper writes the file just before it exits.
    exit_code = read_exit_code(exit_path)
    if exit_code is None:
        # The wrapper vanished: an orphaned launcher still works and will write its result
        # (its cluster processes die with it, so any survivor means the segment goes on).
        survivors = processes_with_env(marker, seg_dir)
        if survivors:
            return {"state": RUNNING, "exit_code": None, "pid": survivors[0].pid}
    return {"state": EXITED, "exit_code": exit_code, "pid": record["pid"]}


def log_tail(seg_dir: str, lines: int) -> str:
    try:
        with open(os.path.join(seg_dir, "launcher.log"), encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch_records(folder: str) -> list[dict[str, Any]]:
    """The process.json record of the segment folder ``folder``, or of every segment folder under it."""
    own = os.path.join(folder, "process.json")
    paths = [own] if os.path.exists(own) else sorted(glob.glob(os.path.join(folder, "*", "process.json")))
    records = (read_json(path) for path in paths)
    return [r for r in records if r]


# ---- stopping a scope -----------------------------------------------------------------------------


class ProcessScope:
    """The processes of a run or a segment on this host: the launch wrappers of ``records`` and every
    process whose environment has ``variable=value``."""

    def __init__(self, records: list[dict[str, Any]], variable: str, value: str) -> None:
        self.records, self.variable, self.value = records, variable, value
        # Every process found by its environment, by start time: an exiting process shows an empty
        # environment once its memory is released, still some moments before it has ended.
        self.seen = {r["pid"]: r.get("start_ticks") for r in records}

    def live(self) -> list[ProcStat]:
        self.seen.update((p.pid, p.start_ticks) for p in processes_with_env(self.variable, self.value))
        found = []
        for pid, start_ticks in self.seen.items():
            stat = read_stat(pid)
            if stat and stat.alive and stat.start_ticks == start_ticks:
                found.append(stat)
        return sorted(found, key=lambda p: p.pid)

    def stop(self, grace_seconds: float) -> dict[str, list[int]]:
        """SIGTERM, SIGKILL what is left after the grace, verify: ``{"stopped", "leftovers"}``."""
        stopped = self.terminate(grace_seconds)
        return {"stopped": stopped, "leftovers": self.kill_and_verify()}

    def terminate(self, grace_seconds: float) -> list[int]:
        """SIGTERM the live launch wrappers first: each forwards it to its launcher, which stops its
        cluster gracefully. Only then SIGTERM whatever of the scope is left (an orphaned launcher, a
        process that escaped). Signalling everything at once would hit a launcher twice, and the
        second SIGTERM can land after its handler ran, killing it mid-cleanup. Waits up to
        ``grace_seconds`` in all."""
        deadline = time.monotonic() + grace_seconds
        wrapper_pids = {r["pid"] for r in self.records}
        live = self.live()
        self._term_and_wait([p for p in live if p.pid in wrapper_pids], deadline)
        rest = [p for p in self.live() if p.pid not in wrapper_pids]
        self._term_and_wait(rest, deadline)
        return sorted({p.pid for p in live + rest})

    def _term_and_wait(self, procs: list[ProcStat], deadline: float) -> None:
        for proc in procs:
            signal_pid(proc.pid, signal.SIGTERM)
        pids = {p.pid for p in procs}
        while pids and time.monotonic() < deadline:
            if not pids & {p.pid for p in self.live()}:
                return
            time.sleep(_POLL_S)

    def kill_and_verify(self) -> list[int]:
        """SIGKILL what is left (whole process groups we started, then single marked processes);
        return the pids still alive after VERIFY_TIMEOUT_S (empty on success)."""
        deadline = time.monotonic() + VERIFY_TIMEOUT_S
        while True:
            live = self.live()
            if not live:
                return []
            if time.monotonic() >= deadline:
                return [p.pid for p in live]
            # Only signal a recorded group while one of our processes is still in it, so a
            # process group id that the kernel has since handed to someone else is never hit.
            our_groups = {p.pgid for p in live}
            for record in self.records:
                if record.get("pgid") in our_groups:
                    signal_group(record["pgid"], signal.SIGKILL)
            for proc in live:
                signal_pid(proc.pid, signal.SIGKILL)
            time.sleep(_POLL_S)


# ---- files ----------------------------------------------------------------------------------------


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def read_exit_code(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ---- CLI ------------------------------------------------------------------------------------------


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit("supervise: the command follows '--'")
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("wrap", "launch", "status", "stop"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    verb, rest = args[0], args[1:]
    if verb == "wrap":
        head, command = _split_command(rest)
        return run(head[0], command)
    parser = argparse.ArgumentParser(prog=f"python -m syncswitch.supervise {verb}")
    if verb == "launch":
        head, command = _split_command(rest)
        parser.add_argument("seg_dir")
        parser.add_argument("--marker", required=True)
        parser.add_argument("--env", action="append", default=[], help="K=V added to this environment")
        parser.add_argument("--files-on-stdin", action="store_true", help='{"NAME": TEXT} written first')
        parser.add_argument("--listening", action="append", default=[], help="HOST:PORT the command needs")
        opts = parser.parse_args(head)
        extra = dict(item.split("=", 1) for item in opts.env)
        files = json.load(sys.stdin) if opts.files_on_stdin else None
        environment = {**os.environ, **extra}
        try:
            record = launch(opts.seg_dir, command, environment, opts.marker, files, tuple(opts.listening))
        except SegmentRunning as exc:  # answers, not failures: the caller names them
            record = {"running": exc.pid}
        except NotChecked as exc:
            record = {"not_checked": str(exc)}
        print(json.dumps(record))
        return 0
    if verb == "status":
        parser.add_argument("seg_dir")
        parser.add_argument("--marker", required=True)
        parser.add_argument("--log-lines", type=int, default=0)
        opts = parser.parse_args(rest)
        answer = status(opts.seg_dir, opts.marker)
        if opts.log_lines:
            answer["log_tail"] = log_tail(opts.seg_dir, opts.log_lines)
        print(json.dumps(answer))
        return 0
    parser.add_argument("--marker", required=True, help="VAR=VALUE")
    parser.add_argument("--records", default="", help="a segment folder, or a folder of them (process.json)")
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("--remove", default="", help="a folder to remove once nothing is left")
    opts = parser.parse_args(rest)
    variable, value = opts.marker.split("=", 1)
    records = launch_records(opts.records) if opts.records else []
    result: dict[str, Any] = ProcessScope(records, variable, value).stop(opts.grace)
    if opts.remove and not result["leftovers"]:
        shutil.rmtree(opts.remove, ignore_errors=True)
        result["removed"] = opts.remove
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
