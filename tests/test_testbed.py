"""The network-namespace testbed (testing/testbed), tested for real: namespaces, sshd, shaping.

Needs root; skipped otherwise with ensure_prerequisites()'s reason. One testbed of three hosts serves
the whole module; the up/down tests bring up small ones of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
import testbed as tb
import testbed.bed as testbed_bed
from conftest import assert_testbed_gone, host_namespaces, hosts_for_file, running_testbed

pytestmark = pytest.mark.testbed

# Per-process names, so two test runs on one machine never take down each other's testbed.
_RUN_ID = os.getpid() % 100000

# Run inside a host: accept connections on ADDRESS:PORT and read them to the end.
_SINK_SCRIPT = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.close()
"""

# Run inside a host: send MEGABYTES to ADDRESS:PORT and print the seconds it took.
_SEND_SCRIPT = """
import socket, sys, time
address, port, megabytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((address, port), timeout=30)
start = time.perf_counter()
for _ in range(megabytes):
    conn.sendall(b"x" * (1 << 20))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.perf_counter() - start)
"""


@pytest.fixture(scope="module")
def prerequisites() -> None:
    reason = tb.ensure_prerequisites()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Testbed]:
    with running_testbed(f"sst{_RUN_ID}", 3) as testbed:
        yield testbed


