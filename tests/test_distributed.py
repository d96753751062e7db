"""The pipeline on a distributed Airflow: PostgreSQL, Redis, the CeleryExecutor, and two Celery workers
on separate testbed hosts, each with a private /tmp (its AIRFLOW_HOME, logs and work folder), sharing
nothing but the bucket (testing/celery_deployment.py). Training runs on three more testbed hosts.

A cluster policy pins consecutive tasks of a run to different workers (queues ``w0`` / ``w1``), so a
task that needed something an earlier task left on its worker's disk would fail here. Needs root
(the testbed), PostgreSQL and Redis; skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testbed as tb
from airflow_runs import (
    DuringRun,
    TaskTimeline,
    checkpoint_step,
    component_pid,
    is_error_line,
    segment_starts,
    task_log,
    task_log_lines,
    wait_for_restart,
)
from airflow_runs import task_instances as run_task_instances
from celery_deployment import PROJECT_DIR, CeleryDeployment, LedgerWatch, missing_prerequisites
from conftest import (
    ANONYMOUS_GOOGLE_CONNECTION,
    BUCKET_CONN_ENV,
    BUCKET_CONN_ID,
    GcsEmulator,
    hosts_for_file,
    new_bucket,
    ssh_connection,
    storage_on_gateway,
)
from fake_compute import FakeComputeEngine
from syncswitch import procs, storage
from syncswitch.events import read_events
from syncswitch.hosts import DEFAULT_WORK_ROOT
from syncswitch.layout import RunLayout, safe_run_id
from syncswitch.state import read_state
from syncswitch_airflow.backends.local import deployment_refusal
from syncswitch_airflow.embedded.airflow_api import AirflowError, AirflowUnavailable
from syncswitch_airflow.embedded.instance import INSTANCE_ENV

pytestmark = [pytest.mark.testbed, pytest.mark.cluster, pytest.mark.airflow]

TRAINING_ROLES = ("chief", "worker", "ps")
PROJECT = "dist-project"
ZONES = "us-central1-a us-central1-b"

# The scheduler side's cluster policy: each task to worker 0 or 1, so that every hand-off of a run
# crosses workers (HAND_OFFS). Two workers cannot alternate every edge of the DAG, which has odd
# cycles (validate -> timing_policy -> plan -> segment 0 <- provision_cluster <- validate): plan and
# segment 0 share worker 0, and report and finalize worker 1; what those pass on is in the metadata
# database (XCom) and the bucket like everything else.
QUEUE_POLICY = """
FIXED = {"validate": 0, "timing_policy": 1, "plan": 0, "provision_cluster": 1,
         "evaluate": 0, "teardown_cluster": 0, "report": 1, "finalize": 1}


def task_policy(task):
    if task.task_id in FIXED:
        task.queue = f"w{FIXED[task.task_id]}"
    elif task.task_id.startswith("segment_"):
        task.queue = f"w{int(task.task_id.split('.')[0].removeprefix('segment_')) % 2}"
