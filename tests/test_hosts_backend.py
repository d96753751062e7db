"""The ``hosts`` cluster backend on the network-namespace testbed: real sshd per host, real SSH
(paramiko), one fork server per host, TF nodes talking over the hosts' addresses, checkpoints in a
GCS emulator that the hosts reach over the testbed's network (the only thing they share).

Five hosts: h0 chief (the launcher, the ASP coordinator, BSP worker 0), h1-h3 workers, h4 the
parameter server, so "101" on 1 PS + 3 workers puts every node on its own host. Needs root (the
testbed); skipped otherwise with ensure_prerequisites()'s reason.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import syncswitch
import testbed as tb
from airflow_runs import (
    DuringRun,
    checkpoint_step,
    first_event,
    job_checkpoint_step,
    segment_starts,
    wait_until_segment_ended,
)
from conftest import (
    GcsEmulator,
    hosts_for_file,
    new_bucket,
    offline_uv_env,
    ssh_connection,
    storage_on_gateway,
)
from proc_utils import wait_for
from syncswitch import forkserver, nodelogs, peers, storage
from syncswitch.errors import SpecError
from syncswitch.events import read_events
from syncswitch.hosts import DEFAULT_WORK_ROOT, HostSpec
from syncswitch.layout import RunLayout
from syncswitch.requirements import locked_versions
from syncswitch.spec import JobSpec
from syncswitch.state import create_run, read_state, record_cluster
from syncswitch_airflow import settings
from syncswitch_airflow.backends import ClusterError
from syncswitch_airflow.backends.base import UNKNOWN
from syncswitch_airflow.backends.hosts import HostsBackend, host_record
from syncswitch_airflow.backends.node_runtime import MARKER, RuntimeBundle
from syncswitch_airflow.backends.user_requirements import node_requirements
from syncswitch_airflow.hooks.ssh import SshSession
from syncswitch_airflow.triggers.segment import SegmentTrigger, launch_entry

pytestmark = [pytest.mark.testbed, pytest.mark.cluster]

_RUN_ID = os.getpid() % 10000
ROLES = ("chief", "worker", "worker", "worker", "ps")


@pytest.fixture(scope="module")
def bed(session_testbed: tb.Testbed) -> Iterator[tb.Testbed]:
    with hosts_for_file(session_testbed, len(ROLES)) as testbed:
        yield testbed


@pytest.fixture(scope="module")
def cluster_env(bed: tb.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """The module's storage on the testbed's gateway, and the testbed's known_hosts for host-key checks."""
    root = tmp_path_factory.mktemp("hosts-gcs")
    # known_hosts as Airflow's config section (AIRFLOW__SYNCSWITCH__SSH_KNOWN_HOSTS).
    known_hosts = settings.setting("ssh_known_hosts").airflow_env
    with storage_on_gateway(bed.gateway, root, {known_hosts: bed.known_hosts_path}) as server:
        yield server


@pytest.fixture
def bucket(cluster_env: GcsEmulator) -> str:
    return f"{new_bucket('hosts')}/runs"


def host_params(bed: tb.Testbed, key: str | None = None) -> list[str]:
    return [
        f"address={h.address},key={key or bed.key_path},role={role},name={h.name}"
        for h, role in zip(bed.hosts, ROLES, strict=True)
    ]


def job(bed: tb.Testbed, bucket: str, **params: Any) -> JobSpec:
    base = {
        "job_name": "hosts",
        "cluster_backend": "hosts",
        "bucket_dir": bucket,
        "hosts": host_params(bed),
        "num_workers": 3,
        "num_ps": 1,
    }
    return JobSpec.from_params({**base, **params})


def host_processes(bed: tb.Testbed, host: tb.TestHost) -> dict[int, str]:
    """The host's processes other than its sshd (and SSH sessions still closing), with command lines."""
    found = {}
    for pid in bed.processes(host):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if cmdline and not cmdline.startswith(("sshd", "/usr/sbin/sshd")):
            found[pid] = cmdline
    return found


def assert_hosts_clean(bed: tb.Testbed) -> None:
    """Every host's process table holds only its sshd again, and no work folder is left."""
    for host in bed.hosts:
        left: dict[int, str] = {}

        def clean(host: tb.TestHost = host, left: dict[int, str] = left) -> bool:
            left.clear()
            left.update(host_processes(bed, host))
            return not left

        try:
            wait_for(clean, timeout=30, what=f"{host.name}'s processes gone", poll=0.5)
        except AssertionError:
            raise AssertionError(f"{host.name}'s processes still there after 30 s: {left}") from None
    # This testbed's only (folders are <job>@<host>): another test file's testbed may be running.
    names = {host.name for host in bed.hosts}
    left = [p for p in Path(DEFAULT_WORK_ROOT).glob("hosts-*") if p.name.rpartition("@")[2] in names]
    assert not left, f"a host work folder is left: {left}"


# ---- input ----------------------------------------------------------------------------------------


