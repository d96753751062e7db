#!/usr/bin/env python3
"""A cluster of separate "hosts" on one Linux machine: one network namespace per host.

Each host is a network namespace with its own interface, address and sshd on port 22, joined to the
other hosts by one Linux bridge per testbed; this machine keeps an address on the bridge (the
gateway). Only the network is separate: the filesystem, the PID namespace and the users are shared
(docs/testbed.md says what that means for tests). Links can be shaped per host (delay, jitter, rate,
loss), hosts can be "lost" (every process killed, link down) and revived, and an outside namespace on
another subnet can check that a host port is not reachable from outside the cluster network.

Stdlib only (with the stdlib-only ``syncswitch.linkdelay`` from training/, whose NFQUEUE delayer
shapes links where the kernel has no netem), so tests, benchmarks and the CLI can load it by path:

    python3 scripts/testbed.py up --name ss --hosts 4 [--profile same-zone]
    python3 scripts/testbed.py status --name ss
    python3 scripts/testbed.py link --name ss --host ss-h2 --profile cross-region
    python3 scripts/testbed.py clear-link --name ss --host ss-h2
    python3 scripts/testbed.py add-host --name ss [--authorized-keys FILE]
    python3 scripts/testbed.py remove-host --name ss --host ss-h4
    python3 scripts/testbed.py down --name ss [--force]

Every name derives from the testbed name (at most 8 characters, [a-z0-9], a letter first, because
Linux interface names are limited to 15 characters): bridge ``ssbr-<name>``, outside bridge
``ssbo-<name>``, host namespaces ``<name>-h<i>`` with bridge-side veths ``ssv-<name>-<i>``, outside
namespace ``<name>-out`` with veth ``ssvo-<name>``, iptables rules commented ``syncswitch-testbed:<name>``.
That is what lets ``down --force`` find and remove a testbed whose state directory was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "training"))
from syncswitch import linkdelay  # noqa: E402 - found through the line above when loaded by path

# Run inside a host by Testbed.connect_ms: connect COUNT times to ADDRESS:PORT and print the fastest
# connect in ms, or the name of the error ("timeout", "ConnectionRefusedError", ...) on a failure.
_CONNECT_SCRIPT = """
import socket, sys, time
address, port, count, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
best = None
for _ in range(count):
    start = time.perf_counter()
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except OSError as exc:
        print("timeout" if isinstance(exc, TimeoutError) else type(exc).__name__)
        sys.exit(0)
    elapsed = (time.perf_counter() - start) * 1000
    best = elapsed if best is None else min(best, elapsed)