"""


# (from, to) tasks whose hand-off is the run's state: the cluster handle from provisioning to the
# first segment and to teardown, each segment's checkpoint and launch to the next one, the last
# checkpoint and the cluster to evaluation and teardown. Both runs below have four segments: BSP,
# ASP (online), ASP, BSP (segment i on worker i % 2).
RUN_TASKS = ("segment_0.bsp", "segment_1.asp", "segment_2.asp", "segment_3.bsp")
HAND_OFFS = (
    ("provision_cluster", RUN_TASKS[0]),
    ("provision_cluster", "teardown_cluster"),
    *itertools.pairwise(RUN_TASKS),
    (RUN_TASKS[-1], "evaluate"),
    (RUN_TASKS[-1], "teardown_cluster"),
)


def assert_hand_offs_cross_workers(tis: dict[str, dict[str, Any]], addresses: dict[int, set[str]]) -> None:
    """Every successful task ran on the worker the policy pinned it to (by address), and each
    hand-off went from one machine to another."""
    ran = {task: ti["hostname"] for task, ti in tis.items() if ti["state"] == "success" and ti["hostname"]}
    for task, hostname in ran.items():
        assert hostname in addresses[expected_worker(task)], (task, hostname, addresses)
    for before, after in HAND_OFFS:
        assert ran[before] != ran[after], (before, after, ran[before])


def assert_no_secret_in_logs(
    deployment: CeleryDeployment, run_id: str, tis: dict[str, dict[str, Any]], private_key: str
) -> None:
    """No task's log (as the UI shows it, from the worker that ran it) holds the hosts' SSH key."""
    body = [line for line in private_key.splitlines() if line and not line.startswith("-----")]
    for task, ti in tis.items():
        if ti["state"] != "success":
            continue
        log = task_log(deployment.airflow.api, run_id, task, ti["try_number"])
        assert "PRIVATE KEY" not in log and not [line for line in body if line in log], task


def expected_worker(task_id: str) -> int:
    """The worker QUEUE_POLICY pins ``task_id`` to."""
    policy: dict[str, Any] = {}
    exec(QUEUE_POLICY, policy)
    task = type("Task", (), {"task_id": task_id, "queue": "default"})()
    policy["task_policy"](task)
    return int(task.queue.removeprefix("w"))


@pytest.fixture(scope="module")
def bed(session_testbed: tb.Testbed) -> Iterator[tb.Testbed]:
    # Two Celery workers, the training hosts, a spare machine for a replacement worker, and one more
    # host for the pool of hosts that two runs share.
    hosts = 2 + len(TRAINING_ROLES) + 1 + 1
    with hosts_for_file(session_testbed, hosts, missing_prerequisites) as testbed:
        yield testbed


@pytest.fixture(scope="module")
def fake(bed: tb.Testbed) -> Iterator[FakeComputeEngine]:
    """The fake Compute Engine API (no emulator exists), on the gateway where the workers reach it;
    its VMs become hosts of this testbed."""
    with FakeComputeEngine(bed, PROJECT, host=bed.gateway) as api:
        yield api
    # The VMs' boot disks are this machine's filesystem: remove what they kept, as deleting them would.
    for folder in Path(DEFAULT_WORK_ROOT).glob("distgce-*"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def gcs(
    bed: tb.Testbed, fake: FakeComputeEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GcsEmulator]:
    """The bucket, and an anonymous Google connection for every component, named by
    ``[syncswitch] gcp_conn_id``: the Compute Engine calls and every bucket call of the tasks and
    triggers go through it (a named connection must exist, so one that did not would fail)."""
    env = {
        BUCKET_CONN_ENV: ANONYMOUS_GOOGLE_CONNECTION,
        # The first training host by an SSH connection (key inline, host key pinned) on every component.
        "AIRFLOW_CONN_TRAINING_HOST_0": ssh_connection(bed, training_testbed_hosts(bed)[0]),
    }
    with storage_on_gateway(bed.gateway, tmp_path_factory.mktemp("dist-gcs"), env) as server:
        yield server


@pytest.fixture(scope="module")
def bucket(gcs: GcsEmulator) -> str:
    return new_bucket("dist")


@pytest.fixture(scope="module")
def deployment(
    bed: tb.Testbed,
    gcs: GcsEmulator,
    fake: FakeComputeEngine,
    bucket: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CeleryDeployment]:
    own = {
        "SYNCSWITCH__GCE_API_ENDPOINT": fake.endpoint,
        "SYNCSWITCH__LEASES_DIR": f"{bucket}/_leases",
        "SYNCSWITCH__GCP_CONN_ID": BUCKET_CONN_ID,
        "SYNCSWITCH__SSH_KNOWN_HOSTS": bed.known_hosts_path,
        # Room for two clusters of hosts at once (the pool test's two runs).
        "SYNCSWITCH__HOSTS_CLUSTERS": "2",
        # A task whose worker was lost is failed (and retried) this long after its last heartbeat.
        "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
        "SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        # The scheduler restarts after PostgreSQL does; the tasks its dead self had queued are adopted
        # (and only then failed for their missing heartbeats) at its next orphan check: every 300 s by
        # default, most of this file's time.
        "SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "15",
        # A lost worker may take a task it had received but not started (the online segment's
        # watcher, queued beside its launch): requeued after a minute.
        "SCHEDULER__TASK_QUEUED_TIMEOUT": "60",
        "SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "10",
    }
    with CeleryDeployment(
        tmp_path_factory.mktemp("celery"), bed, gcs, workers=2, settings=own, local_settings=QUEUE_POLICY
    ) as running:
        yield running


def training_testbed_hosts(bed: tb.Testbed) -> list[tb.TestHost]:
    return bed.hosts[2 : 2 + len(TRAINING_ROLES)]


def bucket_key(bed: tb.Testbed, bucket: str) -> str:
    """The testbed's SSH key as a bucket object (written once): what the hosts' ``key=`` names, so
    that no worker has it on its disk."""
    key = f"{bucket}/keys/training_hosts"
    if not storage.exists(key):
        storage.write_bytes(key, Path(bed.key_path).read_bytes())
    return key


def training_hosts(bed: tb.Testbed, bucket: str) -> list[str]:
    """The training hosts, so that no worker has their SSH key on its disk: the first named by an
    Airflow SSH connection (``training_host_0``), the others with their key a bucket object."""
    key = bucket_key(bed, bucket)
    first, *others = zip(training_testbed_hosts(bed), TRAINING_ROLES, strict=True)
    return [
        f"conn=training_host_0,role={first[1]},name={first[0].name}",
        *(f"address={h.address},key={key},role={role},name={h.name}" for h, role in others),
    ]


def task_instances(deployment: CeleryDeployment, run_id: str) -> dict[str, dict[str, Any]]:
    return run_task_instances(deployment.airflow.api, run_id)


def why_failed(deployment: CeleryDeployment, run_ids: list[str]) -> str:
    """For an assertion message: each run's task states, and the error lines of every failed task's log."""
    lines = []
    scheduler_log = deployment.airflow.home / "logs" / "components" / "scheduler.log"
    for run_id in run_ids:
        tis = task_instances(deployment, run_id)
        lines.append(f"run {run_id}: { ({t: (ti['state'], ti['try_number']) for t, ti in tis.items()}) }")
        for task_id, ti in sorted(tis.items()):
            if ti["state"] in ("failed", "up_for_retry"):
                tries = int(ti.get("try_number") or 1)
                api = deployment.airflow.api
                lines += task_log_lines(api, run_id, task_id, tries, is_error_line, 800)[-15:]
                # A task that the executor or the scheduler failed may have no log of its own.
                about = [f"  scheduler: {line[:400]}" for line in _lines(scheduler_log) if task_id in line]
                lines += [line for line in about if run_id in line][-10:]
    # Airflow 3.2+ has known task_instance deadlocks on PostgreSQL (apache/airflow#66734).
    lines += [
        f"  postgres: {line[:400]}"
        for line in _lines(deployment.root / "logs" / "postgres.log")
        if "ERROR" in line and 'relation "log" does not exist' not in line
    ][-10:]
    return "\n".join(lines)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def why_started_twice(api: Any, run_id: str, layout: RunLayout, tis: dict[str, dict[str, Any]]) -> str:
    """For the assertion message: every segment_start event and what each try of each segment task
    logged about launching and following."""

    def is_about_launching(line: str) -> bool:
        return any(word in line for word in ("launch", "following", "already ended", "error"))

    keys = ("segment", "start_step", "wall_time", "restored")
    starts = [{k: e.get(k) for k in keys} for e in read_events(layout.metrics, event="segment_start")]
    lines = [f"segment_start events: {starts}"]
    for task_id, ti in sorted(tis.items()):
        if task_id.startswith("segment_") and not task_id.endswith("watch_stragglers"):
            tries = int(ti.get("try_number") or 1)
            lines += task_log_lines(api, run_id, task_id, tries, is_about_launching, 400)
    return "a segment was started twice\n" + "\n".join(lines)


def test_the_local_backend_is_refused_by_name_where_tasks_run_on_other_machines() -> None:
    assert deployment_refusal("LocalExecutor") == ""
    assert deployment_refusal("syncswitch_airflow.warm_start.WarmLocalExecutor") == ""  # the embedded one
    assert "cluster_backend" in deployment_refusal(
        "airflow.providers.celery.executors.celery_executor.CeleryExecutor"
    )
    assert "KubernetesExecutor" in deployment_refusal("LocalExecutor,KubernetesExecutor")


def test_only_the_warm_executor_shortens_the_schedulers_idle_sleep(tmp_path: Path) -> None:
    """The WarmLocalExecutor's heartbeat waits 4.8 s of the 5 s idle loop; any other executor (Celery
    here) would spin at its 0.2 s idle sleep."""
    from syncswitch_airflow.embedded.instance import InstanceHome, InstanceRecord

    files = InstanceHome(tmp_path, tmp_path)
    record = InstanceRecord(0, 8080, 8793, 8794, str(tmp_path), 0.0)
    sleep = "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"
    assert files.env(record, {})[sleep] == "0.2"
    assert files.env(record, {"CORE__EXECUTOR": "CeleryExecutor"})[sleep] == "2.0"
    assert files.env(record, {"SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "1.0"})[sleep] == "1.0"


def assert_cluster_gone(
    bed: tb.Testbed, bucket: str, layout: RunLayout, hosts: list[tb.TestHost] | None = None
) -> None:
    """No process of the cluster on its hosts (the training hosts by default; their sshd aside), no
    lease, no secret."""
    for host in training_testbed_hosts(bed) if hosts is None else hosts:
        left = {pid: _cmdline(pid) for pid in bed.processes(host)}
        assert not {p: c for p, c in left.items() if c and not c.startswith(("sshd", "/usr/sbin/sshd"))}
    assert storage.read_json(f"{bucket}/_leases/hosts.json", default={}).get("leases") == {}
    assert not storage.list_files(layout.cluster_secrets)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# The first BSP segment of the online-switch runs: worker 1 at a quarter speed from the start, and
# greedy stops BSP once the detector has seen two flagged 5 s windows (plus the events' lateness).
# At batch 512 a straggled BSP step takes ~1 s here, so the cap leaves greedy ~300 s to decide, some
# 15 times what it needs; the tests assert the decision and the exact workload, not when it came.
ONLINE_BSP_CAP = 300
ONLINE_BATCH = "batch_size=512"


def assert_switched_online_once(run_state: dict[str, Any], total: int) -> None:
    """Greedy switched segment 0 from BSP to ASP once, naming worker 1; segment 0 stopped early at a
    checkpoint and the online ASP went on from exactly there; the whole workload trained, no more."""
    plan = [(e["protocol"], e["origin"]) for e in run_state["plan"]]
    assert plan == [("bsp", "plan"), ("asp", "online"), ("asp", "plan"), ("bsp", "plan")], plan
    [decision] = [d for d in run_state["decisions"] if d["action"] != "stay"]
    assert (decision["action"], decision["workers"]) == ("switch", [1]), run_state["decisions"]
    segments = run_state["segments"]
    stopped_at = segments["0"]["end_step"]
    assert segments["0"]["stopped_early"] and 0 < stopped_at < ONLINE_BSP_CAP, segments["0"]
    assert stopped_at == run_state["plan"][0]["until_step"] == segments["1"]["start_step"], segments
    assert segments["1"]["end_step"] == ONLINE_BSP_CAP
    assert segments["3"]["end_step"] == total


# Its run took 200-380 s after the deployment's 90-190 s start on CI and here, and over 660 s on a machine
# half as fast (TensorFlow's import 8.3 s of CPU against 3.6): the limits are for a run that hangs.
@pytest.mark.timeout(1800)
def test_101_with_an_online_switch_moves_between_workers_and_survives_a_lost_worker_scheduler_and_db(
    deployment: CeleryDeployment, bed: tb.Testbed, bucket: str
) -> None:
    """ "101" on the hosts backend with greedy and a persistent straggler (worker 1 at a quarter speed):
    BSP is stopped for ASP online, then the plan goes on. Each task runs on the worker the policy
    pins it to, whose disk no other task sees: the SSH keys are in an Airflow connection and a bucket
    object, the cluster's token, the capacity lease and the run's state in the bucket (reached through
    the ``gcp_conn_id`` connection). Meanwhile the deployment loses
    parts of itself:

    1. worker 0 is lost while segment 0's task waits deferred (the segment trains on the hosts): the
       segment goes on untouched; the worker comes back as a new machine, with an empty disk;
    2. worker 1 is lost while it runs the online ASP segment's task (which follows the segment that
       segment 0's trigger launched, or launches it): Airflow fails that try once its heartbeat is
       missed, and the retry runs on a replacement worker on another machine, which finds the
       segment running (or ended) and follows it (or records it); a task the lost worker
       had received but not started (the segment's watcher, at times) is requeued by the scheduler;
    3. PostgreSQL is restarted while that happens;
    4. the scheduler is killed once the online segment's task is done, while segments 2 and 3 are
       to run (its supervisor starts it again).
    The run succeeds, each segment is started once (no training lost or repeated), and nothing of
    the cluster is left."""
    conf = {
        "job_name": "dist",
        "cluster_backend": "hosts",
        "hosts": training_hosts(bed, bucket),
        "bucket_dir": f"{bucket}/runs",
        "switch_order": "101",
        # BSP runs until greedy decides, under a generous cap (ONLINE_BSP_CAP); the ASP that follows
        # (online to the cap, then 100 planned) still trains while the faults below come. The last
        # BSP, which no fault waits for, is short.
        "train_steps": [ONLINE_BSP_CAP, 100, 20],
        # Greedy's stop lands on segment 0's next checkpoint, and the first fault waits for its first.
        "ckpt_frequency": [5, 100, 10],
        "num_workers": 2,
        "num_ps": 1,
        "online_policy": "greedy",
        "max_online_switches": 1,
        "stragglers": ["worker=1,start=0,duration=3600,slowdown=4"],
        "hparams": [ONLINE_BATCH],
        "stall_seconds": 300,
    }
    api = deployment.airflow.api
    run_id = api.trigger("sync_switch", conf)
    layout = RunLayout.for_run(f"{bucket}/runs", "dist", run_id)
    spare = bed.hosts[2 + len(TRAINING_ROLES)]
    addresses = {
        0: {deployment.worker_hosts[0].address},
        1: {deployment.worker_hosts[1].address, spare.address},
    }

    def task_state(task_id: str) -> str | None:
        try:
            return api.task_states("sync_switch", run_id).get(task_id)
        except (OSError, AirflowUnavailable):  # while PostgreSQL restarts
            return None

    def faults(run: DuringRun) -> None:
        run.wait(
            lambda: task_state("segment_0.bsp") == "deferred" and checkpoint_step(layout) >= 5,
            "segment 0 deferred, past its first checkpoint",
        )
        deployment.kill_worker(0)
        restarted = threading.Thread(target=deployment.start_worker, args=(0,))
        restarted.start()
        run.wait(lambda: task_state("segment_1.asp") == "running", "the online segment's task running")
        deployment.kill_worker(1)
        deployment.restart_postgres(down_seconds=5.0)
        deployment.start_worker(1, host=spare)
        restarted.join()
        # Segment 2 may have been launched by segment 1's trigger and ended before its own task ran.
        run.wait(lambda: task_state("segment_1.asp") == "success", "the online segment's task done")
        scheduler = component_pid(deployment.airflow, "scheduler")
        os.kill(scheduler, signal.SIGKILL)
        wait_for_restart(deployment.airflow, "scheduler", scheduler)

    during, timeline = DuringRun(faults).start(), TaskTimeline()
    try:
        # Under the test's timeout with the deployment's start: a run that does not end fails with
        # where it stood rather than with the stack of this wait.
        state = api.wait("sync_switch", run_id, timeout=1500, on_poll=timeline)
    except AirflowError as exc:
        pytest.fail(f"{exc}; the faults script waited for: {during.waiting_for}\n{timeline}")
    finally:
        during.stop()
    tis = task_instances(deployment, run_id)
    assert state == "success", why_failed(deployment, [run_id])

    run_state = read_state(layout)
    assert_switched_online_once(run_state, total=ONLINE_BSP_CAP + 120)
    starts = segment_starts(layout)
    assert starts == {0: 1, 1: 1, 2: 1, 3: 1}, why_started_twice(api, run_id, layout, tis)

    # Every task ran on the worker the policy pinned it to, and every hand-off crossed machines; the
    # lost launch was retried on the replacement machine.
    assert_hand_offs_cross_workers(tis, addresses)
    assert tis["segment_1.asp"]["try_number"] == 2 and tis["segment_1.asp"]["hostname"] == spare.address
    assert_no_secret_in_logs(deployment, run_id, tis, Path(bed.key_path).read_text())
    assert_cluster_gone(bed, bucket, layout)


def test_101_with_an_online_switch_on_compute_engine_vms_with_every_hand_off_across_workers(
    deployment: CeleryDeployment, fake: FakeComputeEngine, bucket: str
) -> None:
    """The gce backend (its fake API): the run's VMs, firewall rule and SSH key are made by one worker
    and used, then deleted, by others: the key is in the run's bucket folder, never on a worker.
    Greedy stops BSP for ASP online under a persistent straggler on the VMs, and the plan goes on."""
    conf = {
        "job_name": "distgce",
        "cluster_backend": "gce",
        "bucket_dir": f"{bucket}/runs",
        "num_workers": 2,
        "num_ps": 1,
        # The VMs share this machine's filesystem and users: the runtime is this interpreter's.
        "gce": {
            "project": PROJECT,
            "zones": ZONES,
            "gpus": "t4",
            "python": sys.executable,
            "ssh_user": "root",
        },
        "switch_order": "101",
        # BSP runs until greedy decides, under a generous cap; the planned segments after the online
        # ASP are short: no fault waits for them here.
        "train_steps": [ONLINE_BSP_CAP, 30, 10],
        "ckpt_frequency": [5, 30, 10],
        "online_policy": "greedy",
        "max_online_switches": 1,
        "stragglers": ["worker=1,start=0,duration=3600,slowdown=4"],
        "hparams": [ONLINE_BATCH],
    }
    api = deployment.airflow.api
    run_id = api.trigger("sync_switch", conf)
    state = api.wait("sync_switch", run_id, timeout=1500)
    tis = task_instances(deployment, run_id)
    assert state == "success", why_failed(deployment, [run_id])
    layout = RunLayout.for_run(f"{bucket}/runs", "distgce", run_id)
    run_state = read_state(layout)
    assert_switched_online_once(run_state, total=ONLINE_BSP_CAP + 40)
    addresses = {i: {deployment.worker_hosts[i].address} for i in (0, 1)}
    assert_hand_offs_cross_workers(tis, addresses)
    assert fake.instances() == {} and fake.firewalls() == {}
    assert storage.read_json(f"{bucket}/_leases/gce.json", default={}).get("leases") == {}
    assert not storage.list_files(layout.cluster_secrets)
    assert run_state["cost"]["total"] > 0  # the ledger of VMs that other workers created
    # The api-server reads a task's log from the log server of the worker that ran it (one API
    # secret key for all: otherwise a 403 and Airflow's "same secret_key" hint instead of the log).
    log = task_log(deployment.airflow.api, run_id, "provision_cluster")
    assert "secret_key" not in log and f"run {run_id}" in log, log[-2000:]


def test_two_runs_at_once_take_disjoint_hosts_of_a_pool_and_both_succeed(
    deployment: CeleryDeployment, bed: tb.Testbed, bucket: str
) -> None:
    """Two runs of one job triggered together on a pool of four hosts, two per cluster
    (``hosts_per_cluster``), with room for two clusters (``[syncswitch] hosts_clusters``): the
    deployment's ledger (a bucket object, polled every 0.5 s) never names a host in two leases, the two
    clusters are held at the same time, and both runs succeed, each on its own two hosts, with no
    lease left. Their reports, which end at about the same moment, create the job's assets."""
    key = bucket_key(bed, bucket)
    pool = training_testbed_hosts(bed) + [bed.hosts[2 + len(TRAINING_ROLES) + 1]]
    conf = {
        "job_name": "pooled",
        "cluster_backend": "hosts",
        "hosts": [f"address={h.address},key={key},name={h.name}" for h in pool],
        "hosts_per_cluster": 2,
        "bucket_dir": f"{bucket}/runs",
        "switch_order": "10",
        "train_steps": [60, 60],
        "num_workers": 2,
        "num_ps": 1,
    }
    api = deployment.airflow.api
    with LedgerWatch(f"{bucket}/_leases/hosts.json") as ledger:
        run_ids = [api.trigger("sync_switch", conf) for _ in range(2)]
        states = {run_id: api.wait("sync_switch", run_id, timeout=900) for run_id in run_ids}
    assert set(states.values()) == {"success"}, why_failed(deployment, run_ids)
    assert ledger.shared == [], f"a host in two leases at once: {ledger.shared}"
    assert ledger.most_at_once() == 2, ledger.held
    # The reports, which create the new job's assets, ran one after the other (a race lost on
    # PostgreSQL's unique index failed one before: dag_factory).
    reports = sorted(
        (ti["start_date"], ti["end_date"])
        for ti in (task_instances(deployment, r)["report"] for r in run_ids)
    )
    assert reports[0][1] <= reports[1][0], reports
    held = [ledger.held[safe_run_id(run_id)]["hosts"] for run_id in run_ids]
    assert all(len(hosts) == 2 for hosts in held) and not held[0] & held[1], held
    assert held[0] | held[1] <= {h.address for h in pool}
    for run_id in run_ids:
        layout = RunLayout.for_run(f"{bucket}/runs", "pooled", run_id)
        assert [read_state(layout)["segments"][str(i)]["end_step"] for i in range(2)] == [60, 120]
        assert_cluster_gone(bed, bucket, layout, pool)


def test_the_deployment_shares_one_fernet_key_and_one_api_secret_key(deployment: CeleryDeployment) -> None:
    for name in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API__SECRET_KEY"):
        keys = {deployment.airflow.env()[name]} | {deployment.worker_env(i)[name] for i in deployment.workers}
        assert len(keys) == 1 and keys != {""}, name


def test_every_component_runs_the_installed_packages_and_no_worker_sees_the_checkout(
    deployment: CeleryDeployment,
) -> None:
    """The runtime and the provider come from their wheels, as a deployment installs them: the DAG is
    the installed provider's file, every Airflow process (scheduler side and workers) loads its
    libraries from the installation's virtualenv, and a worker's view of the machine has no checkout
    in it, so no task of the runs above can have used one."""
    installation = deployment.installation
    dag = deployment.airflow.api.get_json("/api/v2/dags/sync_switch/details")
    assert Path(dag["fileloc"]).parent == installation.dags_folder
    for index in deployment.workers:
        assert not deployment.worker_file(index, str(PROJECT_DIR / "README.md")).exists(), index
        assert deployment.worker_file(index, str(installation.dags_folder / "sync_switch.py")).exists()
    marker = deployment.airflow.env()[INSTANCE_ENV]
    processes = procs.processes_with_env(INSTANCE_ENV, marker)
    environments = {p.pid: _environments_mapped(p.pid) for p in processes}
    assert len(environments) >= 4 + len(deployment.workers), environments  # components and workers
    assert {env for found in environments.values() for env in found} == {str(installation.venv)}, environments


def test_every_worker_forked_its_pool_with_warm_imports_and_prompt_reaping(
    deployment: CeleryDeployment,
) -> None:
    """``syncswitch_airflow.celery_config`` took effect in each worker's main process before its pool
    forked (Celery's ``worker_init``), as the worker's own log line says once it is ready."""
    for index, worker in deployment.workers.items():
        text = worker.log_text()
        assert "task processes start warm" in text and "are reaped as they exit" in text, (
            index,
            text[-3000:],
        )


def _environments_mapped(pid: int) -> set[str]:
    """The Python environments whose site-packages a process has shared libraries mapped from."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    paths = [line.split()[-1] for line in maps.splitlines() if "/site-packages/" in line]
    return {path.split("/lib/python")[0] for path in paths}