HOSTS = {"cluster_backend": "hosts", "bucket_dir": "gs://b/runs"}
ED25519 = "AAAAC3NzaC1lZDI1NTE5AAAAIMoBxK/04BgEQThTPTqtXPs40iOzD1m8kbJOSUMsnIX9"  # any ed25519 public key


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"hosts": ["address=10.0.0.2,key=/k"]}, "hosts", "only for cluster_backend 'hosts'"),
        ({**HOSTS}, "hosts", "needs at least one host"),
        ({**HOSTS, "bucket_dir": "runs", "hosts": ["address=10.0.0.2,key=/k"]}, "bucket_dir", "gs://"),
        ({**HOSTS, "hosts": ["address=10.0.0.2"]}, "hosts", "needs 'key', or 'conn'"),
        ({**HOSTS, "hosts": ["role=chief"]}, "hosts", "needs 'address', or 'conn'"),
        ({**HOSTS, "hosts": ["conn=my ssh"]}, "hosts", "is not a connection id"),
        ({**HOSTS, "hosts": ["conn=my_ssh,key=/k"]}, "hosts", "key or conn"),
        ({**HOSTS, "hosts": ["address=10.0.0.2 ;rm,key=/k"]}, "hosts", "not an IP address or host name"),
        ({**HOSTS, "hosts": ["address=10.0.0.2,key=/k,role=boss"]}, "hosts", "any, chief, worker, ps"),
        ({**HOSTS, "hosts": ["address=10.0.0.2,key=/k,port=0"]}, "hosts", "1..65535"),
        ({**HOSTS, "hosts": ["address=10.0.0.2,key=relative"]}, "hosts", "absolute path"),
        ({**HOSTS, "hosts": ["address=10.0.0.2,key=/k,colour=red"]}, "hosts", "unknown key 'colour'"),
        ({**HOSTS, "hosts": ["address=10.0.0.2,key=/k,host_key=ssh-ed25519"]}, "hosts", "'TYPE BASE64'"),
        # A valid key under another type's name (the blob names its own type).
        ({**HOSTS, "hosts": [f"address=10.0.0.2,key=/k,host_key=ssh-rsa {ED25519}"]}, "hosts", "ssh-rsa"),
        ({**HOSTS, "hosts": [f"conn=my_ssh,host_key=ssh-ed25519 {ED25519}"]}, "hosts", "host_key or conn"),
        (
            {**HOSTS, "hosts": ["address=10.0.0.2,key=/k", "address=10.0.0.2,key=/j"]},
            "hosts",
            "is also host 0",
        ),
        ({"hosts_per_cluster": 2}, "hosts_per_cluster", "only for cluster_backend 'hosts'"),
        (
            {**HOSTS, "hosts": ["address=10.0.0.2,key=/k"], "hosts_per_cluster": 2},
            "hosts_per_cluster",
            "2 of 1 host(s): at most the number of hosts listed",
        ),
        (
            {**HOSTS, "hosts": ["address=10.0.0.2,key=/k"], "hosts_per_cluster": -1},
            "hosts_per_cluster",
            ">= 0",
        ),
    ],
)
def test_bad_host_specs_are_rejected_naming_the_field(params: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec.from_params(params)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_pinned_host_key_travels_with_the_host_spec() -> None:
    [host] = JobSpec.from_params(
        {**HOSTS, "hosts": [f"address=10.0.0.2,key=/k,host_key=ssh-ed25519 {ED25519}"]}
    ).hosts
    assert host.host_key == f"ssh-ed25519 {ED25519}"
    assert HostSpec.parse(host.to_text(), 0) == host
    # A .pub file's line, its comment included, is taken as it is.
    pub_line = f"address=10.0.0.2,key=/k,host_key=ssh-ed25519 {ED25519} root@h1"
    assert HostSpec.parse(pub_line, 0) == host
    assert host_record(host, "/w")["host_key"] == host.host_key


# ---- provisioning ---------------------------------------------------------------------------------


def test_an_unreachable_host_or_a_refused_login_fails_provisioning_naming_the_host(
    bed: tb.Testbed, bucket: str, work_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="syncswitch_airflow.backends.hosts")
    backend = HostsBackend()
    layout = RunLayout.for_run(bucket, "hosts", "provision-failures")
    good = host_params(bed)[:2]

    # A host that does not answer (an address of the cluster subnet with nothing behind it).
    absent = f"address={bed.subnet.rsplit('.', 1)[0]}.99,key={bed.key_path},name=ghost"
    with pytest.raises(ClusterError, match=r"host ghost \(root@10\.77\.\d+\.99:22\): unreachable"):
        backend.provision(job(bed, bucket, hosts=[*good, absent], num_workers=1), layout)

    # A key the hosts do not accept.
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    refused = [f"{h},name=x{i}".replace(bed.key_path, str(stranger)) for i, h in enumerate(good[:1])]
    with pytest.raises(ClusterError, match=r"SSH login failed"):
        backend.provision(job(bed, bucket, hosts=[*refused, good[1]], num_workers=1), layout)

    # A host that shows another host key than the one pinned with it (host 2's).
    pinned = [f"{good[0]},host_key={bed.host_key(bed.hosts[2])}", good[1]]
    with pytest.raises(ClusterError, match=r"host .*-h0 .*its host key is not the one pinned with the run"):
        backend.provision(job(bed, bucket, hosts=pinned, num_workers=1), layout)

    # A key file that is not there: named, and nothing was started on the good host.
    missing = good[0].replace(bed.key_path, str(tmp_path / "nope"))
    with pytest.raises(ClusterError, match=r"SSH key file .*/nope does not exist"):
        backend.provision(job(bed, bucket, hosts=[missing, good[1]], num_workers=1), layout)

    # An interpreter without the lock's versions: the runtime's code, none of its dependencies.
    bare = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    site = bare / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "syncswitch.pth").write_text(str(Path(syncswitch.__file__).parents[1]) + "\n")
    unpinned = f"{good[0]},python={bare}/bin/python"
    differ = r"(?s)version check failed.*tensorflow-cpu: missing.*versions differ"
    with pytest.raises(ClusterError, match=differ):
        backend.provision(job(bed, bucket, hosts=[unpinned, good[1]], num_workers=1), layout)

    # Every host was checked before any fork server started: the good hosts imported nothing.
    assert not [r for r in caplog.records if "fork server starting" in r.getMessage()]
    # Failed provisioning left nothing behind and gave its cluster slot back.
    assert_hosts_clean(bed)
    assert backend.capacity().holders() == []


def test_hosts_named_by_ssh_connections_log_in_with_the_connections_key_and_host_key(
    bed: tb.Testbed, bucket: str, work_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``conn=<ssh_conn_id>``: the SSH provider's hook gives the address, user, key and host-key policy;
    the handle (in state.json) names the connection, never the key. A connection that is missing, or
    whose pinned host key is another machine's, fails provisioning naming the host and connection."""
    backend = HostsBackend()
    layout = RunLayout.for_run(bucket, "hosts", "ssh-connections")
    for i, host in enumerate(bed.hosts[:2]):
        monkeypatch.setenv(f"AIRFLOW_CONN_TESTBED_{i}", ssh_connection(bed, host))
    hosts = ["conn=testbed_0,role=chief,name=by-conn-0", "conn=testbed_1,role=ps,name=by-conn-1"]

    with pytest.raises(ClusterError, match=r"host 1: SSH connection 'absent'.*isn't defined"):
        backend.provision(job(bed, bucket, hosts=[hosts[0], "conn=absent"], num_workers=1), layout)
    other_host_key = ssh_connection(bed, bed.hosts[2])
    monkeypatch.setenv(
        "AIRFLOW_CONN_IMPOSTOR", other_host_key.replace(bed.hosts[2].address, bed.hosts[1].address)
    )
    with pytest.raises(ClusterError, match=r"host by-conn-1 .*connection impostor"):
        backend.provision(
            job(bed, bucket, hosts=[hosts[0], "conn=impostor,name=by-conn-1"], num_workers=1), layout
        )
    assert_hosts_clean(bed)

    handle = backend.provision(job(bed, bucket, hosts=hosts, num_workers=1), layout)
    try:
        records = {h["name"]: h for h in handle["hosts"]}
        assert {n: (h["address"], h["user"], h["port"], h["conn"], h["key"]) for n, h in records.items()} == {
            "by-conn-0": (bed.hosts[0].address, "root", 22, "testbed_0", ""),
            "by-conn-1": (bed.hosts[1].address, "root", 22, "testbed_1", ""),
        }
        assert all(h["forkserver"] for h in handle["hosts"])  # logged in, fork servers up
        assert "PRIVATE KEY" not in json.dumps(handle)
        # The ledger holds the connections' addresses: no other cluster may take these hosts.
        lease = storage.read_json(backend.capacity().ledger)["leases"]["ssh-connections"]
        assert lease["hosts"] == [bed.hosts[0].address, bed.hosts[1].address]
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)
    assert backend.capacity().holders() == []


