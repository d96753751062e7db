"""The fake Compute Engine API (tests/fake_compute.py) against the real clients: google.cloud.compute_v1's
REST clients and googleapiclient's discovery client (what Airflow's ComputeEngineHook polls operations
with). Its instances are testbed hosts, so this needs root; skipped otherwise with
ensure_prerequisites()'s reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_auth_httplib2
import httplib2
import paramiko
import pytest
import testbed as tb
from conftest import host_namespaces, hosts_for_file
from fake_compute import PREEMPTED, STOCKOUT_CODE, FakeComputeEngine
from google.api_core import exceptions
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from googleapiclient.discovery import build
from googleapiclient.errors import HttpError

pytestmark = pytest.mark.testbed

_RUN_ID = os.getpid() % 100000
PROJECT = "syncswitch-fake"
ZONE = "us-central1-a"
OTHER_ZONE = "europe-west4-b"


@pytest.fixture(scope="module")
def bed(session_testbed: tb.Testbed) -> Iterator[tb.Testbed]:
    with hosts_for_file(session_testbed, 0) as testbed:  # no hosts until instances are inserted
        yield testbed
    assert not host_namespaces(testbed)


@pytest.fixture(scope="module")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(private key path, public key line) of a key the instances get in their ssh-keys metadata."""
    path = tmp_path_factory.mktemp("fake-compute-key") / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "trainer", "-f", str(path)], check=True
    )
    return str(path), Path(f"{path}.pub").read_text().strip()


@dataclass
class Clients:
    instances: compute_v1.InstancesClient
    firewalls: compute_v1.FirewallsClient
    zone_operations: compute_v1.ZoneOperationsClient
    discovery: Any  # googleapiclient Resource for compute v1


@pytest.fixture
def fake(bed: tb.Testbed) -> Iterator[FakeComputeEngine]:
    with FakeComputeEngine(bed, PROJECT, ssh_user_map={"trainer": "root"}) as engine:
        try:
            yield engine
        finally:
            _remove_hosts(engine, bed)
    assert bed.hosts == []
    assert not host_namespaces(bed)


@pytest.fixture
def clients(fake: FakeComputeEngine) -> Clients:
    options = ClientOptions(api_endpoint=fake.endpoint)
    credentials = AnonymousCredentials()
    # What ComputeEngineHook.get_conn() builds, with an endpoint: the static discovery document.
    http = google_auth_httplib2.AuthorizedHttp(credentials, http=httplib2.Http(timeout=30))
    discovery = build(
        "compute",
        "v1",
        http=http,
        client_options={"api_endpoint": fake.endpoint + "/compute/v1/"},
        cache_discovery=False,
        static_discovery=True,
    )
    return Clients(
        instances=compute_v1.InstancesClient(credentials=credentials, client_options=options),
        firewalls=compute_v1.FirewallsClient(credentials=credentials, client_options=options),
        zone_operations=compute_v1.ZoneOperationsClient(credentials=credentials, client_options=options),
        discovery=discovery,
    )


def _remove_hosts(engine: FakeComputeEngine, bed: tb.Testbed) -> None:
    """The hosts of a test's leftover instances (stop() leaves them, as GCE would keep running them)."""
    for name, instance in engine.instances().items():
        host = engine.host(name, zone=instance["zone"].rsplit("/", 1)[1])
        if host is not None:
            bed.remove_host(host)


def _instance(
    name: str,
    *,
    zone: str = ZONE,
    labels: dict[str, str] | None = None,
    ssh_keys: str | None = None,
    spot: bool = False,
    termination: str | None = None,
    gpus: int = 0,
    metadata: dict[str, str] | None = None,
) -> compute_v1.Instance:
    scheduling = compute_v1.Scheduling()
    if spot:
        scheduling = compute_v1.Scheduling(provisioning_model="SPOT", on_host_maintenance="TERMINATE")
        if termination:
            scheduling.instance_termination_action = termination
    elif gpus:
        scheduling = compute_v1.Scheduling(on_host_maintenance="TERMINATE")
    return compute_v1.Instance(
        name=name,
        machine_type=f"zones/{zone}/machineTypes/n1-standard-8",
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image="projects/debian-cloud/global/images/family/debian-12", disk_size_gb=50
                ),
            )
        ],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")],
        labels=labels or {},
        scheduling=scheduling,
        guest_accelerators=[
            compute_v1.AcceleratorConfig(
                accelerator_type=f"projects/{PROJECT}/zones/{zone}/acceleratorTypes/nvidia-tesla-t4",
                accelerator_count=gpus,
            )
        ]
        if gpus
        else [],
        metadata=compute_v1.Metadata(
            items=[
                compute_v1.Items(key=key, value=value)
                for key, value in {**({"ssh-keys": ssh_keys} if ssh_keys else {}), **(metadata or {})}.items()
            ]
        ),
    )