print(best)
"""
STATE_ROOT = "/run/syncswitch-testbed"  # tmpfs: gone after a reboot, like the namespaces themselves
SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
HOST_INTERFACE = "eth0"
CLUSTER_PREFIX = "10.77"  # cluster subnet 10.77.<subnet_index>.0/24
OUTSIDE_PREFIX = "10.78"  # the outside namespace's subnet 10.78.<subnet_index>.0/24
FIRST_HOST_OCTET = 10  # host i is 10.77.<subnet_index>.<10 + i>; .1 is the gateway
MAX_HOSTS = 200
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,7}$")
RULE_COMMENT_PREFIX = "syncswitch-testbed:"
DELAYER_COMMAND = "_delay"  # the hidden CLI command that runs a host's userspace delayer

SSHD_START_TIMEOUT_S = 15.0
PROCESS_KILL_TIMEOUT_S = 5.0

# Link profiles for Google Cloud, as the link between one host and the rest of the cluster. The delay
# is one-way: a host with delay d has a round trip of 2*d to an unshaped host (and to the gateway);
# between two shaped hosts the round trips add up (2*d1 + 2*d2), as if each host sat d away from a
# common switch. Sources:
# - "Locations within regions tend to have round-trip network latencies of <1ms in the 95th
#   percentile" (Google Cloud, Best practices for Compute Engine region selection); measured
#   intra-zone round trips are ~0.1-0.2 ms (netperf TCP_RR on same-zone VMs, e.g. PerfKitBenchmarker
#   runs), so same-zone 0.05 ms one-way (0.1 ms to a lan host, 0.2 ms between two same-zone hosts) and
#   cross-zone 0.4 ms one-way (0.8 ms to a lan host, under the documented 1 ms).
# - Compute Engine caps a VM's egress at 2 Gbit/s per vCPU (up to 16-32 Gbit/s by machine type):
#   10 Gbit/s is a mid-size VM's cap; across zones we take 5 Gbit/s for a single training flow.
# - Cross-region round trips are tens of ms (us-central1 <-> us-east1 ~25-35 ms, across the US
#   ~60-70 ms): 20 ms one-way, with a few hundred Mbit/s per flow and a little loss. Li et al.,
#   "Speeding up Deep Learning with Transient Servers" (ICAC'19, arXiv:1903.00045), the Sync-Switch
#   authors' earlier study, found workers in another region up to 48% slower, which is the effect this
#   profile is there to reproduce.
PROFILES: dict[str, dict[str, float | None]] = {
    "lan": {"delay_ms": 0.0, "jitter_ms": 0.0, "rate_mbit": None, "loss_pct": 0.0},
    "same-zone": {"delay_ms": 0.05, "jitter_ms": 0.0, "rate_mbit": 10000.0, "loss_pct": 0.0},
    "cross-zone": {"delay_ms": 0.4, "jitter_ms": 0.05, "rate_mbit": 5000.0, "loss_pct": 0.0},
    "cross-region": {"delay_ms": 20.0, "jitter_ms": 1.0, "rate_mbit": 300.0, "loss_pct": 0.01},
}

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


@dataclass(frozen=True)
class TestHost:
    """One host of the testbed: its network namespace and how to log in to it over SSH."""

    __test__ = False

    name: str  # also the network namespace's name, e.g. "ss-h0"
    address: str  # cluster address, e.g. "10.77.0.10"
    ssh_port: int
    user: str
    # Private key (OpenSSH-format ed25519) that paramiko and ssh accept for `user`; "" for a host added
    # with authorized_keys of its own (add_host), whose private keys the testbed does not have.
    key_path: str
    interface: str  # the host's interface inside its namespace


@dataclass(frozen=True)
class OutsideNamespace:
    """A namespace outside the cluster network (another bridge and subnet), for isolation tests."""

    name: str
    address: str
    gateway: str
    interface: str


@dataclass(frozen=True)
class LinkShape:
    """How a host's link is shaped; see set_link() for where each part is applied."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float | None = None
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"bad link shape {self}: delays must be >= 0 and loss in [0, 100]")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"bad link shape {self}: rate_mbit must be > 0 (None: no rate limit)")

    @property
    def needs_delayer(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def is_unshaped(self) -> bool:
        return not self.needs_delayer and self.rate_mbit is None


# ---------------------------------------------------------------------------------------------------
# small helpers


def _log(testbed: str, message: str) -> None:
    print(f"testbed {testbed}: {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise TestbedError with what it printed."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        output = (proc.stderr or proc.stdout).strip()
        raise TestbedError(f"`{shlex.join(argv)}` exited with {proc.returncode}: {output}")
    return proc


def _netns_names() -> list[str]:
    listing = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _link_names() -> list[str]:
    listing = _run(["ip", "-o", "link", "show"]).stdout
    # "7: ssv-ss-0@if6: <...>" -> "ssv-ss-0"
    return [line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if ":" in line]


def _netns_identity(netns: str) -> tuple[int, int]:
    """(device, inode) of a named namespace: what /proc/<pid>/ns/net of its processes resolves to."""
    st = os.stat(f"/run/netns/{netns}")
    return st.st_dev, st.st_ino


def _pids_in_netns(netns: str) -> list[int]:
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


def _kill_netns_processes(netns: str) -> int:
    """SIGKILL every process in a namespace until none is left (a dying process may fork); how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + PROCESS_KILL_TIMEOUT_S
    while pids := _pids_in_netns(netns):
        if time.monotonic() > deadline:
            raise TestbedError(f"processes {pids} in namespace {netns} survived SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.01)
    return len(killed)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_and_wait(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + PROCESS_KILL_TIMEOUT_S
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _ssh_banner(address: str, port: int, timeout: float) -> bool:
    """Whether an SSH server answers on address:port with its banner within timeout seconds."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _listening_on_port(port: int) -> bool:
    """Whether anything in this (the root) namespace listens on TCP `port` (any address)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serialise testbed creation on this machine, so two up()s never pick the same subnet."""
    os.makedirs(STATE_ROOT, exist_ok=True)
    with open(os.path.join(STATE_ROOT, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _used_subnet_indexes() -> set[int]:
    listing = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    used = set()
    for prefix in (CLUSTER_PREFIX, OUTSIDE_PREFIX):
        used.update(int(m) for m in re.findall(rf"inet {re.escape(prefix)}\.(\d+)\.", listing))
    return used


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
            "#!/bin/sh\n# syncswitch scripts/testbed.py: no service starts during its install\nexit 101\n"
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
    created = _run(["ip", "netns", "add", probe], check=False)
    if created.returncode != 0:
        return f"cannot create a network namespace: {created.stderr.strip()}"
    _run(["ip", "netns", "delete", probe], check=False)
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
        had_sshd_listening = _listening_on_port(SSH_PORT)
        reason = _apt_install(sorted({_TOOL_PACKAGES[tool] for tool in missing}))
        if reason:
            return reason
        if _listening_on_port(SSH_PORT) and not had_sshd_listening:
            print(
                "testbed: warning: something now listens on port 22 in the root namespace (the "
                "package's own sshd?); the testbed does not need it",
                file=sys.stderr,
                flush=True,
            )
        if still_missing := _missing_tools():
            return f"still missing after apt-get install: {', '.join(still_missing)}"
    return _probe_netns()


# ---------------------------------------------------------------------------------------------------
# the userspace delayer: used when the kernel has no sch_netem


def _delayer_main(args: argparse.Namespace) -> int:
    """Bind the host's queue (errors go to the caller), then detach and serve it until killed."""
    shape = LinkShape(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss_pct=args.loss_pct)
    queue = linkdelay.Nfqueue(args.queue, netns=args.netns)
    child = os.fork()
    if child:
        print(child, flush=True)  # the caller records it; we return at once so it never waits on us
        return 0
    os.setsid()
    with open(args.log, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    with open(os.devnull) as null:
        os.dup2(null.fileno(), 0)
    linkdelay.set_timer_slack_ns(1000)
    print(f"delayer for {args.netns}: {shape}", flush=True)
    try:
        linkdelay.run_delayer(
            queue,
            round_trip_s=2 * shape.delay_ms / 1000,
            jitter_s=shape.jitter_ms / 1000,
            loss=shape.loss_pct / 100,
        )
    except BaseException:
        traceback.print_exc()
    os._exit(1)  # a forked child must never return into the code that called main()


# ---------------------------------------------------------------------------------------------------
# the testbed


@dataclass(frozen=True)
class _Names:
    """Every name a testbed uses on this machine, derived from the testbed name."""

    testbed: str

    @property
    def bridge(self) -> str:
        return f"ssbr-{self.testbed}"

    @property
    def outside_bridge(self) -> str:
        return f"ssbo-{self.testbed}"

    @property
    def outside_netns(self) -> str:
        return f"{self.testbed}-out"

    @property
    def outside_veth(self) -> str:
        return f"ssvo-{self.testbed}"

    @property
    def rule_comment(self) -> str:
        return f"{RULE_COMMENT_PREFIX}{self.testbed}"

    def host(self, index: int) -> str:
        return f"{self.testbed}-h{index}"

    def host_veth(self, index: int) -> str:
        return f"ssv-{self.testbed}-{index}"

    def host_index(self, host_name: str) -> int:
        match = re.fullmatch(rf"{re.escape(self.testbed)}-h(\d+)", host_name)
        if not match:
            raise TestbedError(f"{host_name!r} is not a host of testbed {self.testbed}")
        return int(match.group(1))

    def is_ours_netns(self, netns: str) -> bool:
        return re.fullmatch(rf"{re.escape(self.testbed)}-(h\d+|out)", netns) is not None

    def is_ours_link(self, link: str) -> bool:
        return (
            link in (self.bridge, self.outside_bridge, self.outside_veth)
            or re.fullmatch(rf"ssv-{re.escape(self.testbed)}-\d+", link) is not None
        )


class Testbed:
    """A named cluster of network-namespace hosts; see the module docstring and docs/testbed.md."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self, name: str, hosts: int, *, subnet_index: int | None = None, state_dir: str | None = None
    ) -> None:
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(
                f"testbed name {name!r}: 1-8 characters of [a-z0-9], a letter first "
                "(interface names derived from it must fit Linux's 15 characters)"
            )
        if not 0 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be between 0 and {MAX_HOSTS}, not {hosts}")
        if subnet_index is not None and not 0 <= subnet_index <= 255:
            raise ValueError(f"subnet_index must be between 0 and 255, not {subnet_index}")
        self.name = name
        self.host_count = hosts
        self.subnet_index = subnet_index
        self.state_dir = Path(state_dir or os.path.join(STATE_ROOT, name))
        self.hosts: list[TestHost] = []
        self.outside: OutsideNamespace | None = None
        self.links: dict[str, LinkShape] = {}
        self.delay_mechanism: str | None = None  # "netem" or "nfqueue", found out by up()
        self._names = _Names(name)
        self._is_up = False
        # add_host and remove_host may run in several threads (a fake cloud API serving requests):
        # the lock guards self.hosts, the state file and known_hosts; the sets hold the indexes of hosts
        # being created or removed, not in self.hosts and not free either.
        self._lock = threading.RLock()
        self._adding: set[int] = set()
        self._removing: set[int] = set()

    # ----- addresses and paths

    @property
    def gateway(self) -> str:
        """This machine's address on the cluster bridge: what the hosts reach a local service at."""
        return f"{CLUSTER_PREFIX}.{self._subnet()}.1"

    @property
    def subnet(self) -> str:
        return f"{CLUSTER_PREFIX}.{self._subnet()}.0/24"

    @property
    def outside_subnet(self) -> str:
        return f"{OUTSIDE_PREFIX}.{self._subnet()}.0/24"

    @property
    def key_path(self) -> str:
        return str(self.state_dir / "id_ed25519")

    @property
    def known_hosts_path(self) -> str:
        """known_hosts with every host's key under its address, for clients that check host keys."""
        return str(self.state_dir / "known_hosts")

    def _subnet(self) -> int:
        if self.subnet_index is None:
            raise TestbedError(f"testbed {self.name} has no subnet yet: call up() first")
        return self.subnet_index

    def _host_dir(self, host_name: str) -> Path:
        return self.state_dir / "hosts" / host_name

    def _host_record(self, index: int, *, user: str = "root", key_path: str | None = None) -> TestHost:
        address = f"{CLUSTER_PREFIX}.{self._subnet()}.{FIRST_HOST_OCTET + index}"
        return TestHost(
            name=self._names.host(index),
            address=address,
            ssh_port=SSH_PORT,
            user=user,
            key_path=self.key_path if key_path is None else key_path,
            interface=HOST_INTERFACE,
        )

    def host(self, host: TestHost | str) -> TestHost:
        """The TestHost for a host or host name of this testbed."""
        name = host.name if isinstance(host, TestHost) else host
        for candidate in self.hosts:
            if candidate.name == name:
                return candidate
        known = [h.name for h in self.hosts]
        raise TestbedError(f"testbed {self.name} has no host {name!r} (hosts: {known})")

    def _netns(self, target: TestHost | OutsideNamespace | str) -> str:
        name = target if isinstance(target, str) else target.name
        if self.outside is not None and name == self.outside.name:
            return name
        return self.host(name).name

    # ----- bring up

    def up(self) -> list[TestHost]:
        """Create the bridge, the hosts and their sshds; return when every sshd answers.

        Raises TestbedError if a testbed of this name already exists on this machine and this object
        did not create it; a failed up() removes whatever it had created.
        """
        if self._is_up:
            return self.hosts
        reason = ensure_prerequisites()
        if reason:
            raise TestbedError(reason)
        started = time.monotonic()
        with _state_lock():
            self._refuse_if_exists()  # before the try: a clash must not remove the other testbed
            try:
                if self.subnet_index is None:
                    self.subnet_index = self._free_subnet_index()
                self._create_state_dir()
                self._create_bridge()
            except BaseException:
                self._abort_up()
                raise
        try:
            self.delay_mechanism = self._probe_delay_mechanism()
            self._generate_key(self.key_path, comment=f"syncswitch-testbed-{self.name}")
            self.hosts = [self._host_record(i) for i in range(self.host_count)]
            for index, host in enumerate(self.hosts):
                self._create_host(index, host)
            self._write_known_hosts()
            for host in self.hosts:
                self._start_sshd(host)
            self._wait_for_sshds(self.hosts)
            self._is_up = True
            self._save_state()
        except BaseException:
            self._abort_up()
            raise
        for host in self.hosts:
            _log(self.name, f"host {host.name} up at {host.address}")
        _log(
            self.name,
            f"up: {len(self.hosts)} hosts on {self.subnet} (gateway {self.gateway}, delays by "
            f"{self.delay_mechanism}) in {time.monotonic() - started:.2f}s",
        )
        return self.hosts

    def _abort_up(self) -> None:
        _log(self.name, "up failed; removing what it created")
        self.down()

    def _refuse_if_exists(self) -> None:
        leftovers = [n for n in _netns_names() if self._names.is_ours_netns(n)]
        leftovers += [link for link in _link_names() if self._names.is_ours_link(link)]
        if self.state_dir.exists():
            leftovers.append(str(self.state_dir))
        if leftovers:
            raise TestbedError(
                f"testbed {self.name} already exists ({', '.join(leftovers)}); remove it with "
                f"`python3 scripts/testbed.py down --name {self.name}` (add --force if its state is gone)"
            )

    def _free_subnet_index(self) -> int:
        used = _used_subnet_indexes()
        for index in range(256):
            if index not in used:
                return index
        raise TestbedError(f"no free subnet left in {CLUSTER_PREFIX}.0.0/16")

    def _create_state_dir(self) -> None:
        (self.state_dir / "hosts").mkdir(parents=True, mode=0o700)
        self._save_state()

    def _create_bridge(self) -> None:
        bridge = self._names.bridge
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        # With br_netfilter loaded, frames between hosts cross the root namespace's FORWARD chain;
        # a DROP policy there (Docker sets one) would cut the hosts off from each other.
        self._add_root_rule(["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"])
        _log(self.name, f"bridge {bridge} at {self.gateway} on {self.subnet}")

    def _probe_delay_mechanism(self) -> str:
        """netem when the kernel has it; else the userspace NFQUEUE delayer (some VM kernels lack it)."""
        probe = _run(
            ["tc", "qdisc", "add", "dev", self._names.bridge, "root", "netem", "delay", "1ms"], check=False
        )
        if probe.returncode != 0:
            return "nfqueue"
        _run(["tc", "qdisc", "del", "dev", self._names.bridge, "root"], check=False)
        return "netem"

    @staticmethod
    def _generate_key(path: str, comment: str) -> None:
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path])

    def _create_host(
        self, index: int, host: TestHost, *, authorized_keys: str | None = None, users: Sequence[str] = ()
    ) -> None:
        netns, veth = host.name, self._names.host_veth(index)
        _run(["ip", "netns", "add", netns])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", netns])
        _run(["ip", "link", "set", veth, "master", self._names.bridge, "up"])
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        _run(["ip", "-n", netns, "addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE])
        _run(["ip", "-n", netns, "link", "set", HOST_INTERFACE, "up"])
        _run(["ip", "-n", netns, "route", "add", "default", "via", self.gateway])
        host_dir = self._host_dir(host.name)
        host_dir.mkdir(mode=0o700)
        self._generate_key(str(host_dir / "ssh_host_ed25519_key"), comment=host.name)
        keys_file = f"{self.key_path}.pub"
        if authorized_keys is not None:
            keys_file = str(host_dir / "authorized_keys")
            Path(keys_file).write_text(authorized_keys.rstrip("\n") + "\n")
        (host_dir / "sshd_config").write_text(self._sshd_config(host, host_dir, keys_file, users))

    def _sshd_config(
        self,
        host: TestHost,
        host_dir: Path,
        authorized_keys_file: str | None = None,
        users: Sequence[str] = (),
    ) -> str:
        return "\n".join(
            [
                f"# sshd of testbed host {host.name}, written by scripts/testbed.py",
                f"ListenAddress {host.address}:{SSH_PORT}",
                f"HostKey {host_dir / 'ssh_host_ed25519_key'}",
                f"PidFile {host_dir / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized_keys_file or self.key_path + '.pub'}",
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

    def _write_known_hosts(self) -> None:
        with self._lock:
            lines = []
            for host in self.hosts:
                public_key = self._host_dir(host.name) / "ssh_host_ed25519_key.pub"
                key_type, key = public_key.read_text().split()[:2]
                lines.append(f"{host.address} {key_type} {key}\n")
            path = Path(self.known_hosts_path)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(lines))
            tmp.replace(path)  # a client reading it meanwhile sees the old or the new file, never half

    def _start_sshd(self, host: TestHost) -> None:
        """Start the host's sshd in its namespace; it daemonizes, so no child of ours lingers."""
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        host_dir = self._host_dir(host.name)
        with contextlib.suppress(FileNotFoundError):
            (host_dir / "sshd.pid").unlink()
        _run(
            [
                "ip",
                "netns",
                "exec",
                host.name,
                SSHD,
                "-f",
                str(host_dir / "sshd_config"),
                "-E",
                str(host_dir / "sshd.log"),
            ]
        )

    def _sshd_running(self, host: TestHost) -> bool:
        try:
            pid = int((self._host_dir(host.name) / "sshd.pid").read_text())
        except (OSError, ValueError):
            return False
        return pid in _pids_in_netns(host.name)

    def _wait_for_sshds(self, hosts: list[TestHost]) -> None:
        deadline = time.monotonic() + SSHD_START_TIMEOUT_S
        pending = list(hosts)
        while pending:
            pending = [h for h in pending if not _ssh_banner(h.address, h.ssh_port, timeout=0.5)]
            if pending and time.monotonic() > deadline:
                logs = {h.name: (self._host_dir(h.name) / "sshd.log").read_text()[-300:] for h in pending}
                raise TestbedError(f"sshd did not answer within {SSHD_START_TIMEOUT_S}s on {pending}: {logs}")
            if pending:
                time.sleep(0.02)

    # ----- root-namespace firewall rules (tagged with our comment, so down can find them)

    def _add_root_rule(self, rule: list[str]) -> None:
        chain, spec = rule[0], rule[1:]
        _run(["iptables", "-w", "-I", chain, *spec, "-m", "comment", "--comment", self._names.rule_comment])

    def _remove_root_rules(self) -> None:
        listing = _run(["iptables", "-w", "-S"], check=False).stdout
        for line in listing.splitlines():
            words = shlex.split(line)
            if words[:1] == ["-A"] and self._names.rule_comment in words:
                _run(["iptables", "-w", "-D", *words[1:]], check=False)

    # ----- outside namespace

    def add_outside_namespace(self) -> OutsideNamespace:
        """A namespace `<name>-out` on its own bridge and subnet, routed through the root namespace.

        The root namespace does not forward from the outside subnet to the cluster subnet: an
        explicit iptables DROP rule says so even on a machine that forwards (ip_forward=1), so a
        host port is unreachable from here while the gateway (a local address) stays reachable.
        """
        if self.outside is not None:
            return self.outside
        index = self._subnet()
        names = self._names
        outside = OutsideNamespace(
            name=names.outside_netns,
            address=f"{OUTSIDE_PREFIX}.{index}.{FIRST_HOST_OCTET}",
            gateway=f"{OUTSIDE_PREFIX}.{index}.1",
            interface=HOST_INTERFACE,
        )
        _run(["ip", "link", "add", names.outside_bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{outside.gateway}/24", "dev", names.outside_bridge])
        _run(["ip", "link", "set", names.outside_bridge, "up"])
        _run(["ip", "netns", "add", outside.name])
        _run(
            [
                "ip",
                "link",
                "add",
                names.outside_veth,
                "type",
                "veth",
                "peer",
                "name",
                HOST_INTERFACE,
                "netns",
                outside.name,
            ]
        )
        _run(["ip", "link", "set", names.outside_veth, "master", names.outside_bridge, "up"])
        _run(["ip", "-n", outside.name, "link", "set", "lo", "up"])
        _run(["ip", "-n", outside.name, "addr", "add", f"{outside.address}/24", "dev", HOST_INTERFACE])
        _run(["ip", "-n", outside.name, "link", "set", HOST_INTERFACE, "up"])
        _run(["ip", "-n", outside.name, "route", "add", "default", "via", outside.gateway])
        self._add_root_rule(["FORWARD", "-s", self.outside_subnet, "-d", self.subnet, "-j", "DROP"])
        self.outside = outside
        self._save_state()
        _log(self.name, f"outside namespace {outside.name} at {outside.address}, cut off from {self.subnet}")
        return outside

    # ----- processes

    def exec(
        self, host: TestHost | OutsideNamespace | str, argv: list[str], **subprocess_kwargs: Any
    ) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside the host's network namespace (`ip netns exec`)."""
        return subprocess.run(["ip", "netns", "exec", self._netns(host), *argv], **subprocess_kwargs)

    def popen(
        self, host: TestHost | OutsideNamespace | str, argv: list[str], **subprocess_kwargs: Any
    ) -> subprocess.Popen:
        """subprocess.Popen(argv) inside the host's namespace; ip execs argv, so .pid is argv's pid."""
        return subprocess.Popen(["ip", "netns", "exec", self._netns(host), *argv], **subprocess_kwargs)

    def processes(self, host: TestHost | OutsideNamespace | str) -> list[int]:
        """Pids of the live processes in the host's network namespace: the host's process table."""
        return _pids_in_netns(self._netns(host))

    def connect_ms(
        self,
        from_host: TestHost | OutsideNamespace | str,
        address: str,
        port: int,
        *,
        count: int = 1,
        timeout: float = 2.0,
    ) -> float | str:
        """The fastest of ``count`` TCP connects from a host to address:port, in ms; the error's name
        ("timeout", "ConnectionRefusedError", ...) when one fails."""
        argv = [sys.executable, "-c", _CONNECT_SCRIPT, address, str(port), str(count), str(timeout)]
        proc = self.exec(from_host, argv, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise TestbedError(f"connect probe from {from_host} failed: {proc.stderr.strip()}")
        try:
            return float(proc.stdout)
        except ValueError:
            return proc.stdout.strip()

    # ----- link shaping

    def set_link(
        self,
        host: TestHost | str,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        rate_mbit: float | None = None,
        loss_pct: float = 0.0,
    ) -> None:
        """Shape the host's link to the cluster; replaces any earlier shape of that link.

        - rate_mbit: both directions, by an HTB class on each end of the host's veth (the host's
          interface for outbound, the bridge-side end for inbound).
        - delay_ms (one-way) and jitter_ms: applied once, on the inbound side, as the whole round
          trip (2 * delay_ms, spread by +-jitter_ms), so the host's round trip to an unshaped peer
          is 2 * delay_ms. Delaying outbound packets in the host instead would hold them while
          they are still charged to the sending socket, and TCP small queues would then throttle
          bulk transfers far below the rate; only the one-way split differs from a symmetric link.
        - loss_pct: in each direction.
        Delay, jitter and loss use netem when the kernel has it, else the userspace NFQUEUE delayer
        (a process in this namespace, not the host's, so it is not in the host's process table).
        """
        target = self.host(host)
        shape = LinkShape(delay_ms=delay_ms, jitter_ms=jitter_ms, rate_mbit=rate_mbit, loss_pct=loss_pct)
        self.clear_link(target, quiet=True)
        index = self._names.host_index(target.name)
        outward = ["ip", "netns", "exec", target.name, "tc"]
        inward = ["tc"]
        veth = self._names.host_veth(index)
        if self.delay_mechanism == "netem":
            self._shape_netem(inward, veth, shape, delay_ms=2 * shape.delay_ms, jitter_ms=shape.jitter_ms)
            self._shape_netem(outward, HOST_INTERFACE, shape, delay_ms=0.0, jitter_ms=0.0)
        else:
            self._shape_rate(inward, veth, shape.rate_mbit)
            self._shape_rate(outward, HOST_INTERFACE, shape.rate_mbit)
            if shape.needs_delayer:
                self._start_delayer(target, shape)
        self.links[target.name] = shape
        self._save_state()
        _log(self.name, f"link of {target.name}: {self._describe(shape)} (by {self.delay_mechanism})")

    @staticmethod
    def _describe(shape: LinkShape) -> str:
        if shape.is_unshaped:
            return "unshaped"
        rate = f"{shape.rate_mbit:g} Mbit/s" if shape.rate_mbit else "no rate limit"
        return (
            f"one-way delay {shape.delay_ms:g} ms (+-{shape.jitter_ms:g} ms), {rate}, "
            f"loss {shape.loss_pct:g}%"
        )

    @staticmethod
    def _shape_rate(tc: list[str], device: str, rate_mbit: float | None) -> None:
        if rate_mbit is None:
            return
        # quantum: HTB's default (rate / 10) is out of range at Gbit rates; one class needs no fairness.
        _run([*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1"])
        _run(
            [
                *tc,
                "class",
                "add",
                "dev",
                device,
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                f"{rate_mbit:g}mbit",
                "ceil",
                f"{rate_mbit:g}mbit",
                "quantum",
                "200000",
            ]
        )

    def _shape_netem(
        self, tc: list[str], device: str, shape: LinkShape, *, delay_ms: float, jitter_ms: float
    ) -> None:
        self._shape_rate(tc, device, shape.rate_mbit)
        if not (delay_ms or jitter_ms or shape.loss_pct):
            return
        parent = ["parent", "1:1", "handle", "10:"] if shape.rate_mbit else ["root"]
        netem = ["netem", "limit", "100000", "delay", f"{delay_ms:g}ms"]
        if jitter_ms:
            netem.append(f"{jitter_ms:g}ms")
        if shape.loss_pct:
            netem += ["loss", f"{shape.loss_pct:g}%"]
        _run([*tc, "qdisc", "add", "dev", device, *parent, *netem])

    def _start_delayer(self, host: TestHost, shape: LinkShape) -> None:
        host_dir = self._host_dir(host.name)
        started = _run(
            [
                sys.executable,
                os.path.abspath(__file__),
                DELAYER_COMMAND,
                "--testbed",
                self.name,
                "--netns",
                host.name,
                "--queue",
                "0",
                "--delay-ms",
                str(shape.delay_ms),
                "--jitter-ms",
                str(shape.jitter_ms),
                "--loss-pct",
                str(shape.loss_pct),
                "--log",
                str(host_dir / "delayer.log"),
            ]
        )
        (host_dir / "delayer.pid").write_text(started.stdout.strip())
        # Rules after the queue is bound: a queued packet with no listener would be dropped.
        iptables = ["ip", "netns", "exec", host.name, "iptables", "-w", "-t", "raw", "-A"]
        queue = ["-j", "NFQUEUE", "--queue-num", "0"]
        _run([*iptables, "PREROUTING", "-i", HOST_INTERFACE, *queue])
        if shape.loss_pct:
            _run([*iptables, "OUTPUT", "-o", HOST_INTERFACE, *queue])

    def _stop_delayer(self, host: TestHost) -> None:
        pid_file = self._host_dir(host.name) / "delayer.pid"
        if not pid_file.exists():
            return
        for chain in ("PREROUTING", "OUTPUT"):
            _run(["ip", "netns", "exec", host.name, "iptables", "-w", "-t", "raw", "-F", chain], check=False)
        pid = int(pid_file.read_text())
        if _is_delayer_of(pid, self.name):
            _kill_and_wait(pid)
        pid_file.unlink()

    def set_profile(self, host: TestHost | str, profile: str) -> None:
        """Shape the host's link with a named profile from PROFILES."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
        self.set_link(host, **PROFILES[profile])

    def clear_link(self, host: TestHost | str, *, quiet: bool = False) -> None:
        """Remove every shaping of the host's link."""
        target = self.host(host)
        veth = self._names.host_veth(self._names.host_index(target.name))
        self._stop_delayer(target)
        _run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
        _run(
            ["ip", "netns", "exec", target.name, "tc", "qdisc", "del", "dev", HOST_INTERFACE, "root"],
            check=False,
        )
        if self.links.pop(target.name, None) is not None:
            self._save_state()
        if not quiet:
            _log(self.name, f"link of {target.name}: unshaped")

    # ----- losing and replacing hosts

    def kill_host(self, host: TestHost | str) -> None:
        """Lose the host: SIGKILL every process in its namespace and take its link down."""
        target = self.host(host)
        killed = _kill_netns_processes(target.name)
        _run(["ip", "link", "set", self._names.host_veth(self._names.host_index(target.name)), "down"])
        _log(self.name, f"host {target.name} lost ({killed} processes killed, link down)")

    def revive_host(self, host: TestHost | str) -> None:
        """Bring a lost host back: link up, sshd started, answering (link shaping is kept)."""
        target = self.host(host)
        _run(["ip", "link", "set", self._names.host_veth(self._names.host_index(target.name)), "up"])
        if not self._sshd_running(target):
            self._start_sshd(target)
        self._wait_for_sshds([target])
        _log(self.name, f"host {target.name} back at {target.address}")

    # ----- hosts added and removed while the testbed is up (a cloud's instances come and go)

    def add_host(self, authorized_keys: str | None = None, *, users: Sequence[str] = ()) -> TestHost:
        """One more host, at the lowest index no current host has; returns when its sshd answers.

        authorized_keys: text in authorized_keys format; the host's sshd then accepts those keys instead
        of the testbed key (and the TestHost's key_path is ""). users: the only login names its sshd
        allows (AllowUsers; they must exist on this machine, whose users the hosts share), the first
        becoming TestHost.user; none given: any user, TestHost.user "root". Safe to call from several
        threads at once; hosts are created in parallel.
        """
        if not self._is_up:
            raise TestbedError(f"testbed {self.name} is not up: call up() first")
        with self._lock:
            taken = {self._names.host_index(h.name) for h in self.hosts} | self._adding | self._removing
            index = next((i for i in range(MAX_HOSTS) if i not in taken), None)
            if index is None:
                raise TestbedError(f"testbed {self.name} has no free host index (at most {MAX_HOSTS} hosts)")
            self._adding.add(index)
        host = self._host_record(
            index, user=users[0] if users else "root", key_path=None if authorized_keys is None else ""
        )
        try:
            self._create_host(index, host, authorized_keys=authorized_keys, users=users)
            self._start_sshd(host)
            self._wait_for_sshds([host])
        except BaseException:
            try:
                self._remove_host_resources(host)
            finally:
                with self._lock:
                    self._adding.discard(index)
            raise
        with self._lock:
            self._adding.discard(index)
            self.hosts.append(host)
            self.host_count = len(self.hosts)
            self._write_known_hosts()
            self._save_state()
        _log(self.name, f"host {host.name} added at {host.address}")
        return host

    def remove_host(self, host: TestHost | str) -> None:
        """Remove a host for good: every process in its namespace killed, the namespace, its veth and
        its directory (keys, sshd config and log) deleted. A host already removed (or being removed by
        another thread) is a no-op. Safe to call from several threads at once."""
        name = host.name if isinstance(host, TestHost) else host
        with self._lock:
            target = next((h for h in self.hosts if h.name == name), None)
            if target is None:
                return
            # Out of the list first (known_hosts is rewritten from it, and reads each host's key), but
            # its index stays taken until its namespace and veth are gone.
            self._removing.add(self._names.host_index(name))
            self.hosts = [h for h in self.hosts if h.name != name]
            self.host_count = len(self.hosts)
            self._write_known_hosts()
            self._save_state()
        try:
            killed = self._remove_host_resources(target)
        finally:
            with self._lock:
                self._removing.discard(self._names.host_index(name))
                if self.links.pop(name, None) is not None:
                    self._save_state()
        _log(self.name, f"host {name} removed ({killed} processes killed)")

    def _remove_host_resources(self, host: TestHost) -> int:
        """Kill the host's processes, delete its veth, namespace and directory; how many were killed."""
        self._stop_delayer(host)
        killed = _kill_netns_processes(host.name)
        veth = self._names.host_veth(self._names.host_index(host.name))
        # The veth first: deleting it takes its peer out of the namespace at once, whereas a deleted
        # namespace's interfaces go later, in the kernel's own time, and the name could still be taken.
        if veth in _link_names():
            _run(["ip", "link", "delete", veth])
        if host.name in _netns_names():
            _run(["ip", "netns", "delete", host.name])
        # Forget the gone host's MAC here and on every other host: a host added later at the same address
        # has another one, and a stale neighbour entry would send its traffic nowhere for half a minute.
        _run(["ip", "neigh", "flush", "to", host.address], check=False)
        for other in list(self.hosts):
            _run(["ip", "-n", other.name, "neigh", "flush", "to", host.address], check=False)
        shutil.rmtree(self._host_dir(host.name), ignore_errors=True)
        return killed

    # ----- state and tear down

    def _save_state(self) -> None:
        with self._lock:
            self._write_state()

    def _write_state(self) -> None:
        state = {
            "name": self.name,
            "hosts": self.host_count,
            # The hosts themselves: with add_host and remove_host their indexes need not be 0..hosts-1,
            # and an added host may have keys and a user of its own. A state without them (written
            # before hosts could be added) means hosts 0..hosts-1.
            "host_records": [asdict(host) for host in self.hosts],
            "subnet_index": self.subnet_index,
            "delay_mechanism": self.delay_mechanism,
            "up": self._is_up,
            "outside": asdict(self.outside) if self.outside else None,
            "links": {name: asdict(shape) for name, shape in self.links.items()},
        }
        path = self.state_dir / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def existing(cls, name: str, *, state_dir: str | None = None) -> Testbed:
        """Re-attach to a testbed this machine is running, from its state directory."""
        testbed_dir = Path(state_dir or os.path.join(STATE_ROOT, name))
        try:
            state = json.loads((testbed_dir / "state.json").read_text())
        except FileNotFoundError:
            raise TestbedError(
                f"no testbed {name} here (no {testbed_dir / 'state.json'}); leftovers of a lost state go "
                f"with `python3 scripts/testbed.py down --name {name} --force`"
            ) from None
        testbed = cls(name, state["hosts"], subnet_index=state["subnet_index"], state_dir=str(testbed_dir))
        testbed.delay_mechanism = state["delay_mechanism"]
        if "host_records" in state:
            testbed.hosts = [TestHost(**record) for record in state["host_records"]]
        else:
            testbed.hosts = [testbed._host_record(i) for i in range(testbed.host_count)]
        testbed.outside = OutsideNamespace(**state["outside"]) if state["outside"] else None
        testbed.links = {host: LinkShape(**shape) for host, shape in state["links"].items()}
        testbed._is_up = state["up"]
        return testbed

    @classmethod
    def remove_leftovers(cls, name: str, *, state_dir: str | None = None) -> None:
        """down() by name alone: for a testbed whose state directory is lost (`down --force`)."""
        cls(name, 0, state_dir=state_dir).down()

    def down(self) -> None:
        """Remove everything of this testbed, found by name: processes, namespaces, links, rules, state.

        Safe to call on a partial or already removed testbed.
        """
        names = self._names
        for pid in _delayer_pids(self.name):
            _kill_and_wait(pid)
        for netns in _netns_names():
            if names.is_ours_netns(netns):
                killed = _kill_netns_processes(netns)
                _run(["ip", "netns", "delete", netns], check=False)
                _log(self.name, f"namespace {netns} removed ({killed} processes killed)")
        for link in _link_names():  # the veths went with their namespaces; the bridges are left
            if names.is_ours_link(link):
                _run(["ip", "link", "delete", link], check=False)
        if shutil.which("iptables"):
            self._remove_root_rules()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self._is_up = False
        self.hosts = []
        self.outside = None
        self.links = {}
        _log(self.name, "down")

    def status(self) -> dict[str, Any]:
        """What is running: per host its address, whether sshd answers, its process count and link."""
        return {
            "name": self.name,
            "subnet": self.subnet,
            "gateway": self.gateway,
            "delay_mechanism": self.delay_mechanism,
            "key_path": self.key_path,
            "known_hosts": self.known_hosts_path,
            "hosts": [
                {
                    "name": host.name,
                    "address": host.address,
                    # Counted before the sshd probe, whose connection briefly adds an sshd child.
                    "processes": len(self.processes(host)),
                    "sshd": _ssh_banner(host.address, host.ssh_port, timeout=0.5),
                    "link": asdict(self.links[host.name]) if host.name in self.links else None,
                }
                for host in self.hosts
            ],
            "outside": asdict(self.outside) if self.outside else None,
        }


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_delayer_of(pid: int, testbed: str) -> bool:
    cmdline = _cmdline(pid)
    return DELAYER_COMMAND in cmdline and f"--testbed\0{testbed}\0" in "\0".join(cmdline) + "\0"


def _delayer_pids(testbed: str) -> list[int]:
    """The testbed's delayers, found by command line (they live in the root namespace)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _is_delayer_of(int(e), testbed)]


# ---------------------------------------------------------------------------------------------------
# command line


def _shape_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.profile:
        return dict(PROFILES[args.profile])
    return {
        "delay_ms": args.delay_ms,
        "jitter_ms": args.jitter_ms,
        "rate_mbit": args.rate_mbit,
        "loss_pct": args.loss_pct,
    }


def _add_shape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), help="a named link profile")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (round trip: twice)")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument("--loss-pct", type=float, default=0.0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create a testbed and print its hosts as JSON")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--subnet-index", type=int, default=None)
    up.add_argument("--profile", choices=sorted(PROFILES), help="shape every host's link")
    down = commands.add_parser("down", help="remove a testbed")
    down.add_argument("--force", action="store_true", help="remove by name even without its state directory")
    commands.add_parser("status", help="print a testbed's state as JSON")
    link = commands.add_parser("link", help="shape one host's link")
    link.add_argument("--host", required=True)
    _add_shape_options(link)
    clear = commands.add_parser("clear-link", help="remove one host's link shaping")
    clear.add_argument("--host", required=True)
    add = commands.add_parser("add-host", help="add a host to a testbed that is up; print it as JSON")
    add.add_argument(
        "--authorized-keys",
        metavar="FILE",
        default=None,
        help="keys the host's sshd accepts instead of the testbed key",
    )
    add.add_argument(
        "--user",
        dest="users",
        action="append",
        default=[],
        help="a login name the host's sshd allows (repeatable; default: any)",
    )
    remove = commands.add_parser("remove-host", help="remove a host for good")
    remove.add_argument("--host", required=True)
    delayer = commands.add_parser(DELAYER_COMMAND)  # internal: started by set_link()
    delayer.add_argument("--netns", required=True)
    delayer.add_argument("--queue", type=int, default=0)
    delayer.add_argument("--delay-ms", type=float, default=0.0)
    delayer.add_argument("--jitter-ms", type=float, default=0.0)
    delayer.add_argument("--loss-pct", type=float, default=0.0)
    delayer.add_argument("--log", required=True)
    for sub in (up, down, link, clear, add, remove, delayer, commands.choices["status"]):
        sub.add_argument("--name", "--testbed", dest="name", required=True, help="testbed name")
        if sub is not delayer:
            sub.add_argument("--state-dir", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == DELAYER_COMMAND:
        return _delayer_main(args)
    try:
        if args.command == "up":
            testbed = Testbed(args.name, args.hosts, subnet_index=args.subnet_index, state_dir=args.state_dir)
            testbed.up()
            if args.profile:
                for host in testbed.hosts:
                    testbed.set_profile(host, args.profile)
            print(json.dumps(testbed.status(), indent=2))
        elif args.command == "down" and args.force:
            Testbed.remove_leftovers(args.name, state_dir=args.state_dir)
        else:
            testbed = Testbed.existing(args.name, state_dir=args.state_dir)
            if args.command == "down":
                testbed.down()
            elif args.command == "status":
                print(json.dumps(testbed.status(), indent=2))
            elif args.command == "link":
                testbed.set_link(args.host, **_shape_from_args(args))
            elif args.command == "clear-link":
                testbed.clear_link(args.host)
            elif args.command == "add-host":
                keys = Path(args.authorized_keys).read_text() if args.authorized_keys else None
                print(json.dumps(asdict(testbed.add_host(keys, users=args.users)), indent=2))
            elif args.command == "remove-host":
                testbed.remove_host(testbed.host(args.host))
    except (TestbedError, ValueError) as exc:
        print(f"testbed {args.name}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