# Run as a separate process by the test below: provisioning as an Airflow worker's task runs it.
_PROVISION = """
import json, sys
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch_airflow.backends.hosts import HostsBackend
HostsBackend().provision(JobSpec.from_params(json.loads(sys.argv[1])), RunLayout(sys.argv[2]))
"""


def test_provisioning_killed_midway_is_taken_over_by_its_retry_and_leaves_nothing(
    bed: tb.Testbed, bucket: str, work_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Celery worker lost while it provisions: the task's retry (on another worker; here another
    process) provisions the same run again. The ledger gives it the hosts the lost one had claimed;
    fork servers that are up are reused (same processes), and one that the lost task had started but
    that does not listen yet (held stopped here until the retry has looked) is waited for, not
    started twice; teardown leaves nothing."""
    layout = RunLayout.for_run(bucket, "hosts", "killed-provisioning")
    params = {
        "job_name": "hosts",
        "cluster_backend": "hosts",
        "bucket_dir": bucket,
        "hosts": host_params(bed),
    }
    params.update(num_workers=3, num_ps=1)
    slow = bed.hosts[-1]
    slow_server = Path(DEFAULT_WORK_ROOT) / f"hosts-killed-provisioning@{slow.name}" / "forkserver"
    lost = subprocess.Popen([sys.executable, "-c", _PROVISION, json.dumps(params), layout.root])
    # Its content, not only the file: the shell's redirection makes it empty before `echo` fills it,
    # and the lost task killed in between leaves it so (the retry then starts a server of its own).
    started = slow_server / "starting.pid"
    wait_for(
        lambda: started.is_file() and started.read_text().strip(), timeout=120, what="the last host's start"
    )
    lost.kill()
    lost.wait()
    starting = int((slow_server / "starting.pid").read_text())
    os.kill(starting, signal.SIGSTOP)  # still importing TensorFlow when the retry comes
    assert not (slow_server / "forkserver.json").exists()
    backend = HostsBackend()
    assert backend.capacity().holders() == ["killed-provisioning"]  # the lost task's claim stands

    retried: dict[str, Any] = {}

    def retry_provisioning() -> None:
        try:
            retried["handle"] = backend.provision(job(bed, bucket), layout)
        except BaseException as exc:  # shown by the assertion below
            retried["error"] = exc

    retry = threading.Thread(target=retry_provisioning)
    retry.start()
    time.sleep(8.0)  # the retry has logged in to every host and found the stopped one starting
    os.kill(starting, signal.SIGCONT)
    retry.join(timeout=300)
    assert "handle" in retried, f"the retry did not provision: {retried.get('error', 'still running')}"
    handle = retried["handle"]
    try:
        assert [h["address"] for h in handle["hosts"]] == [h.address for h in bed.hosts]
        assert all(h["forkserver"] for h in handle["hosts"])
        assert json.loads((slow_server / "forkserver.json").read_text())["pid"] == starting
        # A start that the lost task sent and that runs on its host only now (a command in flight)
        # finds the server there and starts none: the look and the start are one step under the
        # folder's lock on the host.
        late = handle["hosts"][1]
        caplog.set_level(logging.INFO, logger="syncswitch_airflow.backends.hosts")
        with SshSession(late) as ssh:
            HostsBackend._launch_server(ssh, handle, late, f"{late['work_dir']}/forkserver")
        assert f"a fork server started by an earlier try runs on {late['name']}" in caplog.text
        for host in bed.hosts:
            servers = [c for c in host_processes(bed, host).values() if "syncswitch.forkserver" in c]
            assert len(servers) == 1, f"{host.name}: {servers}"
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)
    assert backend.capacity().holders() == []


# Holds an abstract Unix socket name (argv[1], without its leading NUL) until killed.
_HOLD_SOCKET = (
    "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind('\\0' + sys.argv[1]); "
    "print('bound', flush=True); time.sleep(600)"
)


def test_a_fork_server_that_dies_as_it_starts_fails_provisioning_at_once_with_its_log(
    bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """Provisioning names the host and the server's own log as soon as the server has died, instead of
    waiting FORKSERVER_READY_S for it to listen; nothing is left on the hosts, the slot is free."""
    run = "dead-server"
    host = bed.hosts[-1]
    server_dir = Path(DEFAULT_WORK_ROOT) / f"hosts-{run}@{host.name}" / "forkserver"
    # Its socket's name taken in the host's namespace: the server finds it held and exits at once.
    holder = bed.popen(
        host,
        [sys.executable, "-c", _HOLD_SOCKET, forkserver.address_for(str(server_dir))[1:]],
        stdout=subprocess.PIPE,
        text=True,
    )
    backend = HostsBackend()
    one_host = job(
        bed, bucket, hosts=[f"address={host.address},key={bed.key_path},name={host.name}"], num_workers=1
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "bound"
        with pytest.raises(ClusterError) as failed:
            backend.provision(one_host, RunLayout.for_run(bucket, "hosts", run))
    finally:
        holder.kill()
        holder.wait()
    message = str(failed.value)
    assert host.name in message and "exited before it listened" in message, message
    assert "runs or starts already; not serving" in message, message  # the server's log tail
    assert_hosts_clean(bed)
    assert backend.capacity().holders() == []


def test_hosts_runtime_install_puts_the_locks_versions_on_the_hosts_once_per_version(
    bed: tb.Testbed,
    bucket: str,
    work_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``[syncswitch] hosts_runtime = install``: provisioning installs the runtime (this package and the
    lock's pins) into a venv named by its content on each host, from the host's own ``python3``; two
    hosts on one filesystem (the testbed's) take turns on it and install it once; the fork servers run
    it; teardown leaves it for the next run, which installs nothing. The testbed's hosts have no route
    to a registry: uv installs from this machine's cache (which the test command's ``uv sync`` filled),
    offline, through ``hosts_env``."""
    hosts_env = ";".join(f"{name}={value}" for name, value in offline_uv_env(tmp_path).items())
    monkeypatch.setenv("SYNCSWITCH_HOSTS_ENV", hosts_env)
    root = tmp_path / "hosts-root"
    hosts = [f"{h},work_root={root}" for h in host_params(bed)[:2]]
    backend = HostsBackend()

    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "sometimes")
    with pytest.raises(
        ValueError, match=r"hosts_runtime .* must be one of installed, install, got 'sometimes'"
    ):
        backend.provision(
            job(bed, bucket, hosts=hosts, num_workers=1), RunLayout.for_run(bucket, "hosts", "r0")
        )
    assert backend.capacity().holders() == []

    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "install")
    # A host whose interpreter is not there: named, and the run's folders gone from both hosts.
    absent = [f"{h},work_root={tmp_path}/other-root" for h in host_params(bed)[:2]]
    absent[1] += ",python=/nonexistent/python3"
    with pytest.raises(ClusterError, match=r"h1 .*installing the runtime failed.*/nonexistent/python3"):
        backend.provision(
            job(bed, bucket, hosts=absent, num_workers=1), RunLayout.for_run(bucket, "hosts", "r0")
        )
    assert not list((tmp_path / "other-root").glob("hosts-*")), "a run's work folder is left"

    venv = root / "runtime" / RuntimeBundle.current().id
    caplog.set_level(logging.INFO, logger="syncswitch_airflow.backends.hosts")
    handle = backend.provision(
        job(bed, bucket, hosts=hosts, num_workers=1), RunLayout.for_run(bucket, "hosts", "r1")
    )
    try:
        assert {h["python"] for h in handle["hosts"]} == {str(venv / "bin" / "python")}
        installs = [
            m for r in caplog.records if "r1: runtime" in (m := r.getMessage()) and "installed on" in m
        ]
        assert len(installs) == 1, installs  # the second host waited on the lock and found it made
        assert "with uv in" in installs[0]
        for host in bed.hosts[:2]:  # each host's fork server runs the venv's interpreter
            assert any(str(venv) in line for line in host_processes(bed, host).values())
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)
    assert not list(root.glob("hosts-*")), "a run's work folder is left"

    # The venv: the lock's versions, and this runtime's files (a copy, not the checkout's).
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "syncswitch.requirements", "--check"], check=True)
    probe = (
        "import syncswitch, importlib.metadata as m; "
        "print(syncswitch.__file__, m.version('tensorflow-cpu'), m.version('syncswitch'))"
    )
    where, version, runtime_version = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert where.startswith(str(venv))
    assert version == {name: pin for name, pin, _ in locked_versions()}["tensorflow-cpu"]
    # The runtime as a distribution (installed from its wheel), with its console script.
    assert runtime_version == importlib.metadata.version("syncswitch")
    assert (venv / "bin" / "syncswitch").is_file()

    # The next run finds it: nothing installed, the venv untouched.
    marker = venv / MARKER
    made = marker.stat().st_mtime_ns
    caplog.clear()
    handle = backend.provision(
        job(bed, bucket, hosts=hosts, num_workers=1), RunLayout.for_run(bucket, "hosts", "r2")
    )
    backend.teardown(handle)
    assert not [r for r in caplog.records if "installing the runtime" in r.getMessage()]
    assert marker.stat().st_mtime_ns == made
    assert_hosts_clean(bed)