def _insert(clients: Clients, instance: compute_v1.Instance, zone: str = ZONE) -> compute_v1.Operation:
    """Insert and wait for the operation through ZoneOperationsClient.wait; the final operation."""
    operation = clients.instances.insert(project=PROJECT, zone=zone, instance_resource=instance)
    return clients.zone_operations.wait(project=PROJECT, zone=zone, operation=operation.name)


def _ssh(host_address: str, user: str, key_path: str, known_hosts: str) -> str:
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        host_address, username=user, key_filename=key_path, look_for_keys=False, allow_agent=False, timeout=10
    )
    try:
        _, stdout, _ = client.exec_command("hostname -I", timeout=10)
        return stdout.read().decode().strip()
    finally:
        client.close()


# ----- instances


def test_an_inserted_instance_runs_on_a_host_reached_over_ssh_with_its_metadata_key(
    fake: FakeComputeEngine, clients: Clients, bed: tb.Testbed, ssh_key: tuple[str, str]
) -> None:
    key_path, public_key = ssh_key
    operation = clients.instances.insert(
        project=PROJECT,
        zone=ZONE,
        instance_resource=_instance(
            "worker-0", labels={"job": "j1"}, ssh_keys=f"trainer:{public_key}", gpus=2
        ),
    )
    operation.result(timeout=30)  # DONE already: the ExtendedOperation does not poll
    assert not operation.error_code

    done = clients.zone_operations.get(project=PROJECT, zone=ZONE, operation=operation.name)
    assert done.status == compute_v1.Operation.Status.DONE
    assert done.operation_type == "insert"
    assert done.target_link.endswith(f"/projects/{PROJECT}/zones/{ZONE}/instances/worker-0")
    polled = (
        clients.discovery.zoneOperations().get(project=PROJECT, zone=ZONE, operation=operation.name).execute()
    )
    assert polled["status"] == "DONE" and "error" not in polled

    instance = clients.instances.get(project=PROJECT, zone=ZONE, instance="worker-0")
    assert instance.status == "RUNNING"
    assert (
        instance.self_link
        == f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances/worker-0"
    )
    assert instance.zone.endswith(f"/zones/{ZONE}") and instance.machine_type.endswith(
        "/machineTypes/n1-standard-8"
    )
    assert instance.labels == {"job": "j1"}
    assert instance.creation_timestamp and instance.id
    address = instance.network_interfaces[0].network_i_p
    host = fake.host("worker-0")
    assert host is not None and host.address == address and host in bed.hosts
    assert (
        clients.discovery.instances()
        .get(project=PROJECT, zone=ZONE, instance="worker-0")
        .execute()["networkInterfaces"][0]["networkIP"]
        == address
    )

    # The metadata's key (for "trainer", mapped to root here) logs in; the testbed's key does not.
    assert _ssh(address, "root", key_path, bed.known_hosts_path) == address
    with pytest.raises(paramiko.AuthenticationException):
        _ssh(address, "root", bed.key_path, bed.known_hosts_path)
    with pytest.raises(paramiko.AuthenticationException):  # sshd allows the mapped users only
        _ssh(address, "nobody", key_path, bed.known_hosts_path)

    [record] = fake.records()
    assert record["name"] == "worker-0" and record["zone"] == ZONE
    assert (record["machine_type"], record["gpu_type"], record["gpu_count"], record["spot"]) == (
        "n1-standard-8",
        "nvidia-tesla-t4",
        2,
        False,
    )
    assert record["ended_at"] is None and record["active_seconds"] >= 0
    assert ("POST", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances") in fake.requests


def test_instances_are_listed_by_label(fake: FakeComputeEngine, clients: Clients) -> None:
    for name, zone, labels in [
        ("a-chief", ZONE, {"job": "a", "role": "chief"}),
        ("a-worker", ZONE, {"job": "a", "role": "worker"}),
        ("a-far", OTHER_ZONE, {"job": "a", "role": "worker"}),
        ("b-chief", ZONE, {"job": "b", "role": "chief"}),
    ]:
        _insert(clients, _instance(name, zone=zone, labels=labels), zone=zone)

    def listed(flt: str) -> set[str]:
        return {
            i.name for i in clients.instances.list(request={"project": PROJECT, "zone": ZONE, "filter": flt})
        }

    assert listed('labels.job = "a"') == {"a-chief", "a-worker"}
    assert listed("labels.job=a") == {"a-chief", "a-worker"}
    assert listed('labels.job = "a" AND labels.role = "chief"') == {"a-chief"}
    assert listed('(labels.job = "a") (labels.role = "worker")') == {"a-worker"}
    assert listed('labels.job = "c"') == set()
    assert listed("") == {"a-chief", "a-worker", "b-chief"}
    with pytest.raises(exceptions.BadRequest):
        listed('labels.job = "a" OR labels.job = "b"')

    aggregated = clients.instances.aggregated_list(request={"project": PROJECT, "filter": 'labels.job = "a"'})
    by_zone = {zone: {i.name for i in scoped.instances} for zone, scoped in aggregated}
    assert by_zone == {f"zones/{ZONE}": {"a-chief", "a-worker"}, f"zones/{OTHER_ZONE}": {"a-far"}}
    raw = clients.discovery.instances().aggregatedList(project=PROJECT, filter="labels.role=chief").execute()
    assert {i["name"] for scoped in raw["items"].values() for i in scoped["instances"]} == {
        "a-chief",
        "b-chief",
    }
    empty = clients.discovery.instances().list(project=PROJECT, zone=ZONE, filter="labels.job=zzz").execute()
    assert empty["kind"] == "compute#instanceList" and "items" not in empty


def test_a_preempted_spot_instance_is_terminated_or_deleted(
    fake: FakeComputeEngine, clients: Clients, bed: tb.Testbed
) -> None:
    _insert(clients, _instance("spot-stop", spot=True, termination="STOP"))
    _insert(clients, _instance("spot-delete", spot=True, termination="DELETE"))
    _insert(clients, _instance("standard"))
    stop_host, delete_host = fake.host("spot-stop"), fake.host("spot-delete")
    assert stop_host is not None and delete_host is not None
    sleeper = bed.popen(stop_host, ["sleep", "60"])
    with pytest.raises(ValueError, match="not a Spot"):
        fake.preempt("standard")

    fake.preempt("spot-stop")
    fake.preempt("spot-delete")
    assert sleeper.wait(timeout=5) == -9
    assert stop_host.name not in host_namespaces(bed) and delete_host.name not in host_namespaces(bed)
    stopped = clients.instances.get(project=PROJECT, zone=ZONE, instance="spot-stop")
    assert stopped.status == "TERMINATED"
    assert stopped.scheduling.instance_termination_action == "STOP"
    with pytest.raises(exceptions.NotFound):
        clients.instances.get(project=PROJECT, zone=ZONE, instance="spot-delete")

    preempted = list(
        clients.zone_operations.list(
            request={"project": PROJECT, "zone": ZONE, "filter": f'operationType = "{PREEMPTED}"'}
        )
    )
    zone_url = f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/zones/{ZONE}"
    assert {op.target_link for op in preempted} == {stopped.self_link, f"{zone_url}/instances/spot-delete"}
    assert all(op.status == compute_v1.Operation.Status.DONE for op in preempted)
    assert (
        len(list(clients.zone_operations.list(project=PROJECT, zone=ZONE))) == 5
    )  # 3 inserts, 2 preemptions

    records = {r["name"]: r for r in fake.records()}
    assert records["spot-stop"]["spot"] and records["spot-stop"]["ended_at"] is not None
    assert records["standard"]["ended_at"] is None
    ended = records["spot-stop"]["active_seconds"]
    assert fake.records()[0]["active_seconds"] == ended  # no longer counting

    # A terminated instance can still be deleted; its (ended) record stays as it was.
    _wait_done(clients, clients.instances.delete(project=PROJECT, zone=ZONE, instance="spot-stop"))
    assert set(fake.instances()) == {"standard"}
    assert {r["name"]: r for r in fake.records()}["spot-stop"]["active_seconds"] == ended


def _compute_engine_hook(clients: Clients, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Airflow's ComputeEngineHook polling with our discovery client (its own get_conn() would build one
    from the connection's credentials and without an api_endpoint)."""
    from airflow.providers.google.cloud.hooks.compute import ComputeEngineHook

    monkeypatch.setenv("AIRFLOW_CONN_FAKE_COMPUTE", '{"conn_type": "google_cloud_platform"}')
    hook = ComputeEngineHook(gcp_conn_id="fake_compute")
    hook._conn = clients.discovery
    return hook


def test_a_stocked_out_zone_fails_the_insert_operation(
    fake: FakeComputeEngine, clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = _compute_engine_hook(clients, monkeypatch)
    fake.stock_out(ZONE, count=1)
    operation = clients.instances.insert(project=PROJECT, zone=ZONE, instance_resource=_instance("unlucky"))
    with pytest.raises(exceptions.ServiceUnavailable):
        operation.result(timeout=30)
    polled = (
        clients.discovery.zoneOperations().get(project=PROJECT, zone=ZONE, operation=operation.name).execute()
    )
    assert polled["status"] == "DONE"
    assert polled["error"]["errors"][0]["code"] == STOCKOUT_CODE
    assert (polled["httpErrorStatusCode"], polled["httpErrorMessage"]) == (503, "SERVICE UNAVAILABLE")
    with pytest.raises(exceptions.NotFound):
        clients.instances.get(project=PROJECT, zone=ZONE, instance="unlucky")
    assert fake.records() == [] and fake.instances() == {}
    with pytest.raises(Exception, match=f"503 SERVICE UNAVAILABLE: .*{STOCKOUT_CODE}") as raised:
        hook._wait_for_operation_to_complete(project_id=PROJECT, operation_name=operation.name, zone=ZONE)
    assert type(raised.value).__name__ == "AirflowException"

    # Only `count` inserts fail, and only in that zone.
    lucky = clients.instances.insert(project=PROJECT, zone=ZONE, instance_resource=_instance("lucky"))
    hook._wait_for_operation_to_complete(project_id=PROJECT, operation_name=lucky.name, zone=ZONE)
    assert fake.instances()["lucky"]["status"] == "RUNNING"


def test_guest_attributes_publish_the_hosts_ssh_host_key_where_the_metadata_enables_them(
    fake: FakeComputeEngine, clients: Clients, bed: tb.Testbed
) -> None:
    _insert(clients, _instance("published", metadata={"enable-guest-attributes": "TRUE"}))
    _insert(clients, _instance("silent"))

    def host_keys(name: str, path: str = "hostkeys/") -> dict[str, str]:
        request = {"project": PROJECT, "zone": ZONE, "instance": name, "query_path": path}
        found = clients.instances.get_guest_attributes(request=request)
        assert found.query_path == path
        return {f"{e.namespace}/{e.key}": e.value for e in found.query_value.items}

    host = fake.host("published")
    assert host is not None
    key_type, _, key = bed.host_key(host).partition(" ")
    assert host_keys("published") == {f"hostkeys/{key_type}": key}
    # Not enabled at boot, another namespace, an unknown instance: not found, as on Compute Engine.
    for name, path in [("silent", "hostkeys/"), ("published", "other/"), ("absent", "hostkeys/")]:
        with pytest.raises(exceptions.NotFound):
            host_keys(name, path)
    # Scripted for the backend's tests: the guest attributes name another key than the host's.
    fake.publish_host_key_instead("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIImpostor")
    assert host_keys("published") == {"hostkeys/ssh-ed25519": "AAAAC3NzaC1lZDI1NTE5AAAAIImpostor"}
    fake.publish_host_key_instead(None)
    assert host_keys("published") == {f"hostkeys/{key_type}": key}


def test_delete_removes_the_host(fake: FakeComputeEngine, clients: Clients, bed: tb.Testbed) -> None:
    _insert(clients, _instance("doomed"))
    host = fake.host("doomed")
    assert host is not None and host.name in host_namespaces(bed)
    operation = clients.instances.delete(project=PROJECT, zone=ZONE, instance="doomed")
    done = _wait_done(clients, operation)
    assert done.operation_type == "delete"
    assert host.name not in host_namespaces(bed) and host not in bed.hosts
    with pytest.raises(exceptions.NotFound):
        clients.instances.get(project=PROJECT, zone=ZONE, instance="doomed")
    with pytest.raises(exceptions.NotFound):
        clients.instances.delete(project=PROJECT, zone=ZONE, instance="doomed")
    [record] = fake.records()
    assert record["ended_at"] is not None and record["active_seconds"] > 0


def _wait_done(clients: Clients, operation: Any) -> compute_v1.Operation:
    done = clients.zone_operations.wait(project=PROJECT, zone=ZONE, operation=operation.name)
    assert done.status == compute_v1.Operation.Status.DONE and not done.error.errors
    return done


def test_inserts_are_validated(fake: FakeComputeEngine, clients: Clients, ssh_key: tuple[str, str]) -> None:
    def insert(instance: compute_v1.Instance, zone: str = ZONE, project: str = PROJECT) -> None:
        clients.instances.insert(project=project, zone=zone, instance_resource=instance)

    public = compute_v1.Instance(_instance("public"))
    public.network_interfaces[0].access_configs = [compute_v1.AccessConfig(name="External NAT")]
    with pytest.raises(exceptions.BadRequest, match="internal IPs only"):
        insert(public)
    with pytest.raises(exceptions.BadRequest, match="resource.name"):
        insert(_instance("Bad_Name"))
    with pytest.raises(exceptions.BadRequest, match="machineType"):
        insert(_instance("elsewhere", zone=OTHER_ZONE))  # inserted in ZONE, its machine type in OTHER_ZONE
    no_disk = _instance("no-disk")
    no_disk.disks = []
    with pytest.raises(exceptions.BadRequest, match="disk"):
        insert(no_disk)
    migrating_gpu = _instance("migrating-gpu", gpus=1)
    migrating_gpu.scheduling.on_host_maintenance = "MIGRATE"
    with pytest.raises(exceptions.BadRequest, match="live migration"):
        insert(migrating_gpu)
    retired_gpu = _instance("retired-gpu", gpus=1)  # K80s are offered in no zone any more
    k80 = f"projects/{PROJECT}/zones/{ZONE}/acceleratorTypes/nvidia-tesla-k80"
    retired_gpu.guest_accelerators[0].accelerator_type = k80
    with pytest.raises(exceptions.BadRequest, match="'nvidia-tesla-k80' does not exist in zone"):
        insert(retired_gpu)
    with pytest.raises(exceptions.BadRequest, match="label"):
        insert(_instance("bad-label", labels={"Job": "x"}))
    with pytest.raises(exceptions.BadRequest, match="ssh-keys"):
        insert(_instance("bad-key", ssh_keys=ssh_key[1]))  # no "user:" prefix
    with pytest.raises(exceptions.NotFound, match="projects/someone-else"):
        insert(_instance("stranger"), project="someone-else")
    assert fake.instances() == {} and fake.records() == []

    _insert(clients, _instance("twice"))
    with pytest.raises(exceptions.Conflict, match="already exists"):
        insert(_instance("twice"))
    with pytest.raises(HttpError) as raised:
        clients.discovery.instances().get(project=PROJECT, zone=ZONE, instance="absent").execute()
    assert raised.value.resp.status == 404 and raised.value.error_details[0]["reason"] == "notFound"


def test_pending_operations_read_done_from_the_next_get(bed: tb.Testbed) -> None:
    with FakeComputeEngine(bed, PROJECT, pending_operations=True) as engine:
        options = ClientOptions(api_endpoint=engine.endpoint)
        instances = compute_v1.InstancesClient(credentials=AnonymousCredentials(), client_options=options)
        operations = compute_v1.ZoneOperationsClient(
            credentials=AnonymousCredentials(), client_options=options
        )
        try:
            operation = instances.insert(project=PROJECT, zone=ZONE, instance_resource=_instance("slowpoke"))
            assert operation.status == compute_v1.Operation.Status.RUNNING
            got = operations.get(project=PROJECT, zone=ZONE, operation=operation.name)
            assert got.status == compute_v1.Operation.Status.DONE
            assert instances.get(project=PROJECT, zone=ZONE, instance="slowpoke").status == "RUNNING"
            deleted = instances.delete(project=PROJECT, zone=ZONE, instance="slowpoke")
            assert deleted.status == compute_v1.Operation.Status.RUNNING
            waited = operations.wait(project=PROJECT, zone=ZONE, operation=deleted.name)
            assert waited.status == compute_v1.Operation.Status.DONE
        finally:
            _remove_hosts(engine, bed)
    assert not host_namespaces(bed)


def test_concurrent_inserts_and_deletes_get_hosts_of_their_own(
    fake: FakeComputeEngine, clients: Clients, bed: tb.Testbed
) -> None:
    names = [f"parallel-{i}" for i in range(6)]
    with ThreadPoolExecutor(len(names)) as pool:
        done = list(pool.map(lambda name: _insert(clients, _instance(name)), names))
    assert all(op.status == compute_v1.Operation.Status.DONE and not op.error.errors for op in done)
    addresses = {fake.instances()[name]["networkInterfaces"][0]["networkIP"] for name in names}
    assert len(addresses) == len(names) == len(bed.hosts)
    assert {host.address for host in bed.hosts} == addresses
    assert len(Path(bed.known_hosts_path).read_text().splitlines()) == len(names)
    for address in addresses:
        with socket.create_connection((address, 22), timeout=5) as conn:
            assert conn.recv(4) == b"SSH-"

    def delete(name: str) -> compute_v1.Operation:
        return _wait_done(clients, clients.instances.delete(project=PROJECT, zone=ZONE, instance=name))

    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(delete, names))
    assert fake.instances() == {} and bed.hosts == [] and not host_namespaces(bed)
    assert all(record["ended_at"] is not None for record in fake.records())


# ----- firewalls


def test_firewalls_insert_get_list_delete(fake: FakeComputeEngine, clients: Clients) -> None:
    rule = compute_v1.Firewall(
        name="ss-job1-internal",
        network="global/networks/default",
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["2222", "5000-5100"])],
        source_tags=["ss-job1"],
        target_tags=["ss-job1"],
    )
    operation = clients.firewalls.insert(project=PROJECT, firewall_resource=rule)
    operation.result(timeout=30)
    got = clients.firewalls.get(project=PROJECT, firewall="ss-job1-internal")
    assert got.network == f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/global/networks/default"
    assert [a.ports for a in got.allowed] == [["2222", "5000-5100"]] and got.direction == "INGRESS"
    with pytest.raises(exceptions.Conflict):
        clients.firewalls.insert(project=PROJECT, firewall_resource=rule)
    open_rule = compute_v1.Firewall(rule)
    open_rule.name = "ss-open"
    open_rule.target_tags = []
    with pytest.raises(exceptions.BadRequest, match="targetTags"):
        clients.firewalls.insert(project=PROJECT, firewall_resource=open_rule)
    bad_port = compute_v1.Firewall(rule)
    bad_port.name = "ss-bad-port"
    bad_port.allowed = [compute_v1.Allowed(I_p_protocol="tcp", ports=["70000"])]
    with pytest.raises(exceptions.BadRequest, match="ports"):
        clients.firewalls.insert(project=PROJECT, firewall_resource=bad_port)

    other = compute_v1.Firewall(rule)
    other.name = "other-rule"
    clients.firewalls.insert(project=PROJECT, firewall_resource=other).result(timeout=30)
    assert {
        f.name for f in clients.firewalls.list(request={"project": PROJECT, "filter": "name eq ss-.*"})
    } == {"ss-job1-internal"}
    assert {
        f.name for f in clients.firewalls.list(request={"project": PROJECT, "filter": 'name = "other-rule"'})
    } == {"other-rule"}
    assert set(fake.firewalls()) == {"ss-job1-internal", "other-rule"}

    clients.firewalls.delete(project=PROJECT, firewall="ss-job1-internal").result(timeout=30)
    with pytest.raises(exceptions.NotFound):
        clients.firewalls.get(project=PROJECT, firewall="ss-job1-internal")
    with pytest.raises(exceptions.NotFound):
        clients.firewalls.delete(project=PROJECT, firewall="ss-job1-internal")
    global_op = clients.discovery.globalOperations().get(project=PROJECT, operation=operation.name).execute()
    assert (
        global_op["status"] == "DONE" and global_op["operationType"] == "insert" and "zone" not in global_op
    )
