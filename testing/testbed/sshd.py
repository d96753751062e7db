"""Each testbed host's sshd: its keys and config (in the host's folder), started in the host's
namespace, waited for until it answers."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from testbed.system import SSH_PORT, SSHD, TestbedError, pids_in_netns, run, ssh_banner

SSHD_START_TIMEOUT_S = 15.0


class SshTarget(Protocol):
    name: str
    address: str
    ssh_port: int


def generate_key(path: str, comment: str) -> None:
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path])


def sshd_config(host: SshTarget, host_dir: Path, authorized_keys_file: str, users: Sequence[str] = ()) -> str:
    return "\n".join(
        [
            f"# sshd of testbed host {host.name}, written by the syncswitch testbed",
            f"ListenAddress {host.address}:{SSH_PORT}",
            f"HostKey {host_dir / 'ssh_host_ed25519_key'}",
            f"PidFile {host_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized_keys_file}",
            *([f"AllowUsers {' '.join(users)}"] if users else []),
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # No PAM: the account checks and session modules add nothing here and can fail in VMs
            # and containers (pam_loginuid); key login only needs sshd's own checks.
            "UsePAM no",
            "StrictModes no",  # the key lives in the state dir, whatever its parents' modes are
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            # A backend may open one connection per process it starts; don't refuse a burst of them.
            "MaxStartups 100",
            "MaxSessions 100",
            "Subsystem sftp internal-sftp",
            "LogLevel ERROR",
            "",
        ]
    )


def start_sshd(netns: str, host_dir: Path) -> None:
    """Start the host's sshd in its namespace; it daemonizes, so no child of ours lingers."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    with contextlib.suppress(FileNotFoundError):
        (host_dir / "sshd.pid").unlink()
    config, log_file = str(host_dir / "sshd_config"), str(host_dir / "sshd.log")
    run(["ip", "netns", "exec", netns, SSHD, "-f", config, "-E", log_file])


def sshd_running(netns: str, host_dir: Path) -> bool:
    try:
        pid = int((host_dir / "sshd.pid").read_text())
    except (OSError, ValueError):
        return False
    return pid in pids_in_netns(netns)


def wait_for_sshds(hosts: Sequence[SshTarget], host_dir: Callable[[str], Path]) -> None:
    """Until every host's sshd answers with its banner; TestbedError with their logs after a while."""
    deadline = time.monotonic() + SSHD_START_TIMEOUT_S
    pending = list(hosts)
    while pending:
        pending = [h for h in pending if not ssh_banner(h.address, h.ssh_port, timeout=0.5)]
        if pending and time.monotonic() > deadline:
            logs = {h.name: (host_dir(h.name) / "sshd.log").read_text()[-300:] for h in pending}
            raise TestbedError(f"sshd did not answer within {SSHD_START_TIMEOUT_S}s on {pending}: {logs}")
        if pending:
            time.sleep(0.02)