# ---- end to end through the DAG -------------------------------------------------------------------


def test_101_on_five_hosts_through_the_dag_survives_a_lost_host_in_asp_and_in_bsp(  # noqa: ANN001
    dag, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """ "101" through the DAG (dag.test), each node on its own host, each segment resuming from the
    previous one's checkpoint in the bucket. Worker 1's host is lost just past ASP's checkpoint at
    ~1000 (of 30..3030): the segment finishes with the survivors. It is back by the last BSP
    segment, whose worker 2's host is lost past its checkpoint at 3050 (of 3030..3630): that attempt
    fails cleanly, the host comes back while the task waits for its retry, and Airflow's retry
    resumes from the last checkpoint and ends exactly on target. The launcher names each lost node
    (node_lost events, kept for both attempts on gs://)."""
    conf = {
        "job_name": "hosts",
        "cluster_backend": "hosts",
        "hosts": host_params(bed),
        "bucket_dir": bucket,
        "switch_order": "101",
        # The ASP segment is long enough (~1 min on an idle machine) for the launcher to see the lost
        # host's lease time out (~17 s) before the segment ends.
        # The last BSP runs 550 steps past the checkpoint its host is lost at: room for the loss.
        "train_steps": [30, 3000, 600],
        "ckpt_frequency": [30, 1000, 50],
        "stall_seconds": 180,
        "num_workers": 3,
        "num_ps": 1,
    }
    job_root = f"{bucket}/hosts"
    since = datetime.datetime.now(datetime.UTC)

    def lose_hosts(run: DuringRun) -> None:
        run.wait(lambda: job_checkpoint_step(job_root) >= 1000, "ASP's checkpoint at ~1000")
        # While it trains: the nodes' ports answer inside the cluster network and not from outside it.
        check_ports_are_closed_from_outside(bed)
        bed.kill_host(bed.hosts[2])  # ASP worker 1
        run.wait(lambda: job_checkpoint_step(job_root) >= 2000, "ASP's checkpoint at ~2000")
        bed.revive_host(bed.hosts[2])
        run.wait(lambda: job_checkpoint_step(job_root) >= 3050, "BSP's checkpoint at 3050")
        bed.kill_host(bed.hosts[3])  # BSP worker 2
        run.wait(lambda: task_state("segment_2.bsp", since) == "up_for_retry", "the BSP task's retry")
        bed.revive_host(bed.hosts[3])

    losses = DuringRun(lose_hosts).start()
    try:
        dag_run = dag.test(run_conf=conf)
        losses.stop()
    finally:
        for host in bed.hosts:
            if not host_is_up(bed, host):
                bed.revive_host(host)

    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket, "hosts", dag_run.run_id)
    state = read_state(layout)
    assert [e["protocol"] for e in state["plan"]] == ["bsp", "asp", "bsp"]
    assert [state["segments"][str(i)]["end_step"] for i in range(3)] == [30, 3030, 3630]
    assert state["segments"]["1"]["start_step"] == 30  # from segment 0's checkpoint in the bucket
    assert state["segments"]["2"]["start_step"] >= 3050  # the retry resumed from a checkpoint
    assert segment_starts(layout) == {0: 1, 1: 1, 2: 2}, "ASP went on; the last BSP ran twice"
    lost = {
        (e["segment"], e["node"], e["host"], e["outcome"])
        for e in read_events(layout.metrics, event="node_lost")
    }
    assert (1, "worker-1", bed.hosts[2].name, "ASP continues with the survivors") in lost, lost
    assert any(
        segment == 2 and node == "worker-2" and host == bed.hosts[3].name for segment, node, host, _ in lost
    ), lost
    # Every node ran on its own host: the cluster the chief saw, by address.
    cluster = state["cluster"]
    assert cluster["backend"] == "hosts" and {h["address"] for h in cluster["hosts"]} == {
        h.address for h in bed.hosts
    }
    assert_hosts_clean(bed)
    assert_no_secret(bed, layout, dag_run)


