"""The testbed itself: a named cluster of network-namespace hosts on one bridge, their lifecycle
(up, lost and revived, added and removed, down), link shaping per host and the testbed's state file.

Longer than the usual module because every operation of a Testbed changes its namespaces, its bridge
and its state file together; split, each part would reach into the others'."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from testbed.links import (
    PROFILES,
    LinkShape,
    delayer_pids,
    probe_delay_mechanism,
    shape_netem,
    shape_rate,
    start_delayer,
    stop_delayer,
)
from testbed.sshd import generate_key, sshd_config, sshd_running, start_sshd, wait_for_sshds
from testbed.system import (
    HOST_INTERFACE,
    SSH_PORT,
    STATE_ROOT,
    TestbedError,
    ensure_prerequisites,
    kill_and_wait,
    kill_netns_processes,
    link_names,
    log,
    netns_names,
    pids_in_netns,
    run,
    ssh_banner,
    state_lock,
)

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
CLUSTER_PREFIX = "10.77"  # cluster subnet 10.77.<subnet_index>.0/24
OUTSIDE_PREFIX = "10.78"  # the outside namespace's subnet 10.78.<subnet_index>.0/24
FIRST_HOST_OCTET = 10  # host i is 10.77.<subnet_index>.<10 + i>; .1 is the gateway
MAX_HOSTS = 200
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,7}$")
RULE_COMMENT_PREFIX = "syncswitch-testbed:"


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


def _used_subnet_indexes() -> set[int]:
    listing = run(["ip", "-4", "-o", "addr", "show"]).stdout
    used = set()
    for prefix in (CLUSTER_PREFIX, OUTSIDE_PREFIX):
        used.update(int(m) for m in re.findall(rf"inet {re.escape(prefix)}\.(\d+)\.", listing))
    return used


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
        with state_lock():
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
            self.delay_mechanism = probe_delay_mechanism(self._names.bridge)
            generate_key(self.key_path, comment=f"syncswitch-testbed-{self.name}")
            self.hosts = [self._host_record(i) for i in range(self.host_count)]
            for index, host in enumerate(self.hosts):
                self._create_host(index, host)
            self._write_known_hosts()
            for host in self.hosts:
                start_sshd(host.name, self._host_dir(host.name))
            wait_for_sshds(self.hosts, self._host_dir)
            self._is_up = True
            self._save_state()
        except BaseException:
            self._abort_up()
            raise
        for host in self.hosts:
            log(self.name, f"host {host.name} up at {host.address}")
        log(
            self.name,
            f"up: {len(self.hosts)} hosts on {self.subnet} (gateway {self.gateway}, delays by "
            f"{self.delay_mechanism}) in {time.monotonic() - started:.2f}s",
        )
        return self.hosts

    def _abort_up(self) -> None:
        log(self.name, "up failed; removing what it created")
        self.down()

    def _refuse_if_exists(self) -> None:
        leftovers = [n for n in netns_names() if self._names.is_ours_netns(n)]
        leftovers += [link for link in link_names() if self._names.is_ours_link(link)]
        if self.state_dir.exists():
            leftovers.append(str(self.state_dir))
        if leftovers:
            raise TestbedError(
                f"testbed {self.name} already exists ({', '.join(leftovers)}); remove it with "
                f"`python -m testbed down --name {self.name}` (add --force if its state is gone)"
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
        run(["ip", "link", "add", bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.gateway}/24", "dev", bridge])
        run(["ip", "link", "set", bridge, "up"])
        # With br_netfilter loaded, frames between hosts cross the root namespace's FORWARD chain;
        # a DROP policy there (Docker sets one) would cut the hosts off from each other.
        self._add_root_rule(["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"])
        log(self.name, f"bridge {bridge} at {self.gateway} on {self.subnet}")

    def _create_host(
        self, index: int, host: TestHost, *, authorized_keys: str | None = None, users: Sequence[str] = ()
    ) -> None:
        netns, veth = host.name, self._names.host_veth(index)
        run(["ip", "netns", "add", netns])
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", netns])
        run(["ip", "link", "set", veth, "master", self._names.bridge, "up"])
        run(["ip", "-n", netns, "link", "set", "lo", "up"])
        run(["ip", "-n", netns, "addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE])
        run(["ip", "-n", netns, "link", "set", HOST_INTERFACE, "up"])
        run(["ip", "-n", netns, "route", "add", "default", "via", self.gateway])
        host_dir = self._host_dir(host.name)
        host_dir.mkdir(mode=0o700)
        generate_key(str(host_dir / "ssh_host_ed25519_key"), comment=host.name)
        keys_file = f"{self.key_path}.pub"
        if authorized_keys is not None:
            keys_file = str(host_dir / "authorized_keys")
            Path(keys_file).write_text(authorized_keys.rstrip("\n") + "\n")
        (host_dir / "sshd_config").write_text(sshd_config(host, host_dir, keys_file, users))

    def host_key(self, host: TestHost | str) -> str:
        """The host's SSH host key as ``TYPE BASE64`` (a known_hosts line without its host)."""
        name = host.name if isinstance(host, TestHost) else host
        key_type, key = (self._host_dir(name) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        return f"{key_type} {key}"

    def _write_known_hosts(self) -> None:
        with self._lock:
            lines = [f"{host.address} {self.host_key(host)}\n" for host in self.hosts]
            path = Path(self.known_hosts_path)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(lines))
            tmp.replace(path)  # a client reading it meanwhile sees the old or the new file, never half

    # ----- root-namespace firewall rules (tagged with our comment, so down can find them)

    def _add_root_rule(self, rule: list[str]) -> None:
        chain, spec = rule[0], rule[1:]
        run(["iptables", "-w", "-I", chain, *spec, "-m", "comment", "--comment", self._names.rule_comment])

    def _remove_root_rules(self) -> None:
        listing = run(["iptables", "-w", "-S"], check=False).stdout
        for line in listing.splitlines():
            words = shlex.split(line)
            if words[:1] == ["-A"] and self._names.rule_comment in words:
                run(["iptables", "-w", "-D", *words[1:]], check=False)

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
        run(["ip", "link", "add", names.outside_bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{outside.gateway}/24", "dev", names.outside_bridge])
        run(["ip", "link", "set", names.outside_bridge, "up"])
        run(["ip", "netns", "add", outside.name])
        run(
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
        run(["ip", "link", "set", names.outside_veth, "master", names.outside_bridge, "up"])
        run(["ip", "-n", outside.name, "link", "set", "lo", "up"])
        run(["ip", "-n", outside.name, "addr", "add", f"{outside.address}/24", "dev", HOST_INTERFACE])
        run(["ip", "-n", outside.name, "link", "set", HOST_INTERFACE, "up"])
        run(["ip", "-n", outside.name, "route", "add", "default", "via", outside.gateway])
        self._add_root_rule(["FORWARD", "-s", self.outside_subnet, "-d", self.subnet, "-j", "DROP"])
        self.outside = outside
        self._save_state()
        log(self.name, f"outside namespace {outside.name} at {outside.address}, cut off from {self.subnet}")
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
        return pids_in_netns(self._netns(host))

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
            shape_netem(inward, veth, shape, delay_ms=2 * shape.delay_ms, jitter_ms=shape.jitter_ms)
            shape_netem(outward, HOST_INTERFACE, shape, delay_ms=0.0, jitter_ms=0.0)
        else:
            shape_rate(inward, veth, shape.rate_mbit)
            shape_rate(outward, HOST_INTERFACE, shape.rate_mbit)
            if shape.needs_delayer:
                start_delayer(self.name, target.name, shape, self._host_dir(target.name))
        self.links[target.name] = shape
        self._save_state()
        log(self.name, f"link of {target.name}: {shape.describe()} (by {self.delay_mechanism})")

    def set_profile(self, host: TestHost | str, profile: str) -> None:
        """Shape the host's link with a named profile from PROFILES."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
        self.set_link(host, **PROFILES[profile])

    def clear_link(self, host: TestHost | str, *, quiet: bool = False) -> None:
        """Remove every shaping of the host's link."""
        target = self.host(host)
        veth = self._names.host_veth(self._names.host_index(target.name))
        stop_delayer(self.name, target.name, self._host_dir(target.name))
        run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
        run(
            ["ip", "netns", "exec", target.name, "tc", "qdisc", "del", "dev", HOST_INTERFACE, "root"],
            check=False,
        )
        if self.links.pop(target.name, None) is not None:
            self._save_state()
        if not quiet:
            log(self.name, f"link of {target.name}: unshaped")

    # ----- losing and replacing hosts

    def kill_host(self, host: TestHost | str) -> None:
        """Lose the host: SIGKILL every process in its namespace and take its link down."""
        target = self.host(host)
        killed = kill_netns_processes(target.name)
        run(["ip", "link", "set", self._names.host_veth(self._names.host_index(target.name)), "down"])
        log(self.name, f"host {target.name} lost ({killed} processes killed, link down)")

    def revive_host(self, host: TestHost | str) -> None:
        """Bring a lost host back: link up, sshd started, answering (link shaping is kept)."""
        target = self.host(host)
        run(["ip", "link", "set", self._names.host_veth(self._names.host_index(target.name)), "up"])
        if not sshd_running(target.name, self._host_dir(target.name)):
            start_sshd(target.name, self._host_dir(target.name))
        wait_for_sshds([target], self._host_dir)
        log(self.name, f"host {target.name} back at {target.address}")

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
            start_sshd(host.name, self._host_dir(host.name))
            wait_for_sshds([host], self._host_dir)
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
        log(self.name, f"host {host.name} added at {host.address}")
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
        log(self.name, f"host {name} removed ({killed} processes killed)")

    def _remove_host_resources(self, host: TestHost) -> int:
        """Kill the host's processes, delete its veth, namespace and directory; how many were killed."""
        stop_delayer(self.name, host.name, self._host_dir(host.name))
        killed = kill_netns_processes(host.name)
        veth = self._names.host_veth(self._names.host_index(host.name))
        # The veth first: deleting it takes its peer out of the namespace at once, whereas a deleted
        # namespace's interfaces go later, in the kernel's own time, and the name could still be taken.
        if veth in link_names():
            run(["ip", "link", "delete", veth])
        if host.name in netns_names():
            run(["ip", "netns", "delete", host.name])
        # Forget the gone host's MAC here and on every other host: a host added later at the same address
        # has another one, and a stale neighbour entry would send its traffic nowhere for half a minute.
        run(["ip", "neigh", "flush", "to", host.address], check=False)
        for other in list(self.hosts):
            run(["ip", "-n", other.name, "neigh", "flush", "to", host.address], check=False)
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
                f"with `python -m testbed down --name {name} --force`"
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
        for pid in delayer_pids(self.name):
            kill_and_wait(pid)
        for netns in netns_names():
            if names.is_ours_netns(netns):
                killed = kill_netns_processes(netns)
                run(["ip", "netns", "delete", netns], check=False)
                log(self.name, f"namespace {netns} removed ({killed} processes killed)")
        for link in link_names():  # the veths went with their namespaces; the bridges are left
            if names.is_ours_link(link):
                run(["ip", "link", "delete", link], check=False)
        if shutil.which("iptables"):
            self._remove_root_rules()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self._is_up = False
        self.hosts = []
        self.outside = None
        self.links = {}
        log(self.name, "down")

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
                    "sshd": ssh_banner(host.address, host.ssh_port, timeout=0.5),
                    "link": asdict(self.links[host.name]) if host.name in self.links else None,
                }
                for host in self.hosts
            ],
            "outside": asdict(self.outside) if self.outside else None,
        }
