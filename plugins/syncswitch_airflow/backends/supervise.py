"""Run one command and record how it ended.

    python -m syncswitch_airflow.backends.supervise EXIT_FILE -- COMMAND [ARGS...]

The local backend starts this wrapper as the leader of a new session, detached from the Airflow task
that launched it. It waits for the command, forwards SIGTERM/SIGINT to it, and writes the exit status
(shell convention: 128 + signal number for a signal death) to EXIT_FILE atomically. A watcher in another
process (the triggerer) can then tell "exited with 3" (file) from "still running" (wrapper alive) from
"vanished" (neither, e.g. the wrapper was SIGKILLed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

COMMAND_NOT_FOUND = 127


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


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print(
            "usage: python -m syncswitch_airflow.backends.supervise EXIT_FILE -- COMMAND...", file=sys.stderr
        )
        return 2
    return run(args[0], args[2:])


if __name__ == "__main__":
    sys.exit(main())
