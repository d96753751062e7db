"""The machine under the testbed: commands, namespaces and their processes, and what a testbed needs.

Every testbed command goes through ``run`` (a failure raises TestbedError with what the command
printed); a namespace's processes are found by the inode of their network namespace, so a host's
process table is exactly the processes in its namespace.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

STATE_ROOT = "/run/syncswitch-testbed"  # tmpfs: gone after a reboot, like the namespaces themselves
SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
HOST_INTERFACE = "eth0"  # every host's interface inside its namespace
PROCESS_KILL_TIMEOUT_S = 5.0

# Debian packages that provide the tools we run, for ensure_prerequisites() to install.
_TOOL_PACKAGES = {
    "ip": "iproute2",
    "tc": "iproute2",
    "iptables": "iptables",
    "ssh-keygen": "openssh-client",
    SSHD: "openssh-server",
}


class TestbedError(RuntimeError):
    """A testbed operation failed; the message says which command and what it printed."""

    __test__ = False  # not a pytest test class, despite the name


def log(testbed: str, message: str) -> None:
    print(f"testbed {testbed}: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise TestbedError with what it printed."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        output = (proc.stderr or proc.stdout).strip()
        raise TestbedError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {output}")
    return proc


def netns_names() -> list[str]:
    listing = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def link_names() -> list[str]:
    listing = run(["ip", "-o", "link", "show"]).stdout
    # "7: ssv-ss-0@if6: <...>" -> "ssv-ss-0"
    return [line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if ":" in line]


def _netns_identity(netns: str) -> tuple[int, int]:
    """(device, inode) of a named namespace: what /proc/<pid>/ns/net of its processes resolves to."""
    st = os.stat(f"/run/netns/{netns}")
    return st.st_dev, st.st_ino


def pids_in_netns(netns: str) -> list[int]:
    try:
        identity = _netns_identity(netns)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            # A zombie has no namespaces left, so stat fails and an exited process never counts.
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == identity:
            pids.append(int(entry))
    return sorted(pids)


def kill_netns_processes(netns: str) -> int:
    """SIGKILL every process in a namespace until none is left (a dying process may fork); how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + PROCESS_KILL_TIMEOUT_S
    while pids := pids_in_netns(netns):
        if time.monotonic() > deadline:
            raise TestbedError(f"processes {pids} in namespace {netns} survived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.01)
    return len(killed)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_and_wait(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + PROCESS_KILL_TIMEOUT_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def ssh_banner(address: str, port: int, timeout: float) -> bool:
    """Whether an SSH server answers on address:port with its banner within timeout seconds."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def listening_on_port(port: int) -> bool:
    """Whether anything in this (the root) namespace listens on TCP `port` (any address)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Serialise testbed creation on this machine, so two up()s never pick the same subnet."""
    os.makedirs(STATE_ROOT, exist_ok=True)
    with open(os.path.join(STATE_ROOT, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------
# prerequisites


def _missing_tools() -> list[str]:
    return [tool for tool in _TOOL_PACKAGES if shutil.which(tool) is None and not os.access(tool, os.X_OK)]


def _apt_install(packages: list[str]) -> str | None:
    """apt-get install packages without starting their services; a reason string when it failed."""
    if shutil.which("apt-get") is None:
        return f"no apt-get to install {' '.join(packages)}; install them by hand"
    print(f"testbed: installing {' '.join(packages)} with apt-get", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120"]
    # openssh-server's postinst starts the machine-wide sshd on 0.0.0.0:22; a policy-rc.d that
    # answers 101 ("action forbidden") is Debian's way to install a service without starting it.
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text(
            "#!/bin/sh\n# the syncswitch testbed: no service starts during its install\nexit 101\n"
        )
        policy.chmod(0o755)
    try:
        proc = subprocess.run([*install, *packages], env=env, capture_output=True, text=True)
        if proc.returncode != 0:  # stale package lists are the usual reason
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
            proc = subprocess.run([*install, *packages], env=env, capture_output=True, text=True)
    finally:
        if own_policy:
            policy.unlink()
    if proc.returncode != 0:
        return f"apt-get install {' '.join(packages)} failed: {proc.stderr.strip()[-500:]}"
    return None


def _probe_netns() -> str | None:
    probe = f"sstb-probe-{os.getpid()}"
    created = run(["ip", "netns", "add", probe], check=False)
    if created.returncode != 0:
        return f"cannot create a network namespace: {created.stderr.strip()}"
    run(["ip", "netns", "delete", probe], check=False)
    return None


def ensure_prerequisites() -> str | None:
    """None when a testbed can run here, else the reason it cannot (for pytest.skip).

    Needs root, network namespaces, ip, tc, iptables, ssh-keygen and /usr/sbin/sshd. Missing packages
    are installed with apt-get when we are root on Debian (said on stderr), with services kept from
    starting; a machine-wide sshd found listening on port 22 afterwards is reported, not stopped.
    """
    if not sys.platform.startswith("linux"):
        return f"the testbed needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"the testbed needs root for namespaces, veths and sshd (running as uid {os.geteuid()})"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    missing = _missing_tools()
    if missing:
        had_sshd_listening = listening_on_port(SSH_PORT)
        reason = _apt_install(sorted({_TOOL_PACKAGES[tool] for tool in missing}))
        if reason:
            return reason
        if listening_on_port(SSH_PORT) and not had_sshd_listening:
            print(
                "testbed: warning: something now listens on port 22 in the root namespace (the "
                "package's own sshd?); the testbed does not need it",
                file=sys.stderr,
                flush=True,
            )
        if still_missing := _missing_tools():
            return f"still missing after apt-get install: {', '.join(still_missing)}"
    return _probe_netns()