def test_ssp_local_sgd_and_compressed_bsp_train_on_the_hosts_through_the_dag(  # noqa: ANN001
    dag, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """BSP, then SSP, local SGD and top-k BSP through the DAG (dag.test), each node on its own host:
    each slot's task of the entry's protocol runs and the others skip, every handoff through the bucket
    is exact, SSP's clocks (on the ps host) keep the workers within its bound, local SGD averages on
    its period, and top-k sends its share."""
    conf = {
        "job_name": "hosts-protocols",
        "cluster_backend": "hosts",
        "hosts": host_params(bed),
        "bucket_dir": bucket,
        "switch_order": "1,ssp:2,local:3,topk:0.1",
        "train_steps": [10, 20, 9, 10],
        "ckpt_frequency": [0],
        "max_online_switches": 0,
        "evaluate_segments": False,
        "num_workers": 3,
        "num_ps": 1,
    }
    since = datetime.datetime.now(datetime.UTC)
    dag_run = dag.test(run_conf=conf)

    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket, "hosts-protocols", dag_run.run_id)
    state = read_state(layout)
    protocols = ["bsp", "ssp", "local", "cbsp"]
    assert [e["protocol"] for e in state["plan"]] == protocols
    assert [state["segments"][str(i)]["end_step"] for i in range(4)] == [10, 30, 39, 49]
    for slot, protocol in enumerate(protocols):
        assert task_state(f"segment_{slot}.{protocol}", since) == "success"
        assert task_state(f"segment_{slot}.asp", since) == "skipped"
    for index, protocol in enumerate(protocols[1:], start=1):
        (start,) = read_events(layout.segment_metrics(index, protocol), event="segment_start")
        assert start["checkpoint_digest"] == start["restored_digest"], protocol
    staleness = state["segments"]["1"]["staleness"]
    assert staleness["bound"] == 2 and staleness["max_lead"] <= 2
    averages = read_events(layout.segment_metrics(2, "local"), event="average")
    assert [a["global_step"] for a in averages] == [33, 36, 39]
    assert state["segments"]["3"]["protocol_args"] == {"compression": "topk", "ratio": 0.1}
    assert (
        state["segments"]["3"]["bytes_per_worker_step"] < state["segments"]["0"]["bytes_per_worker_step"] / 4
    )
    cluster = state["cluster"]
    assert {h["address"] for h in cluster["hosts"]} == {h.address for h in bed.hosts}
    assert_hosts_clean(bed)


TEXT_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_classifier" / "text_example"
MNIST1D_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "mnist1d_example"


def test_a_lost_chief_host_fails_its_segment_and_the_retry_resumes_there_from_the_checkpoint(
    bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """The chief host holds the launcher, BSP's worker 0 (the only checkpointer) and a fork server: the
    host whose loss costs most. Lost mid-segment (every process killed, link down: a VM's host error),
    its segment's status is unknown while it is away (the segment trigger's stall rule counts), and
    exited without a code once it is back (a restarted VM keeps its disk, not its processes). The
    retry starts a fork server there again and resumes from the last checkpoint in the bucket."""
    backend = HostsBackend()
    # 750 steps past the checkpoint the chief is lost at: room for the refused second launch first.
    spec_job = job(bed, bucket, switch_order="1", train_steps=[800], ckpt_frequency=[50])
    layout = RunLayout.for_run(bucket, "hosts", "chief-lost")
    handle = backend.provision(spec_job, layout)
    chief = bed.hosts[0]
    try:
        (segment,) = spec_job.plan("chief-lost", layout.root)
        backend.launch_segment(handle, segment)
        wait_for(lambda: checkpoint_step(layout) >= 50, timeout=300, what="a checkpoint at step 50", poll=0.2)
        # A second launch while it trains is refused on the host, and leaves its files as they were.
        spec_file = Path(backend.segment_dir(handle, 0)) / "spec.json"
        written = spec_file.stat().st_mtime_ns
        with pytest.raises(ClusterError, match="segment 0 is already running"):
            backend.launch_segment(handle, segment)
        assert spec_file.stat().st_mtime_ns == written
        bed.kill_host(chief)
        try:
            assert backend.segment_status(handle, 0).state == UNKNOWN
        finally:
            bed.revive_host(chief)
        lost = backend.segment_status(handle, 0)
        assert (lost.state, lost.exit_code) == ("exited", None), lost

        backend.launch_segment(handle, segment)  # what the segment task's retry does
        wait_until_segment_ended(backend, handle, 0, timeout=300)
        assert backend.segment_status(handle, 0).exit_code == 0, backend.segment_log_tail(handle, 0, 40)
        result = read_state_result(layout, 0, "bsp")
        assert result["end_step"] == 800 and result["start_step"] >= 50, result
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)


def test_a_lost_worker_host_fails_its_segment_naming_the_node_with_every_log_in_the_bucket(
    bed: tb.Testbed, bucket: str, work_root: Path, capfd: pytest.CaptureFixture, statsd_here: Any
) -> None:
    """BSP worker 2's host is lost mid-segment (every process killed, link down). The segment fails, and
    the failed try's task log (the segment trigger's) names worker 2 on that host as the node that
    failed first, lost with its host rather than the chief its loss aborted, with its last lines: the
    launcher's copy of its log, pulled through its host's fork server while it lived, which is also
    in the bucket beside the survivors' logs. Back again, the host's own whole log comes home with
    the teardown, and so does the launcher's."""
    backend = HostsBackend()
    spec_job = job(bed, bucket, switch_order="1", train_steps=[3000], ckpt_frequency=[50], stall_seconds=180)
    layout = RunLayout.for_run(bucket, "hosts", "host-lost")
    lost = bed.hosts[3]  # BSP worker 2
    logs = layout.segment_logs(0, "bsp")
    handle = backend.provision(spec_job, layout)
    try:
        record_cluster(layout, handle)
        create_run(layout, "host-lost", spec_job.to_params(), spec_job.plan_entries())
        (entry,) = spec_job.plan_entries()
        launch_entry(layout.root, read_state(layout), entry, logging.getLogger("test"))
        wait_for(lambda: checkpoint_step(layout) >= 50, timeout=300, what="a checkpoint at step 50", poll=0.2)
        time.sleep(nodelogs.PULL_SECONDS + 1)  # the launcher's copy of worker 2's log has its first lines
        watcher = SegmentTrigger(
            run_dir=layout.root, index=0, protocol="bsp", until_step=3000, stall_seconds=180, log_seconds=5
        )
        bed.kill_host(lost)
        try:
            assert first_event(watcher, timeout=300) == "failed"
        finally:
            bed.revive_host(lost)
        out = capfd.readouterr()
        text = out.out + out.err
        assert (
            f"the node that failed first: worker-2 on host {lost.name} (its host or fork server stopped "
            "answering) at step "
        ) in text, text[-4000:]
        assert f"its log: {logs}/worker-2.log; every node's log: {logs}/" in text
        home = {uri.rsplit("/", 1)[1]: storage.read_text(uri) for uri in storage.list_files(logs)}
        assert {"worker-0.log", "worker-1.log", "worker-2.log"} <= set(home), sorted(home)
        assert home["worker-2.log"].startswith("worker 2 of segment 0 (bsp), pid ")
        assert home["worker-0.log"].startswith("worker 0 of segment 0 (bsp), pid ")
        shown = re.search(r"its last (\d+) lines?:\n((?:  \| .*\n)*)", text)
        assert shown and int(shown.group(1)) >= 1, text[-4000:]
        last_lines = [line.removeprefix("  | ") for line in shown.group(2).splitlines()]
        assert last_lines == home["worker-2.log"].splitlines()[-len(last_lines) :]
        failed = wait_for_metric(statsd_here, "syncswitch.segment.failed")
        assert failed.tags["node"] == "worker-2" and failed.tags["segment"] == "0"
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)
    # The teardown brought home the launcher's log, which names the same node, and the host's own
    # copy of worker 2's log, which goes at least as far as the launcher's.
    launcher_log = storage.read_text(f"{logs}/launcher-0.log")
    assert f"the node that failed first: worker-2 on host {lost.name}" in launcher_log
    assert storage.read_text(f"{logs}/worker-2.log").startswith(home["worker-2.log"])


