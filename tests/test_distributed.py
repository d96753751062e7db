"""The pipeline on a distributed Airflow: PostgreSQL, Redis, the CeleryExecutor, and two Celery workers
on separate testbed hosts, each with a private /tmp (its AIRFLOW_HOME, logs and work folder), sharing
nothing but the bucket (scripts/celery_deployment.py). Training runs on three more testbed hosts.

A cluster policy pins consecutive tasks of a run to different workers (queues ``w0`` / ``w1``), so a
task that needed something an earlier task left on its worker's disk would fail here. Needs root
(the testbed), PostgreSQL and Redis; skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testbed as tb
from celery_deployment import CeleryDeployment, missing_prerequisites
from conftest import GcsEmulator, new_bucket, storage_on_gateway
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.state import read_state
from syncswitch_airflow.backends.local import deployment_refusal

pytestmark = [pytest.mark.testbed, pytest.mark.cluster, pytest.mark.airflow]

_RUN_ID = os.getpid() % 10000
TRAINING_ROLES = ("chief", "worker", "ps")

# The scheduler side's cluster policy: each task to worker 0 or 1, alternating along the run, so that
# every task runs on another worker than the one before it (segment i on worker i % 2).
QUEUE_POLICY = """
FIXED = {"validate": 0, "timing_policy": 1, "provision_cluster": 0, "plan": 1,
         "evaluate": 1, "report": 0, "teardown_cluster": 1, "finalize": 0}


def task_policy(task):
    if task.task_id in FIXED:
        task.queue = f"w{FIXED[task.task_id]}"
    elif task.task_id.startswith("segment_"):
        task.queue = f"w{int(task.task_id.split('.')[0].removeprefix('segment_')) % 2}"
"""


def expected_worker(task_id: str) -> int:
    """The worker QUEUE_POLICY pins ``task_id`` to."""
    policy: dict[str, Any] = {}
    exec(QUEUE_POLICY, policy)
    task = type("Task", (), {"task_id": task_id, "queue": "default"})()
    policy["task_policy"](task)
    return int(task.queue.removeprefix("w"))


@pytest.fixture(scope="module")
def bed() -> Iterator[tb.Testbed]:
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    testbed = tb.Testbed(f"sdi{_RUN_ID}", 2 + len(TRAINING_ROLES))
    testbed.up()
    try:
        yield testbed
    finally:
        testbed.down()


@pytest.fixture(scope="module")
def gcs(bed: tb.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    with storage_on_gateway(bed.gateway, tmp_path_factory.mktemp("dist-gcs")) as server:
        yield server


@pytest.fixture(scope="module")
def bucket(gcs: GcsEmulator) -> str:
    return new_bucket("dist")


@pytest.fixture(scope="module")
def deployment(
    bed: tb.Testbed, gcs: GcsEmulator, bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryDeployment]:
    own = {
        "SYNCSWITCH__LEASES_DIR": f"{bucket}/_leases",
        "SYNCSWITCH__SSH_KNOWN_HOSTS": bed.known_hosts_path,
    }
    with CeleryDeployment(
        tmp_path_factory.mktemp("celery"), bed, gcs, workers=2, settings=own, local_settings=QUEUE_POLICY
    ) as running:
        yield running


def training_hosts(bed: tb.Testbed, bucket: str) -> list[str]:
    """The training hosts, their SSH key a bucket object: no worker has it on its disk."""
    key = f"{bucket}/keys/training_hosts"
    if not storage.exists(key):
        storage.write_bytes(key, Path(bed.key_path).read_bytes())
    return [
        f"address={h.address},key={key},role={role},name={h.name}"
        for h, role in zip(bed.hosts[2:], TRAINING_ROLES, strict=True)
    ]


def task_instances(deployment: CeleryDeployment, run_id: str) -> dict[str, dict[str, Any]]:
    body = deployment.airflow.api.get_json(
        f"/api/v2/dags/sync_switch/dagRuns/{run_id}/taskInstances?limit=100"
    )
    return {ti["task_id"]: ti for ti in body["task_instances"]}


def test_the_local_backend_is_refused_by_name_where_tasks_run_on_other_machines() -> None:
    assert deployment_refusal("LocalExecutor") == ""
    assert "cluster_backend" in deployment_refusal(
        "airflow.providers.celery.executors.celery_executor.CeleryExecutor"
    )
    assert "KubernetesExecutor" in deployment_refusal("LocalExecutor,KubernetesExecutor")


def test_101_with_an_online_switch_runs_with_every_task_on_another_worker_than_the_one_before(
    deployment: CeleryDeployment, bed: tb.Testbed, bucket: str
) -> None:
    """ "101" on the hosts backend with greedy and a persistent straggler (worker 1 at a quarter speed):
    BSP is stopped for ASP online, then the plan goes on. Each task runs on the worker the policy
    says, whose disk no other task sees: the cluster's token, the capacity lease and the run's state
    are all in the bucket."""
    conf = {
        "job_name": "dist",
        "cluster_backend": "hosts",
        "hosts": training_hosts(bed, bucket),
        "bucket_dir": f"{bucket}/runs",
        "switch_order": "101",
        # BSP runs long enough at a quarter speed for greedy to see the straggler (two 5 s windows).
        "train_steps": [1500, 200, 100],
        "ckpt_frequency": [100, 100, 50],
        "num_workers": 2,
        "num_ps": 1,
        "online_policy": "greedy",
        "max_online_switches": 1,
        "stragglers": ["worker=1,start=0,duration=3600,slowdown=4"],
        "stall_seconds": 180,
    }
    api = deployment.airflow.api
    run_id = api.trigger("sync_switch", conf)
    state = api.wait("sync_switch", run_id, timeout=1500)
    tis = task_instances(deployment, run_id)
    assert state == "success", {t: ti["state"] for t, ti in tis.items()}

    layout = RunLayout.for_run(f"{bucket}/runs", "dist", run_id)
    run_state = read_state(layout)
    plan = [(e["protocol"], e["origin"]) for e in run_state["plan"]]
    assert plan == [("bsp", "plan"), ("asp", "online"), ("asp", "plan"), ("bsp", "plan")], plan
    assert run_state["decisions"][0]["workers"] == [1]
    assert run_state["segments"]["3"]["end_step"] == 1800

    # Every task that ran did so on the worker the policy pinned it to (by address), and both ran some.
    addresses = [h.address for h in deployment.worker_hosts]
    ran = {task: ti["hostname"] for task, ti in tis.items() if ti["state"] == "success" and ti["hostname"]}
    for task, hostname in ran.items():
        assert hostname == addresses[expected_worker(task)], (task, hostname, addresses)
    assert {ran["provision_cluster"], ran["teardown_cluster"]} == set(addresses)

    # Nothing of the cluster is left: no process on the training hosts, no lease, no secret.
    for host in bed.hosts[2:]:
        assert not [p for p in bed.processes(host) if "syncswitch" in _cmdline(p)], host.name
    assert storage.read_json(f"{bucket}/_leases/hosts.json", default={}).get("leases") == {}
    assert not storage.list_files(layout.cluster_secrets)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_deployment_shares_one_fernet_key(deployment: CeleryDeployment) -> None:
    keys = {deployment.airflow.env()["AIRFLOW__CORE__FERNET_KEY"]}
    keys |= {deployment.worker_env(i)["AIRFLOW__CORE__FERNET_KEY"] for i in deployment.workers}
    assert len(keys) == 1
