"""The gce backend end to end against a FAKE Compute Engine API (tests/fake_compute.py).

There is no Compute Engine emulator. The fake speaks the real REST API to the real clients
(compute_v1, the provider's ComputeEngineHook), and its instances are real hosts of the network-
namespace testbed: an insert starts a host with sshd that takes the run's SSH key from the metadata,
a delete removes it, a scripted preemption kills it, a scripted stock-out refuses an insert. Everything
above the HTTP boundary is the code users run: the backend, the hosts backend, the DAG, real TF.
"""

from __future__ import annotations

import http.server
import importlib.metadata
import os
import posixpath
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import testbed as tb
from airflow_runs import DuringRun, checkpoint_step, job_checkpoint_step, wait_until_segment_ended
from conftest import (
    ANONYMOUS_GOOGLE_CONNECTION,
    hosts_for_file,
    new_bucket,
    offline_uv_env,
    storage_on_gateway,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fake_compute import FakeComputeEngine
from google.cloud import compute_v1
from proc_utils import wait_for
from syncswitch import storage
from syncswitch.costs import Catalog
from syncswitch.hosts import DEFAULT_WORK_ROOT
from syncswitch.layout import JobHistoryLayout, RunLayout
from syncswitch.spec import JobSpec, SegmentSpec
from syncswitch.state import read_state
from syncswitch_airflow import settings
from syncswitch_airflow.backends import ClusterError
from syncswitch_airflow.backends import gce as gce_backend
from syncswitch_airflow.backends.gce import GceBackend
from syncswitch_airflow.backends.gce_requests import vm_metadata
from syncswitch_airflow.backends.user_requirements import node_requirements
from syncswitch_airflow.hooks.compute import ComputeHook
from syncswitch_airflow.settings import SettingError

pytestmark = [pytest.mark.testbed, pytest.mark.cluster]

PROJECT = "sync-fake-1"
MNIST1D_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "mnist1d_example"
ZONES = "us-central1-a us-central1-b"  # the chief and worker 1 in different zones, like a zone array


@pytest.fixture(scope="module")
def bed(session_testbed: tb.Testbed) -> Iterator[tb.Testbed]:
    with hosts_for_file(session_testbed, 0) as testbed:  # hosts come and go with the fake's instances
        yield testbed


@pytest.fixture(scope="module")
def fake(bed: tb.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeComputeEngine]:
    """The fake API, the storage on the testbed's gateway, and an anonymous Google connection."""
    with FakeComputeEngine(bed, PROJECT) as api:
        # The endpoint as Airflow's config section (AIRFLOW__SYNCSWITCH__GCE_API_ENDPOINT).
        endpoint = settings.setting("gce_api_endpoint").airflow_env
        env = {endpoint: api.endpoint, "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": ANONYMOUS_GOOGLE_CONNECTION}
        with storage_on_gateway(bed.gateway, tmp_path_factory.mktemp("gce-gcs"), env):
            yield api
    # The testbed's hosts share this machine's filesystem: what a VM kept on its boot disk (deleted
    # with the VM on Compute Engine) is still here. Remove it as the deletions would have.
    for folder in Path(DEFAULT_WORK_ROOT).glob("gce-*@ss-gce-*"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def bucket(fake: FakeComputeEngine) -> str:
    return f"{new_bucket('gce')}/runs"


def gce_param(**overrides: Any) -> dict[str, Any]:  # noqa: ANN401
    # The VMs share this machine's filesystem and users: the runtime is this interpreter's, and the
    # login is root's (on Compute Engine the guest agent creates the ssh-keys user).
    return {
        "project": PROJECT,
        "zones": ZONES,
        "gpus": "t4",
        "python": sys.executable,
        "ssh_user": "root",
        **overrides,
    }


def conf(bucket: str, **overrides: Any) -> dict[str, Any]:  # noqa: ANN401
    return {
        "job_name": "gce",
        "cluster_backend": "gce",
        "bucket_dir": bucket,
        "num_workers": 2,
        "num_ps": 1,
        "gce": gce_param(),
        **overrides,
    }


def assert_nothing_left(fake: FakeComputeEngine, bed: tb.Testbed) -> None:
    """No instance or firewall in the fake, no host on the testbed (every instance's host is gone)."""
    assert fake.instances() == {}, f"instances left: {list(fake.instances())}"
    assert fake.firewalls() == {}, f"firewalls left: {list(fake.firewalls())}"
    assert bed.hosts == [], f"hosts left: {[h.name for h in bed.hosts]}"


# ---- the hook --------------------------------------------------------------------------------------


def test_the_hooks_operation_waits_are_safe_from_many_threads(
    fake: FakeComputeEngine,
) -> None:
    """The backend creates and deletes VMs from a thread pool. The provider's own wait shares one
    httplib2 connection, and two threads' polls on it read each other's answers (IncompleteRead in CI,
    in teardown and in the provider's insert_instance); ours give each wait its own client, and the
    provider's methods wait with ours."""
    hook = ComputeHook()
    rule = compute_v1.Firewall(
        name="ss-threads",
        network="global/networks/default",
        allowed=[compute_v1.Allowed(I_p_protocol="tcp")],
        source_tags=["ss-threads"],
        target_tags=["ss-threads"],
    )
    operation = compute_v1.FirewallsClient(
        credentials=hook.get_credentials(), client_options=hook.get_client_options()
    ).insert(request={"project": PROJECT, "firewall_resource": rule})
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            done = list(pool.map(lambda _: hook.wait_global_operation(operation.name, PROJECT), range(400)))
        assert {d.name for d in done} == {operation.name} and all(d.end_time for d in done)
        # What the provider's insert_instance, delete_instance etc. call once their request is sent;
        # with the provider's own version, 16 threads x 400 polls failed ~5 (IncompleteRead, EBADF).
        provider_wait = hook._wait_for_operation_to_complete
        with ThreadPoolExecutor(max_workers=16) as pool:
            waits = [pool.submit(provider_wait, PROJECT, operation.name) for _ in range(400)]
        assert [w.exception() for w in waits] == [None] * 400
    finally:
        hook.delete_firewall_if_exists("ss-threads", PROJECT)
    assert fake.firewalls() == {}


# ---- provisioning ---------------------------------------------------------------------------------


def test_a_stock_out_fails_provisioning_naming_the_vm_and_leaves_nothing(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    backend = GceBackend()
    job = JobSpec.from_params(conf(bucket))
    fake.stock_out("us-central1-b")  # worker 1's zone
    layout = RunLayout.for_run(bucket, "gce", "stock-out")
    with pytest.raises(ClusterError) as caught:
        backend.provision(job, layout)
    message = str(caught.value)
    assert "-w1" in message and "us-central1-b" in message and "ZONE_RESOURCE_POOL_EXHAUSTED" in message
    assert_nothing_left(fake, bed)
    assert backend.capacity().holders() == []
    vms = read_state(layout)["vms"]
    assert {vm["state"] for name, vm in vms.items() if name.endswith("-w1")} == {"failed"}


def test_a_vm_whose_address_answers_with_another_host_key_is_refused(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each VM's SSH host key comes from its guest attributes (Compute Engine's API), not from the
    network: where the VMs publish one key and their addresses answer with another (a man in the
    middle), provisioning fails naming the host key and leaves nothing. With ``gce_host_keys =
    accept-any`` (images without Google's guest environment) the same VMs are taken, keys unchecked."""
    backend = GceBackend()
    # A key refused right after boot is retried for a grace (30 s: sshd may restart with the keys the
    # VM just published); here it is the same key every time, so the test does not wait that long.
    monkeypatch.setattr(gce_backend, "HOST_KEY_GRACE_S", 2.0)
    job = JobSpec.from_params(conf(bucket, gce=gce_param(gpus="none")))
    impostor = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    fake.publish_host_key_instead(impostor.decode())
    try:
        with pytest.raises(ClusterError, match=r"its host key is not the one pinned with the run"):
            backend.provision(job, RunLayout.for_run(bucket, "gce", "impostor"))
        assert_nothing_left(fake, bed)
        assert backend.capacity().holders() == []

        monkeypatch.setenv(settings.setting("gce_host_keys").airflow_env, "accept-any")
        layout = RunLayout.for_run(bucket, "gce", "unchecked")
        handle = backend.provision(job, layout)
        try:
            assert all(h["forkserver"] and not h["host_key"] for h in handle["hosts"])
            assert not any("host_key" in vm for vm in read_state(layout)["vms"].values())
        finally:
            backend.teardown(handle)
    finally:
        fake.publish_host_key_instead(None)
    assert_nothing_left(fake, bed)

    monkeypatch.setenv(settings.setting("gce_host_keys").airflow_env, "trust-me")
    with pytest.raises(SettingError, match=r"gce_host_keys .* must be one of guest-attributes, accept-any"):
        backend.provision(job, RunLayout.for_run(bucket, "gce", "misconfigured"))
    assert_nothing_left(fake, bed)
    assert backend.capacity().holders() == []


def test_the_reaper_deletes_the_vms_of_a_run_whose_teardown_never_came(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    backend = GceBackend()
    job = JobSpec.from_params(conf(bucket, gce=gce_param(gpus="none", max_run_seconds=3600)))
    layout = RunLayout.for_run(bucket, "gce", "abandoned")
    handle = backend.provision(job, layout)
    assert len(fake.instances()) == 3 and len(bed.hosts) == 3
    # While the run is within its time limit and not finished, the reaper leaves it alone.
    assert backend.reap(PROJECT) == []
    assert len(fake.instances()) == 3
    # An hour later (the run's teardown never came), everything of it goes.
    expires = fake.instances()[handle["hosts"][0]["name"]]["labels"]["syncswitch-expires"]
    reaped = backend.reap(PROJECT, now=float(expires))
    assert sorted(reaped) == sorted(h["name"] for h in handle["hosts"])
    assert_nothing_left(fake, bed)
    backend.capacity().release(handle["run"])


# ---- a VM's boot ----------------------------------------------------------------------------------


class MetadataServer(http.server.ThreadingHTTPServer):
    """Compute Engine's metadata server for one VM: its custom attributes at
    ``/computeMetadata/v1/instance/attributes/<key>``, only to requests with ``Metadata-Flavor: Google``
    (as the real one). ``served`` lists the keys it answered."""

    PREFIX = "/computeMetadata/v1/instance/attributes/"

    def __init__(self, address: str, attributes: dict[str, str]) -> None:
        self.attributes, self.served = attributes, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                key = self.path.removeprefix(MetadataServer.PREFIX)
                if self.headers.get("Metadata-Flavor") != "Google":
                    self.send_error(403, "Missing Metadata-Flavor:Google header")
                elif not self.path.startswith(MetadataServer.PREFIX) or key not in server.attributes:
                    self.send_error(404)
                else:
                    body = server.attributes[key].encode()
                    server.served.append(key)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # noqa: ANN401 - quiet
                pass

        super().__init__((address, 80), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_the_startup_script_installs_the_runtime_on_a_vm_from_its_metadata(
    bed: tb.Testbed, fake: FakeComputeEngine, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a VM runs at boot (backends/gce-startup.sh), every line, on a testbed host (the fake
    Compute API runs no startup scripts): its attributes, the metadata the backend gives its VMs,
    from a metadata server at ``metadata.google.internal`` (the host's own /etc/hosts, which
    ``ip netns exec`` mounts from /etc/netns); the runtime's wheel from the run's bucket folder as the
    backend uploads it, fetched by the node's storage client; the MNIST-1D example's requirements as
    the backend resolves them; the venv where ``python`` says. The host has no route to a registry:
    uv resolves (here) and installs (there) offline from this machine's cache."""
    layout = RunLayout.for_run(bucket, "gce", "boot")
    GceBackend._upload_runtime(layout)
    python = tmp_path / "opt" / "syncswitch" / ".venv" / "bin" / "python"
    job = JobSpec.from_params(conf(bucket, gce=gce_param(python=str(python)), usr_dir=str(MNIST1D_EXAMPLE)))
    # Before the host: without uv this skips, and a host added first would be left behind.
    offline = offline_uv_env(tmp_path, MNIST1D_EXAMPLE / "requirements.txt")
    monkeypatch.setenv("UV_OFFLINE", "1")
    user_requirements = node_requirements(job, install=True)
    attributes = vm_metadata(
        job.gce, layout, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBoot boot@test", user_requirements
    )
    env = {**offline, "STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}
    host = bed.add_host()
    etc = Path("/etc/netns") / host.name
    script = tmp_path / "startup-script"
    script.write_text(attributes["startup-script"])
    try:
        etc.mkdir(parents=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{bed.gateway} metadata.google.internal\n")
        server = MetadataServer(bed.gateway, attributes)
        try:
            boot = bed.exec(host, ["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
        finally:
            server.shutdown()
            server.server_close()
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        bed.remove_host(host)
    assert boot.returncode == 0, boot.stdout[-2000:] + boot.stderr[-3000:]
    assert boot.stdout.strip().splitlines()[-1] == f"sync-switch runtime ready: {python}"
    wanted = {"syncswitch-python", "syncswitch-install", "syncswitch-requirements", "syncswitch-runtime"}
    assert set(server.served) == {*wanted, "syncswitch-user-requirements"}  # uv was there: no syncswitch-uv
    # What the backend then waits for over SSH, and the runtime as a distribution at the lock's pins.
    subprocess.run([str(python), "-c", "import syncswitch.forkserver"], check=True, timeout=120)
    subprocess.run([str(python), "-m", "syncswitch.requirements", "--check"], check=True, timeout=120)
    probe = "import importlib.metadata as m; print(m.version('syncswitch'))"
    shown = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == importlib.metadata.version("syncswitch")
    probe = "import importlib.metadata as m, mnist1d; print(m.version('mnist1d'))"  # the user code's list
    shown = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "0.0.2.post1"
    assert not bed.hosts


# ---- end to end through the DAG -------------------------------------------------------------------


def preempt_worker_1(
    fake: FakeComputeEngine, job_root: str, steps: list[float], done: list[str]
) -> Callable[[DuringRun], None]:
    """A DuringRun script: preempt the VM standing in worker 1's place once the run has a checkpoint
    at each of ``steps``; the preempted VMs' names go to ``done``."""

    def script(run: DuringRun) -> None:
        for step in steps:
            run.wait(lambda s=step: job_checkpoint_step(job_root) >= s, f"a checkpoint at step {step}")
            worker = next(name for name in fake.instances() if "-w1" in name)
            fake.preempt(worker)
            done.append(worker)

    return script


def test_101_on_spot_vms_survives_a_preemption_in_bsp_and_in_asp_and_bills_every_second(  # noqa: ANN001
    dag, fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    run_conf = conf(
        bucket,
        switch_order="101",
        train_steps=[400, 900, 40],
        ckpt_frequency=[50, 300, 40],
        stall_seconds=300,
    )
    # Worker 1's VM goes just past BSP's first checkpoint (step 50 of 0..400) and ASP's first at or
    # past step 700 (of 400..1300): far from either segment's end.
    preempted: list[str] = []
    preempter = DuringRun(preempt_worker_1(fake, f"{bucket}/gce", [50, 700], preempted)).start()
    try:
        dag_run = dag.test(run_conf=run_conf)
    finally:
        preempter.stop()

    assert len(preempted) == 2, preempted
    assert dag_run.state == "success"
    layout = RunLayout.for_run(bucket, "gce", dag_run.run_id)
    state = read_state(layout)
    # Training ended exactly on target, each segment resuming where the last one ended.
    assert [state["segments"][str(i)]["end_step"] for i in range(3)] == [400, 1300, 1340]
    assert state["segments"]["0"]["start_step"] >= 50  # the BSP retry resumed from a checkpoint
    # Both revocations were noticed and replaced; the events name the preemptions.
    events = state["cluster_events"]
    revoked = [e for e in events if e["kind"] == "revoked"]
    assert [e["vm"] for e in revoked] == preempted and all(e["preempted"] for e in revoked)
    replaced = {e["vm"]: e["by"] for e in events if e["kind"] == "replaced"}
    assert set(replaced) == set(preempted)
    vms = state["vms"]
    # Every VM, the replacements too, had its own host key pinned from its guest attributes (logins
    # refuse any other: test_a_vm_whose_address_answers_with_another_host_key_is_refused).
    assert len({vm["host_key"] for vm in vms.values()}) == len(vms) == 5
    assert all(vm["host_key"].startswith("ssh-ed25519 ") for vm in vms.values())
    assert {name: vm["state"] for name, vm in vms.items()} == {
        **{name: "revoked" for name in preempted},
        **{name: "deleted" for name in vms if name not in preempted},
    }
    # The bill: the fake's active seconds of every VM at the catalog's prices.
    cost = state["cost"]
    catalog = Catalog.load()
    records = [r for r in fake.records() if r["name"] in vms]  # the fake outlives one test
    expected = sum(
        catalog.hourly(r["zone"], r["machine_type"], r["gpu_type"], r["gpu_count"], r["spot"])
        * r["active_seconds"]
        / 3600
        for r in records
    )
    assert cost["total"] == pytest.approx(expected, rel=0.01)
    assert cost["savings"] > 0 and cost["total"] < cost["on_demand_total"]
    assert sum(cost["per_protocol"].values()) + cost["unattributed"] == pytest.approx(cost["total"], abs=1e-3)
    by_vm = {v["name"]: v for v in cost["per_vm"]}
    assert len(records) == len(by_vm) == 5  # chief, ps, worker 1 and its two replacements
    for record in records:
        assert by_vm[record["name"]]["active_seconds"] == pytest.approx(record["active_seconds"], abs=1.0)
    # The report shows both; the history record carries the cost.
    summary = storage.read_json(f"{layout.report}/summary.json")
    assert summary["cost"]["total"] == cost["total"] and len(summary["cluster_events"]) == len(events)
    record = storage.read_json(JobHistoryLayout.for_job(bucket, "gce").record(dag_run.run_id))
    assert record["cost"]["total"] == cost["total"] and record["cost"]["savings"] == cost["savings"]
    html = storage.read_text(f"{layout.report}/index.html")
    assert "Cluster events" in html and preempted[0] in html and "same VMs on-demand" in html
    assert_nothing_left(fake, bed)


def test_a_chief_vm_gone_for_good_is_replaced_and_the_retry_resumes_on_it_from_the_checkpoint(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path, statsd_here: Any
) -> None:
    """The chief VM (launcher, BSP worker 0 and the only checkpointer; on-demand, so never preempted)
    deleted out of band mid-segment: the next status poll records it revoked, requests its
    replacement and reports the segment ended without a result at once (its launcher went with the
    VM: the segment trigger fails the task without waiting out an unknown status); the
    retry waits for the replacement, pins its host key, starts a fork server there with the token
    from the bucket and resumes from the last checkpoint. The revocation and the replacement are
    metrics; the teardown brings the VMs' logs home before it deletes them (the launcher's, which
    only the teardown uploads)."""
    backend = GceBackend()
    job = JobSpec.from_params(
        # 750 steps past the checkpoint the chief's VM goes at: room for the deletion, however fast.
        conf(bucket, switch_order="1", train_steps=[800], ckpt_frequency=[50], gce=gce_param(gpus="none"))
    )
    layout = RunLayout.for_run(bucket, "gce", "chief-gone")
    handle = backend.provision(job, layout)
    try:
        segment = launch_to_checkpoint(backend, handle, job, layout, 50)
        chief = delete_vm(fake, "-chief")
        ended = backend.segment_status(handle, 0)
        assert (ended.state, ended.exit_code) == ("exited", None), ended
        assert "went with the chief's VM" in backend.segment_log_tail(handle, 0)

        result = relaunch_to_the_end(backend, handle, segment, layout)
        assert result["end_step"] == 800 and result["start_step"] >= 50, result
        vms = read_state(layout)["vms"]
        assert vms[chief]["state"] == "revoked" and not vms[chief]["preempted"]
        replacement = vms[f"{chief}-r1"]
        assert replacement["state"] == "running" and replacement["host_key"].startswith("ssh-ed25519 ")
        assert backend.current(handle)["hosts"][0]["name"] == f"{chief}-r1"
    finally:
        backend.teardown(handle)
    assert_nothing_left(fake, bed)
    samples = statsd_here.received("airflow.syncswitch.cluster.")
    revoked = [s.tags for s in samples if s.name.endswith(".revocations")]
    assert revoked == [{"job_name": "gce", "backend": "gce", "role": "chief", "preempted": "false"}]
    replaced = [s.tags["outcome"] for s in samples if s.name.endswith(".replacements")]
    assert replaced == ["requested", "running"]
    logs = {uri.rsplit("/", 1)[1] for uri in storage.list_files(layout.segment_logs(0, "bsp"))}
    assert {"launcher-0.log", "worker-0.log", "worker-1.log"} <= logs, logs


def test_a_parameter_server_vm_gone_for_good_fails_asp_and_the_retry_resumes_on_its_replacement(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    """ASP's variables live on the parameter server: its VM deleted mid-segment fails the segment (the
    coordinator cannot go on without it), and the retry waits for the replacement and resumes from the
    last checkpoint, with the variables restored onto the new parameter server."""
    backend = GceBackend()
    job = JobSpec.from_params(
        # 1,200 steps past the checkpoint the parameter server's VM goes at: room for the deletion.
        conf(bucket, switch_order="0", train_steps=[1500], ckpt_frequency=[300], gce=gce_param(gpus="none"))
    )
    layout = RunLayout.for_run(bucket, "gce", "ps-gone")
    handle = backend.provision(job, layout)
    try:
        segment = launch_to_checkpoint(backend, handle, job, layout, 300)
        ps = delete_vm(fake, "-ps0")
        wait_until_segment_ended(backend, handle, 0, timeout=300)
        ended = backend.segment_status(handle, 0)
        assert ended.exit_code != 0, ended

        result = relaunch_to_the_end(backend, handle, segment, layout)
        assert result["end_step"] == 1500 and result["start_step"] >= 300, result
        vms = read_state(layout)["vms"]
        assert vms[ps]["state"] == "revoked" and vms[f"{ps}-r1"]["state"] == "running"
    finally:
        backend.teardown(handle)
    assert_nothing_left(fake, bed)


def launch_to_checkpoint(
    backend: GceBackend, handle: dict, job: JobSpec, layout: RunLayout, step: int
) -> SegmentSpec:
    """Launch the job's one segment on the cluster and wait for its checkpoint at ``step``."""
    (segment,) = job.plan(posixpath.basename(layout.root), layout.root)
    backend.launch_segment(handle, segment)
    wait_for(
        lambda: checkpoint_step(layout) >= step, timeout=300, what=f"a checkpoint at step {step}", poll=0.2
    )
    return segment


def relaunch_to_the_end(backend: GceBackend, handle: dict, segment: SegmentSpec, layout: RunLayout) -> dict:
    """Launch the segment again, as its task's retry does; once it has succeeded, its result."""
    launched = backend.launch_segment(handle, segment)
    wait_until_segment_ended(backend, handle, segment.index, timeout=300)
    status = backend.segment_status(handle, segment.index)
    # The testbed's hosts share this machine's disk: the chief's segment folder is readable here.
    seg_dir = Path(launched["log"]).parent
    files = sorted(p.name for p in seg_dir.iterdir()) if seg_dir.is_dir() else "no such folder"
    assert status.exit_code == 0, (
        f"{status}; launched {launched}; {seg_dir}: {files}\n"
        f"{backend.segment_log_tail(handle, segment.index, 40)}"
    )
    return storage.read_json(layout.segment_result(segment.index, segment.protocol))


def delete_vm(fake: FakeComputeEngine, suffix: str) -> str:
    """Delete the VM whose name ends with ``suffix`` through the API, out of band (an operator, or a
    host that is gone for good); returns its name."""
    name = next(n for n in fake.instances() if n.endswith(suffix))
    zone = fake.instances()[name]["zone"].rsplit("/", 1)[1]
    ComputeHook().delete_instance_if_exists(name, zone, PROJECT)
    return name


def test_with_shrink_a_bsp_retry_runs_on_the_survivors_with_the_global_batch_kept(
    fake: FakeComputeEngine, bed: tb.Testbed, bucket: str, work_root: Path
) -> None:
    backend = GceBackend()
    job = JobSpec.from_params(
        conf(
            bucket,
            switch_order="1",
            train_steps=[800],  # 750 steps past the preemption's checkpoint
            ckpt_frequency=[50],
            gce=gce_param(on_revocation="shrink"),
        )
    )
    layout = RunLayout.for_run(bucket, "gce", "shrink")
    handle = backend.provision(job, layout)
    try:
        segment = launch_to_checkpoint(backend, handle, job, layout, 50)
        worker = next(name for name in fake.instances() if name.endswith("-w1"))
        fake.preempt(worker)
        wait_until_segment_ended(backend, handle, 0, timeout=300)
        ended = backend.segment_status(handle, 0)
        assert ended.exit_code not in (0, None), (
            f"the segment ended ({ended.exit_code}) before the preemption"
        )

        result = relaunch_to_the_end(backend, handle, segment, layout)
        state = read_state(layout)
        assert result["end_step"] == 800 and result["start_step"] >= 50
        (shrunk,) = [e for e in state["cluster_events"] if e["kind"] == "shrunk"]
        assert shrunk["workers"] == 1 and shrunk["planned_workers"] == 2
        assert shrunk["hparams"] == f"batch_size={2 * segment.resolved_hparams().batch_size}"
        assert not [name for name in fake.instances() if "-r" in name], "shrink must not replace"
    finally:
        backend.teardown(handle)
    assert_nothing_left(fake, bed)