def test_ssp_and_local_sgd_fail_on_a_lost_worker_host_and_their_retries_resume_from_the_checkpoint(
    bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """As documented (syncswitch.protocols), on the hosts: SSP and local SGD cannot go on without a
    worker. Worker 1's host is lost past a checkpoint of each segment: the segment fails, the
    launcher names the node and the documented outcome, and the checkpoint stands; back again, the
    retry (a second launch, as the segment task's) resumes from it and ends exactly on target, local
    SGD on its averaging period from there. Worker 2's link is slowed (+30 ms per round trip) until
    the loss: both protocols wait on the slowest worker, so the loss lands inside the segment
    however fast the machine is."""
    backend = HostsBackend()
    spec_job = job(
        bed,
        bucket,
        switch_order="ssp:2,local:4",
        train_steps=[400, 400],
        ckpt_frequency=[20],
        stall_seconds=180,
    )
    layout = RunLayout.for_run(bucket, "hosts", "protocol-host-lost")
    lost, slow = bed.hosts[2], bed.hosts[3]  # worker 1, worker 2
    delay = [sys.executable, "-m", "syncswitch.linkdelay", "--address", slow.address, "--delay-ms", "30"]
    handle = backend.provision(spec_job, layout)
    try:
        start = 0
        for segment in spec_job.plan("protocol-host-lost", layout.root):
            index, name = segment.index, segment.protocol
            delayer = bed.popen(slow, [*delay, "--duration", "600"], stdout=subprocess.DEVNULL)
            try:
                backend.launch_segment(handle, segment)
                wait_for(
                    lambda start=start: checkpoint_step(layout) >= start + 20,
                    timeout=300,
                    what=f"segment {index}'s first checkpoint",
                    poll=0.2,
                )
                bed.kill_host(lost)
            finally:
                delayer.terminate()
                delayer.wait(timeout=15)
            try:
                wait_until_segment_ended(backend, handle, index, timeout=300)
            finally:
                bed.revive_host(lost)
            assert backend.segment_status(handle, index).exit_code != 0
            # Each node named once; local SGD's collectives abort on the survivors too, and the
            # launcher names those that ended with the chief.
            events = read_events(layout.segment_metrics(index, name), event="node_lost")
            lost_nodes = {e["node"]: (e["host"], e["outcome"]) for e in events}
            assert len(lost_nodes) == len(events), events
            title = segment.segment_protocol.family.title
            assert lost_nodes["worker-1"] in {
                (lost.name, "the segment fails"),
                (lost.name, f"{title} cannot continue without it"),
            }, lost_nodes
            resume_from = checkpoint_step(layout)
            assert resume_from >= start + 20 and resume_from % 20 == 0

            backend.launch_segment(handle, segment)  # what the segment task's retry does
            wait_until_segment_ended(backend, handle, index, timeout=300)
            assert backend.segment_status(handle, index).exit_code == 0, backend.segment_log_tail(
                handle, index, 40
            )
            result = read_state_result(layout, index, name)
            assert (result["start_step"], result["end_step"]) == (resume_from, segment.until_step), result
            start = segment.until_step
        averages = [
            a["global_step"] for a in read_events(layout.segment_metrics(1, "local"), event="average")
        ]
        assert averages and all((step - 400) % 4 == 0 for step in averages), averages
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)


def wait_for_metric(sink: Any, name: str) -> Any:  # noqa: ANN401 - statsd_sink.Sample
    """The first sample of ``name`` (under Airflow's default prefix) that ``sink`` received."""
    wait_for(lambda: sink.received(f"airflow.{name}"), timeout=10, what=name)
    return sink.received(f"airflow.{name}")[0]


def test_a_fork_server_gone_before_a_launch_is_started_again_by_that_launch(
    bed: tb.Testbed, bucket: str, work_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A launch asks the chief to check, as it starts the segment, that every fork server listens
    where provisioning left it (one SSH command). A worker host's server killed since then is found
    so: the launch starts it again over SSH (on a new port) and the segment trains with it. The new
    address goes into the run's handle, so the next segment's launch is one command again."""
    caplog.set_level(logging.INFO, logger="syncswitch_airflow.backends.hosts")
    chief, worker, ps = bed.hosts[0], bed.hosts[1], bed.hosts[-1]
    hosts = [
        f"address={h.address},key={bed.key_path},role={role},name={h.name}"
        for h, role in ((chief, "chief"), (worker, "worker"), (ps, "ps"))
    ]
    spec_job = job(bed, bucket, hosts=hosts, num_workers=2, switch_order="10", train_steps=[20, 20])
    layout = RunLayout.for_run(bucket, "hosts", "server-gone")
    backend = HostsBackend()
    handle = backend.provision(spec_job, layout)
    try:
        record_cluster(layout, handle)
        create_run(layout, "server-gone", spec_job.to_params(), spec_job.plan_entries())
        ready = (
            Path(DEFAULT_WORK_ROOT) / f"hosts-server-gone@{worker.name}" / "forkserver" / "forkserver.json"
        )
        old = json.loads(ready.read_text())
        os.kill(old["pid"], signal.SIGKILL)
        wait_for(lambda: not peers.accepts(old["tcp"]), timeout=10, what="the server's end")
        for entry in spec_job.plan_entries():  # as the segment tasks launch them
            launch_entry(layout.root, read_state(layout), entry, logging.getLogger("test"))
            wait_until_segment_ended(backend, handle, entry["index"], timeout=300)
            ended = backend.segment_status(handle, entry["index"])
            assert ended.exit_code == 0, backend.segment_log_tail(handle, entry["index"], 40)
        new = json.loads(ready.read_text())
        assert new["pid"] != old["pid"], (old, new)
        recorded = {h["name"]: h["forkserver"] for h in read_state(layout)["cluster"]["hosts"]}
        assert recorded == {**{h["name"]: h["forkserver"] for h in handle["hosts"]}, worker.name: new["tcp"]}
        looked = [
            r.getMessage() for r in caplog.records if "looking at every host's fork server" in r.getMessage()
        ]
        assert looked == [
            f"run server-gone: segment 0: looking at every host's fork server "
            f"(nothing accepts a connection at {old['tcp']})"
        ], looked
    finally:
        backend.teardown(handle)
    assert_hosts_clean(bed)


def test_user_code_is_shipped_to_the_hosts_through_the_bucket(
    dag, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:  # noqa: ANN001
    """A usr_dir model ("10", each node on its own host): the hosts import the copy the run uploaded to
    its bucket folder (the emulator), unpacked into each host's work folder; the original folder is on
    no host's import path."""
    conf = {
        "job_name": "hosts-usr",
        "cluster_backend": "hosts",
        "hosts": host_params(bed),
        "bucket_dir": bucket,
        "usr_dir": str(TEXT_EXAMPLE),
        "model": "text_embedding",
        "problem": "synthetic_text",
        "hparam_set": "text_embedding",
        "switch_order": "10",
        "train_steps": [30, 60],
        "ckpt_frequency": [30],
        "num_workers": 3,
        "num_ps": 1,
    }
    dag_run = dag.test(run_conf=conf)

    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket, "hosts-usr", dag_run.run_id)
    state = read_state(layout)
    assert [state["segments"][str(i)]["end_step"] for i in range(2)] == [30, 90]
    shipped = state["user_code"]
    assert shipped["uri"] == layout.cluster_user_code(shipped["digest"]) and storage.exists(shipped["uri"])
    for index, protocol in ((0, "bsp"), (1, "asp")):
        # Every attempt's (a retry under load would start the segment again).
        starts = read_events(layout.segment_metrics(index, protocol), event="segment_start")
        imported = [start["user_code"]["path"] for start in starts]
        assert imported and all(p.startswith("/tmp/syncswitch-hosts/") for p in imported), imported
        assert all(f"usercode-{shipped['digest']}" in p for p in imported), imported
    assert state["final"]["export"]["saved_model"] == layout.export_saved_model
    assert_hosts_clean(bed)