def _in_host(
    bed: tb.Testbed,
    host: tb.TestHost | tb.OutsideNamespace | str,
    script: str,
    *args: object,
    timeout: float = 60,
) -> str:
    proc = bed.exec(
        host, [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _start_sink(bed: tb.Testbed, host: tb.TestHost, port: int) -> subprocess.Popen:
    sink = bed.popen(host, [sys.executable, "-c", _SINK_SCRIPT, "0.0.0.0", str(port)])
    deadline = time.monotonic() + 10
    while not isinstance(bed.connect_ms(host, host.address, port), float):
        assert time.monotonic() < deadline, f"sink on {host.name}:{port} never listened"
        time.sleep(0.05)
    return sink


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


# ----- the file's testbed


def test_hosts_are_reachable_from_this_machine_and_from_each_other(bed: tb.Testbed) -> None:
    h0, h1, h2 = bed.hosts
    assert [h.address for h in bed.hosts] == [f"{bed.gateway.rsplit('.', 1)[0]}.{10 + i}" for i in range(3)]
    for host in bed.hosts:
        with socket.create_connection((host.address, host.ssh_port), timeout=5) as conn:
            assert conn.recv(4) == b"SSH-"
    assert isinstance(bed.connect_ms(h0, h1.address, 22), float)
    assert isinstance(bed.connect_ms(h2, h0.address, 22), float)


def test_ssh_login_runs_commands_in_the_hosts_namespace(bed: tb.Testbed) -> None:
    host = bed.hosts[1]
    client = paramiko.SSHClient()
    client.load_host_keys(bed.known_hosts_path)  # and reject any other key: the file must be right
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        host.address,
        port=host.ssh_port,
        username=host.user,
        key_filename=host.key_path,
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    try:
        _, stdout, _ = client.exec_command("hostname -I; stat -L -c %i /proc/self/ns/net", timeout=10)
        addresses, netns_inode = stdout.read().decode().split("\n")[:2]
    finally:
        client.close()
    assert addresses.split() == [host.address]
    assert int(netns_inode) == os.stat(f"/run/netns/{host.name}").st_ino


def test_processes_are_the_hosts_own(bed: tb.Testbed) -> None:
    h0, h1, h2 = bed.hosts
    sleeper = bed.popen(h1, ["sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while sleeper.pid not in bed.processes(h1):
            assert time.monotonic() < deadline, f"sleep {sleeper.pid} never showed up in {h1.name}"
            time.sleep(0.02)
        assert sleeper.pid not in bed.processes(h0)
        assert sleeper.pid not in bed.processes(h2)
        assert os.getpid() not in bed.processes(h1)
    finally:
        _stop(sleeper)
    assert sleeper.pid not in bed.processes(h1)


def test_delay_raises_the_round_trip_by_twice_the_one_way_delay(bed: tb.Testbed) -> None:
    h0, h1, _ = bed.hosts
    before = bed.connect_ms(h0, h1.address, 22, count=5)
    bed.set_link(h1, delay_ms=20)
    try:
        shaped = bed.connect_ms(h0, h1.address, 22, count=5)
    finally:
        bed.clear_link(h1)
    assert isinstance(before, float) and isinstance(shaped, float), (before, shaped)
    # A TCP connect is one round trip; a host with one-way delay d is 2*d away from an unshaped one.
    assert shaped - before >= 0.9 * 2 * 20, (before, shaped)


def test_rate_limit_slows_a_bulk_transfer(bed: tb.Testbed) -> None:
    h0, h1, _ = bed.hosts
    port = 5301
    sink = _start_sink(bed, h1, port)
    try:
        bed.set_link(h1, rate_mbit=20)
        seconds = float(_in_host(bed, h0, _SEND_SCRIPT, h1.address, port, 2))
    finally:
        bed.clear_link(h1)
        _stop(sink)
    assert seconds >= 0.8 * (2 * 8 / 20), seconds  # 2 MB at 20 Mbit/s takes 0.8 s


def test_profiles_shape_and_clear(bed: tb.Testbed) -> None:
    host = bed.hosts[2]
    with pytest.raises(ValueError, match="unknown profile"):
        bed.set_profile(host, "moon")
    bed.set_profile(host, "cross-region")
    try:
        assert bed.links[host.name] == tb.LinkShape(**tb.PROFILES["cross-region"])
        assert tb.Testbed.existing(bed.name).links == bed.links
        assert isinstance(bed.connect_ms(bed.hosts[0], host.address, 22), float)
    finally:
        bed.clear_link(host)
    assert host.name not in bed.links


def test_a_killed_host_is_gone_and_can_be_revived(bed: tb.Testbed) -> None:
    h0, _, h2 = bed.hosts
    sleeper = bed.popen(h2, ["sleep", "60"])
    try:
        bed.kill_host(h2)
        assert bed.processes(h2) == []
        assert sleeper.wait(timeout=5) == -9
        assert bed.connect_ms(h0, h2.address, 22, timeout=1.0) == "timeout"
    finally:
        bed.revive_host(h2)
    assert isinstance(bed.connect_ms(h0, h2.address, 22), float)


def test_outside_namespace_cannot_reach_a_host_port(bed: tb.Testbed) -> None:
    h0, h1, _ = bed.hosts
    outside = bed.add_outside_namespace()
    port = 5302
    sink = _start_sink(bed, h1, port)
    try:
        with socket.create_server((bed.gateway, 0)) as on_this_machine:
            gateway_port = on_this_machine.getsockname()[1]
            # The outside is routed through this machine: the gateway, a local address, answers...
            assert isinstance(bed.connect_ms(outside, bed.gateway, gateway_port), float)
        # ...another host reaches the port, and the outside does not even get a refusal from it.
        assert isinstance(bed.connect_ms(h0, h1.address, port), float)
        assert bed.connect_ms(outside, h1.address, port, timeout=1.0) in ("timeout", "OSError")
    finally:
        _stop(sink)


# ----- up and down


def test_down_leaves_nothing_behind(prerequisites: None) -> None:
    testbed = tb.Testbed(f"ssd{_RUN_ID}", 2)
    try:
        testbed.up()
        testbed.set_link(testbed.hosts[0], delay_ms=1, loss_pct=0.1)  # starts a delayer with netem missing
        testbed.add_outside_namespace()
        assert tb.Testbed.existing(testbed.name).hosts == testbed.hosts
    finally:
        testbed.down()
    assert_testbed_gone(testbed.name, testbed.state_dir)


def test_a_second_up_of_the_same_name_fails_without_harming_the_first(prerequisites: None) -> None:
    first = tb.Testbed(f"ssx{_RUN_ID}", 1)
    try:
        first.up()
        with pytest.raises(tb.TestbedError, match="already exists"):
            tb.Testbed(first.name, 1).up()
        assert first.up() == first.hosts  # ours: up() again is a no-op
        host = first.hosts[0]
        with socket.create_connection((host.address, host.ssh_port), timeout=5) as conn:
            assert conn.recv(4) == b"SSH-"
    finally:
        first.down()


def test_force_down_cleans_a_testbed_whose_state_is_lost(prerequisites: None) -> None:
    testbed = tb.Testbed(f"ssf{_RUN_ID}", 1)
    try:
        testbed.up()
        shutil.rmtree(testbed.state_dir)
        with pytest.raises(tb.TestbedError, match="--force"):
            tb.Testbed.existing(testbed.name)
        cli = [sys.executable, "-m", "testbed", "down", "--name", testbed.name, "--force"]
        subprocess.run(cli, check=True, capture_output=True, timeout=60)
        assert_testbed_gone(testbed.name, testbed.state_dir)
    finally:
        testbed.down()


def test_a_failed_up_removes_what_it_created(prerequisites: None, monkeypatch: pytest.MonkeyPatch) -> None:
    testbed = tb.Testbed(f"ssp{_RUN_ID}", 2)

    def fail_after_the_first_sshd(netns: str, host_dir: Path, original=testbed_bed.start_sshd) -> None:
        if netns.endswith("-h1"):
            raise tb.TestbedError("simulated failure")
        original(netns, host_dir)

    monkeypatch.setattr(testbed_bed, "start_sshd", fail_after_the_first_sshd)
    with pytest.raises(tb.TestbedError, match="simulated failure"):
        testbed.up()
    assert_testbed_gone(testbed.name, testbed.state_dir)


# ----- hosts added and removed while up


def _ssh_login(host: tb.TestHost, key_path: str, known_hosts: str) -> str:
    """Log in with key_path (checking the host key against known_hosts); what `hostname -I` prints."""
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        host.address,
        port=host.ssh_port,
        username=host.user,
        key_filename=key_path,
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    try:
        _, stdout, _ = client.exec_command("hostname -I", timeout=10)
        return stdout.read().decode().strip()
    finally:
        client.close()


def test_hosts_can_be_added_and_removed_while_up(prerequisites: None, tmp_path: Path) -> None:
    own_key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(own_key)], check=True)
    testbed = tb.Testbed(f"ssa{_RUN_ID}", 2)
    try:
        h0, h1 = testbed.up()
        sleeper = testbed.popen(h0, ["sleep", "60"])
        testbed.remove_host(h0)
        assert sleeper.wait(timeout=5) == -9
        assert testbed.hosts == [h1]
        assert h0.name not in tb.netns_names() and h1.name in tb.netns_names()
        links = tb.link_names()
        assert f"ssv-{testbed.name}-0" not in links and f"ssv-{testbed.name}-1" in links
        assert not (testbed.state_dir / "hosts" / h0.name).exists()
        assert h0.address not in Path(testbed.known_hosts_path).read_text()
        testbed.remove_host(h0)  # already removed: a no-op
        testbed.remove_host(h0.name)

        # The lowest free index comes back, with the keys given and not the testbed's.
        added = testbed.add_host(authorized_keys=(tmp_path / "id_ed25519.pub").read_text())
        assert (added.name, added.address, added.key_path) == (h0.name, h0.address, "")
        assert _ssh_login(added, str(own_key), testbed.known_hosts_path) == added.address
        with pytest.raises(paramiko.AuthenticationException):
            _ssh_login(added, testbed.key_path, testbed.known_hosts_path)
        assert _ssh_login(h1, testbed.key_path, testbed.known_hosts_path) == h1.address
        third = testbed.add_host()
        assert third.name == f"{testbed.name}-h2"
        assert _ssh_login(third, testbed.key_path, testbed.known_hosts_path) == third.address
        assert testbed.hosts == [h1, added, third]
        assert tb.Testbed.existing(testbed.name).hosts == testbed.hosts  # non-contiguous, own keys
        assert testbed.host_count == 3
    finally:
        testbed.down()
    assert_testbed_gone(testbed.name, testbed.state_dir)


def test_existing_reads_a_state_without_host_records(bed: tb.Testbed) -> None:
    """A state file written before hosts could be added has only the host count."""
    state_path = bed.state_dir / "state.json"
    saved = state_path.read_text()
    state = json.loads(saved)
    del state["host_records"]
    try:
        state_path.write_text(json.dumps(state))
        assert tb.Testbed.existing(bed.name).hosts == bed.hosts
    finally:
        state_path.write_text(saved)


def test_a_files_hosts_are_the_session_testbeds_only_ones_and_go_with_the_file(
    session_testbed: tb.Testbed, bed: tb.Testbed
) -> None:
    """What the files sharing the session's testbed rely on (conftest.hosts_for_file)."""
    with pytest.raises(tb.TestbedError, match="still has hosts"), hosts_for_file(bed, 1):
        pass
    assert len(bed.hosts) == 3  # refused before touching them
    with hosts_for_file(session_testbed, 2) as shared:
        assert shared is session_testbed
        first, second = shared.hosts
        assert (first.name, second.name) == (f"{shared.name}-h0", f"{shared.name}-h1")
        shared.set_profile(second, "cross-region")
        vm = shared.add_host()  # as a fake cloud's instance becomes a host
        sleeper = shared.popen(vm, ["sleep", "60"])
    assert session_testbed.hosts == [] and session_testbed.links == {}
    assert sleeper.wait(timeout=5) == -9
    assert not host_namespaces(session_testbed)
