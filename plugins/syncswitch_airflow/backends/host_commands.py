"""The shell commands the hosts backend runs on a host (``backends.hosts`` sends them over SSH).

Each is one string for one SSH command, since every command is a session and a shell on the host:
what the backend needs to know at a step is asked in one. A fork server's files, in its folder on
the host: ``starting.pid`` (written by its start), ``forkserver.json`` (its ready file, written once
it listens), ``forkserver.lock`` (flock(1)'s, for the look-and-start step), ``forkserver.log``.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import Any

# What ``start_command`` prints where a fork server listens or starts in the folder already.
STARTING = "starting"
# Longest a fork server's start waits for another start on its folder (each holds it only to look and
# start).
LAUNCH_LOCK_WAIT_S = 60.0

# A shell test: the process "$pid" lives, and is not a zombie. A server killed on a host whose init is
# slow to reap (a container's, often) stays a zombie, which `kill -0` counts as alive; its state is
# the letter after the last ")" of /proc/PID/stat.
PID_ALIVE = (
    """kill -0 "$pid" 2>/dev/null && [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)" != Z ]"""
)


def python_command(host: dict[str, Any], module: str, *args: str) -> str:
    """``python -m module args`` with the host record's interpreter."""
    return shlex.join([host["python"], "-m", module, *args])


def started_alive(pid_file: str) -> str:
    """A shell test: the fork server whose pid ``pid_file`` holds (its start's) lives."""
    return f'pid="$(cat {shlex.quote(pid_file)} 2>/dev/null)" && [ -n "$pid" ] && {PID_ALIVE}'


def ready_command(server_dir: str) -> str:
    """A shell command that prints the fork server's ready file if the server it names is alive, and
    nothing otherwise; it always succeeds."""
    pid = r"""$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' forkserver.json 2>/dev/null)"""
    alive = f'pid={pid} && [ -n "$pid" ] && {PID_ALIVE}'
    return f"(cd {shlex.quote(server_dir)} 2>/dev/null && {alive} && cat forkserver.json; true)"


def ready_address(ready_file: str) -> str:
    """The TCP address in a ready file that ``ready_command`` printed ("" for none)."""
    try:
        return str(json.loads(ready_file).get("tcp", "")) if ready_file.strip() else ""
    except (ValueError, AttributeError):
        return ""


def start_command(server_dir: str, server: str, env: dict[str, str]) -> str:
    """Start ``server`` (the fork server's command line) detached with ``env``, unless a fork server
    listens or starts in ``server_dir`` already: then print STARTING. Its pid goes to ``starting.pid``
    until it writes ``forkserver.json``.

    The look and the start are one step, under the folder's lock on the host (flock(1), held by the
    step's shell, not by the server): the start sent by a provisioning try lost midway can still run
    on the host after the retry has looked (a command in flight, its shell not yet started), and two
    servers for one folder would each import TensorFlow."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    log_file = shlex.quote(posixpath.join(server_dir, "forkserver.log"))
    pid_file = shlex.quote(posixpath.join(server_dir, "starting.pid"))
    # Backgrounded alone, with every stream redirected, so the SSH channel closes now; env and
    # setsid exec in place, so $! is the fork server's pid. It is written whole (renamed into
    # place): a look never reads a half-written file.
    detached = f"env {assignments} setsid {server} >> {log_file} 2>&1 < /dev/null"
    start = f"cd / && ({detached} & echo $! > {pid_file}.new) && mv -f {pid_file}.new {pid_file}"
    running = started_alive(posixpath.join(server_dir, "starting.pid"))
    look_and_start = (
        # (A space after "$(": the command is a subshell, and "$((" would start arithmetic.)
        f'if [ -n "$( {ready_command(server_dir)} )" ] || {{ {running}; }}; then echo {STARTING}; '
        f"else {start}; fi"
    )
    lock = shlex.quote(posixpath.join(server_dir, "forkserver.lock"))
    return f"flock -w {LAUNCH_LOCK_WAIT_S:.0f} -o {lock} sh -c {shlex.quote(look_and_start)}"


def wait_for_ready_command(server_dir: str, seconds: float) -> str:
    """Wait on the host itself (its disk looked at every 0.1 s) until the starting fork server has
    written its ready file or has died, for at most ``seconds``: one command, as each look over SSH
    (a session, a shell) would come late and take CPU from the server's imports."""
    return (
        f'cd {shlex.quote(server_dir)} && pid="$(cat starting.pid 2>/dev/null)" && '
        f"end=$(( $(date +%s) + {int(seconds) + 1} )) && "
        f'while [ ! -s forkserver.json ] && {PID_ALIVE} && [ "$(date +%s)" -lt "$end" ]; '
        "do sleep 0.1; done"
    )