def test_the_mnist1d_example_trains_101_in_a_fresh_hosts_environment_with_its_requirements(  # noqa: ANN001
    dag,
    bed: tb.Testbed,
    bucket: str,
    work_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The MNIST-1D example, whose model imports the ``mnist1d`` package that its requirements.txt
    lists, "101" through the DAG on two hosts with ``hosts_runtime = install`` and a work_root no run
    has used: validate resolves the list against the runtime's pins, provisioning installs it into a
    new runtime venv, and every segment trains there. Where the hosts bring their own runtime, a
    host that lacks a listed package is refused first, naming it. Another list is another venv.
    uv resolves (the Airflow side) and installs (the hosts) offline, from this machine's warm cache."""
    offline = offline_uv_env(tmp_path, MNIST1D_EXAMPLE / "requirements.txt")
    monkeypatch.setenv("SYNCSWITCH_HOSTS_ENV", ";".join(f"{k}={v}" for k, v in offline.items()))
    monkeypatch.setenv("UV_OFFLINE", "1")
    root = tmp_path / "fresh-root"
    hosts = [f"{h},work_root={root}" for h in host_params(bed)[:2]]

    lacking = tmp_path / "lacking" / "lacking_pkg"  # hosts_runtime = installed: the hosts are checked
    lacking.mkdir(parents=True)
    (lacking / "__init__.py").write_text("")
    (lacking / "requirements.txt").write_text("syncswitch-absent-package>=1\n")
    backend = HostsBackend()
    with pytest.raises(ClusterError, match=r"(?s)h\d .*syncswitch-absent-package: missing \(the user code's"):
        backend.provision(
            job(bed, bucket, hosts=hosts, num_workers=1, usr_dir=str(lacking)),
            RunLayout.for_run(bucket, "hosts", "lacking"),
        )
    assert backend.capacity().holders() == []
    assert not (root / "runtime").exists()

    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "install")
    conf = {
        "job_name": "hosts-mnist1d",
        "cluster_backend": "hosts",
        "hosts": hosts,
        "bucket_dir": bucket,
        "usr_dir": str(MNIST1D_EXAMPLE),
        "model": "mnist1d_cnn",
        "problem": "mnist1d",
        "hparam_set": "mnist1d_cnn",
        "switch_order": "101",
        "train_steps": [10, 10, 10],
        "ckpt_frequency": [10],
        "num_workers": 2,
        "num_ps": 1,
    }
    resolved = node_requirements(JobSpec.from_params(conf), install=True)
    venv = root / "runtime" / RuntimeBundle.current(resolved).id
    dag_run = dag.test(run_conf=conf)

    assert dag_run.state == "success"
    state = read_state(RunLayout.for_run(bucket, "hosts-mnist1d", dag_run.run_id))
    assert [state["segments"][str(i)]["end_step"] for i in range(3)] == [10, 20, 30]
    assert {h["python"] for h in state["cluster"]["hosts"]} == {str(venv / "bin" / "python")}
    probe = "import importlib.metadata as m, mnist1d; print(m.version('mnist1d'))"
    shown = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    assert shown.stdout.strip() == "0.0.2.post1", shown.stderr[-2000:]
    assert "user_requirements" in json.loads((venv / MARKER).read_text())
    assert [p.name for p in (root / "runtime").iterdir() if p.is_dir()] == [venv.name]
    assert_hosts_clean(bed)
    assert not list(root.glob("hosts-*")), "a run's work folder is left"

    changed = tmp_path / "changed" / MNIST1D_EXAMPLE.name
    changed.parent.mkdir()
    changed.mkdir()
    (changed / "requirements.txt").write_text("mnist1d>=0.0.2\n")
    other = node_requirements(JobSpec.from_params({**conf, "usr_dir": str(changed)}), install=True)
    assert RuntimeBundle.current(other).id != venv.name


def task_state(task_id: str, since: datetime.datetime) -> str | None:
    """The state of ``task_id`` in the sync_switch run that dag.test() started after ``since``."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalar(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == "sync_switch",
                TaskInstance.task_id == task_id,
                TaskInstance.start_date >= since,
            )
        )


def assert_no_secret(bed: tb.Testbed, layout: RunLayout, dag_run: Any) -> None:  # noqa: ANN401
    """Neither the SSH private key nor the cluster's fork-server token is in state.json, the report,
    the metrics, or any XCom of the run."""
    key_body = "".join(Path(bed.key_path).read_text().splitlines()[1:-1])
    secrets = [key_body[i : i + 40] for i in range(0, len(key_body) - 40, 40)]
    texts = [storage.read_bytes(uri).decode("latin-1") for uri in storage.list_files(layout.root)]
    texts.append(json.dumps(xcoms(dag_run)))
    for text in texts:
        for piece in secrets:
            assert piece not in text
        assert not re.search(r"token\W{1,4}[0-9a-f]{64}", text)


def xcoms(dag_run: Any) -> list[Any]:  # noqa: ANN401
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(XComModel.value).where(
                XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id
            )
        )
        return [row[0] for row in rows]


# ---- network stragglers ---------------------------------------------------------------------------


def connect_ms(bed: tb.Testbed, source: tb.TestHost, target: tb.TestHost) -> float:
    """The smallest of five TCP connects from ``source`` to ``target``'s sshd, in ms."""
    result = bed.connect_ms(source, target.address, tb.SSH_PORT, count=5, timeout=5.0)
    assert isinstance(result, float), f"{source.name} -> {target.name}: {result}"
    return result


def linkdelay_rules(bed: tb.Testbed, host: tb.TestHost) -> list[str]:
    listing = bed.exec(host, ["iptables", "-w", "-t", "mangle", "-S"], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if "syncswitch-linkdelay" in line]


def test_a_link_delay_slows_one_hosts_round_trips_and_restores_the_link(bed: tb.Testbed) -> None:
    """syncswitch.linkdelay (the network straggler) on one host: +30 ms on every round trip through
    its link while it runs; back to normal on SIGTERM with nothing left; after a SIGKILL its rule lets
    packets through (--queue-bypass) and ``clear`` removes it."""
    slow, peer, other = bed.hosts[1], bed.hosts[2], bed.hosts[3]
    assert connect_ms(bed, peer, slow) < 10
    command = [sys.executable, "-m", "syncswitch.linkdelay", "--address", slow.address]
    delay = [*command, "--delay-ms", "30", "--duration", "120"]
    delayer = bed.popen(slow, delay, stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: linkdelay_rules(bed, slow), timeout=20, what="the link delay's rule")
        assert 30 <= connect_ms(bed, peer, slow) < 60  # into the slow host
        assert 30 <= connect_ms(bed, slow, other) < 60  # out of it
        assert connect_ms(bed, peer, other) < 10  # the other links are untouched
    finally:
        delayer.terminate()
    assert delayer.wait(timeout=15) == 0
    assert "restored (nfqueue)" in delayer.stdout.read() or bed.delay_mechanism == "netem"
    assert linkdelay_rules(bed, slow) == []
    assert connect_ms(bed, peer, slow) < 10

    killed = bed.popen(slow, delay, stdout=subprocess.DEVNULL)
    wait_for(lambda: linkdelay_rules(bed, slow), timeout=20, what="the link delay's rule")
    killed.kill()
    killed.wait(timeout=15)
    assert connect_ms(bed, peer, slow) < 10  # no listener: the queue is bypassed, not a black hole
    bed.exec(slow, [sys.executable, "-m", "syncswitch.linkdelay", "clear"], check=True, capture_output=True)
    assert linkdelay_rules(bed, slow) == []


def test_a_network_straggler_is_named_by_the_detector_and_greedy_stops_bsp_for_asp(
    bed: tb.Testbed, bucket: str, work_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original's network straggler: worker 1's link +30 ms per round trip, on a live BSP segment
    on the hosts. Its compute time does not change; its round trip to its peers does. The straggler
    sensor's trigger names worker 1, greedy decides to switch, and the sensor's switch (plan rewrite +
    graceful stop request) ends the BSP segment early at a checkpoint. No delay or process is left.

    Not through dag.test(): it runs one task at a time, so the sensor never watches a running segment
    (the greedy e2e under the real scheduler is test_embedded_airflow's, with a CPU straggler). The
    segment-task state the trigger asks Airflow's execution API for is stubbed as "running"."""
    from airflow_runs import first_event
    from syncswitch_airflow.detector import Verdict
    from syncswitch_airflow.policies import get_policy
    from syncswitch_airflow.sensors.straggler import apply_switch, decision_record, policy_context
    from syncswitch_airflow.triggers import straggler as straggler_trigger

    spec_job = job(
        bed,
        bucket,
        switch_order="10",
        train_steps=[4000, 100],
        ckpt_frequency=[100],
        online_policy="greedy",
        max_online_switches=2,
        stragglers=["worker=1,start=2,duration=600,delay_ms=30"],
    )
    run_id = f"net-{_RUN_ID}"
    layout = RunLayout.for_run(bucket, "hosts", run_id)
    backend = HostsBackend()
    handle = backend.provision(spec_job, layout)
    try:
        record_cluster(layout, handle)
        create_run(layout, run_id, spec_job.to_params(), spec_job.plan_entries())
        item = spec_job.plan_entries()[0]
        spec = spec_job.segment_spec(item, run_id, layout.root)
        backend.launch_segment(handle, spec.replace(straggler_reference_time=time.time()))
        monkeypatch.setattr(straggler_trigger, "task_state", lambda *_: "running")
        trigger = straggler_trigger.StragglerTrigger(
            run_dir=layout.root,
            index=0,
            protocol="bsp",
            segment_task={"dag_id": "sync_switch", "run_id": run_id, "task_id": "segment_0.run_segment"},
            poll_interval=1.0,
        )
        payload = first_event(trigger, timeout=240)
        assert (payload["status"], payload.get("change")) == ("verdict", "raised"), payload
        verdict = Verdict.from_dict(payload["verdict"])
        assert verdict.workers == [1] and verdict.signal == "compute_time" and verdict.slowdown >= 1.5

        state = read_state(layout)
        decision = get_policy("greedy").decide(policy_context(state, item, verdict, 10.0))
        assert decision.action == "switch", decision
        apply_switch(layout, item, decision_record(state, item, decision, "raised"))
        wait_until_segment_ended(backend, handle, 0, timeout=300)
        result = read_state_result(layout, 0, "bsp")
        assert result["stopped_early"] and 0 < result["end_step"] < 4000, result
        plan = [(e["protocol"], e["origin"]) for e in read_state(layout)["plan"]]
        assert plan == [("bsp", "plan"), ("asp", "online"), ("asp", "plan")]
    finally:
        backend.teardown(handle)
    injected = read_events(layout.metrics, event="straggler")
    assert injected and {(e["kind"], e["delay_ms"]) for e in injected} == {("network", 30.0)}
    assert_hosts_clean(bed)
    assert all(linkdelay_rules(bed, host) == [] for host in bed.hosts)


# ---- helpers -------------------------------------------------------------------------------------


def read_state_result(layout: RunLayout, index: int, protocol: str) -> dict[str, Any]:
    return storage.read_json(layout.segment_result(index, protocol))


def host_is_up(bed: tb.Testbed, host: tb.TestHost) -> bool:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    index = bed.hosts.index(host)
    return any(f"ssv-{bed.name}-{index}" in line and "state UP" in line for line in links.splitlines())


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("open")
except OSError as exc:
    print(type(exc).__name__)
"""


def check_ports_are_closed_from_outside(bed: tb.Testbed) -> None:
    """A TF port and a fork-server port of a running node: reachable from another host of the
    cluster, not from a namespace outside the cluster network."""
    outside = bed.add_outside_namespace()
    ps_host = bed.hosts[4]
    ports = listening_ports(bed, ps_host)
    assert ports, "the parameter server's host listens on nothing"
    for port in ports:
        inside = bed.exec(
            bed.hosts[1],
            [sys.executable, "-c", _CONNECT, ps_host.address, str(port)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        from_outside = bed.exec(
            outside,
            [sys.executable, "-c", _CONNECT, ps_host.address, str(port)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert inside == "open" and from_outside != "open", (port, inside, from_outside)


def listening_ports(bed: tb.Testbed, host: tb.TestHost) -> list[int]:
    out = bed.exec(host, ["ss", "-Htln"], capture_output=True, text=True, check=True).stdout
    ports = []
    for line in out.splitlines():
        local = line.split()[3]
        port = int(local.rsplit(":", 1)[1])
        if port != host.ssh_port:
            ports.append(port)
    return ports
