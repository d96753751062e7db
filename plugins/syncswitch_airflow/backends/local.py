"""The local cluster backend: a run's training processes on this machine, one work folder per run.

Work folder (``[syncswitch] work_dir`` or ``<tmp>/syncswitch``, then ``<job_name>-<run_id>``)::

    cluster.json                  the handle
    forkserver/                   the cluster's fork server (syncswitch.forkserver): TensorFlow imported
                                  once, every segment's processes forked from it warm; forked from
                                  the standby server where the cluster claimed it
    data/                         data staged from a bucket (``--data-cache``), reused by every segment
    segments/seg-<ii>/spec.json   the SegmentSpec given to ``syncswitch train --spec``
    segments/seg-<ii>/process.json  pid, process group and start time of the launch
    segments/seg-<ii>/launcher.log  the launcher's stdout and stderr (all attempts, appended)
    segments/seg-<ii>/exitcode      written by the wrapper (syncswitch.supervise) when the launcher exits
    segments/seg-<ii>/scratch/      the launcher's --work-dir: node logs

Every process of a run carries ``SYNCSWITCH_CLUSTER_DIR=<work folder>`` in its environment: the fork
server and launchers are started with it, and forked nodes inherit the server's. Teardown finds the
run's processes by that marker as well as by the process groups it started, so a process that left its
group, or whose launcher was SIGKILLed, is still found.

A standby fork server (``<work root>/standby-forkserver``) has imported TensorFlow before any run
asks: the process that keeps it (the embedded Airflow's WarmLocalExecutor, ``StandbyForkServer``)
starts one whenever none runs and no local cluster trains, in a session of its own, and it dies with
that process. Provisioning claims it (``forkserver_client.claim``): the standby forks the cluster's
server into the cluster's folder with the cluster's marker, so teardown finds it and its nodes as it
finds a server the cluster started, and stands by for the next cluster. So one import serves every
local run while its keeper lives. Without one (none kept, or still importing after
STANDBY_CLAIM_WAIT_S) provisioning starts the cluster's own; the first segment's nodes then wait for
its import, on the path to the run's first step.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import subprocess
import sys
import time
from typing import Any

from syncswitch import forkserver_client, nodelogs, supervise
from syncswitch.layout import RunLayout
from syncswitch.procs import ENV_PLACEHOLDER, mem_available_gb, processes_with_env
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow import settings
from syncswitch_airflow.backends.base import (
    CLUSTER_ENV,
    SEGMENT_ENV,
    ClusterCapacity,
    ClusterError,
    Handle,
    SegmentAlreadyRunning,
    SegmentStatus,
    default_work_root,
    distributed_executors,
)

# How many local clusters may run at once. Each takes every core of a small machine, so one.
CAPACITY_SETTING = "local_clusters"
STANDBY_SETTING = "local_standby_forkserver"
STANDBY_FOLDER = "standby-forkserver"
# How long provisioning waits for a standby server that is still importing before it starts its own.
STANDBY_CLAIM_WAIT_S = 60.0
GB_PER_TF_PROCESS = 0.9  # a TF process's peak resident memory, with headroom
TEARDOWN_GRACE_S = 15.0
# A cluster with no process and no write for this long is gone (its run abandoned): its slot is freed.
# Between segments and retries a live run's cluster has no process for seconds to a minute. An
# abandoned cluster's fork server exits after forkserver.IDLE_EXIT_S without a node, so its slot is
# free that much later again.
IDLE_CLUSTER_GONE_S = 900.0

log = logging.getLogger(__name__)


def cluster_environment(**extra: str) -> dict[str, str]:
    """This process's environment without Airflow's own variables, plus ``extra``.

    Cluster processes outlive the Airflow task that starts them, and Airflow itself: the embedded
    Airflow finds (and on stop kills) its processes by AIRFLOW_HOME, so training must not carry it.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    return {**env, **extra}


class LocalBackend:
    """Processes on this host, reached through their work folder; holds no state between calls."""

    name = "local"

    def __init__(self, work_root: str | None = None, gb_per_process: float = GB_PER_TF_PROCESS) -> None:
        self.work_root = os.path.abspath(work_root or default_work_root())
        self.gb_per_process = gb_per_process

    # ---- cluster ---------------------------------------------------------------------------------

    def capacity(self) -> ClusterCapacity:
        # Local clusters live on this machine: their ledger does too, in this worker's work folder.
        return ClusterCapacity(
            os.path.join(self.work_root, "leases", f"{self.name}.json"),
            settings.get_int(CAPACITY_SETTING),
            _cluster_gone,
            CAPACITY_SETTING,
            self.name,
        )

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        """Take a cluster slot (ClusterBusy when none is free), then the cluster's folder and its fork
        server. Idempotent for the same run."""
        run = posixpath.basename(layout.root)
        work_dir = os.path.join(self.work_root, f"{job.job_name}-{run}")
        capacity = self.capacity()
        capacity.claim(run, work_dir)
        try:
            return self._provision(job, layout, run, work_dir)
        except BaseException:
            capacity.release(run)
            raise

    def _provision(self, job: JobSpec, layout: RunLayout, run: str, work_dir: str) -> Handle:
        # The chief plus every worker and parameter server runs TensorFlow (forked from the fork
        # server, which holds one more copy of the imported libraries).
        processes = 1 + job.num_workers + job.num_ps
        self._check_memory(processes + 1)
        os.makedirs(os.path.join(work_dir, "segments"), exist_ok=True)
        handle: Handle = {
            "backend": self.name,
            "run": run,
            "run_dir": layout.root,
            "work_dir": work_dir,
            "forkserver_dir": os.path.join(work_dir, "forkserver"),
            "host": "127.0.0.1",
            "processes": processes,
        }
        supervise.write_json(os.path.join(work_dir, "cluster.json"), handle)
        self._start_forkserver(handle)
        log.info("run %s: provisioned local cluster (%d processes) in %s", run, processes, work_dir)
        return handle

    def _start_forkserver(self, handle: Handle) -> None:
        """Claim the standby fork server, or start the cluster's own unless one runs already
        (provision is idempotent). A new one imports TensorFlow in the background; the first
        segment's launcher waits for it."""
        server_dir = handle["forkserver_dir"]
        if forkserver_client.status(server_dir) != forkserver_client.ABSENT:
            return
        marker = {CLUSTER_ENV: handle["work_dir"]}
        claimed = forkserver_client.claim(self.standby_dir, server_dir, marker, timeout=STANDBY_CLAIM_WAIT_S)
        if claimed is not None:
            log.info("run %s: claimed the standby fork server (pid %d)", handle.get("run"), claimed)
            return
        server = forkserver_client.start(server_dir, env=cluster_environment(**marker))
        log.info("run %s: started the cluster's fork server (pid %d)", handle.get("run"), server.pid)

    @property
    def standby_dir(self) -> str:
        return os.path.join(self.work_root, STANDBY_FOLDER)

    def _check_memory(self, processes: int) -> None:
        needed = processes * self.gb_per_process
        available = mem_available_gb()
        if available is not None and needed > available:
            raise ClusterError(
                f"the local cluster needs about {needed:.1f} GB ({processes} TensorFlow processes x "
                f"{self.gb_per_process} GB) but only {available:.1f} GB of memory is available; "
                "lower num_workers / num_ps or free memory"
            )

    def teardown(self, handle: Handle) -> dict[str, Any]:
        """SIGTERM every process of the run, SIGKILL what is left after a grace, verify, free the folder."""
        work_dir = handle["work_dir"]
        records = supervise.launch_records(os.path.join(work_dir, "segments"))
        outcome = supervise.ProcessScope(records, CLUSTER_ENV, work_dir).stop(TEARDOWN_GRACE_S)
        if outcome["leftovers"]:
            raise ClusterError(f"run {handle.get('run')}: processes survived SIGKILL: {outcome['leftovers']}")
        # A fork server started a moment ago may not show its environment to that scan yet.
        late_server = forkserver_client.kill_started(handle["forkserver_dir"])
        terminated = outcome["stopped"] + ([late_server] if late_server is not None else [])
        upload_logs(handle.get("run"), work_dir)
        shutil.rmtree(work_dir, ignore_errors=True)
        self.capacity().release(handle.get("run", ""))
        log.info(
            "run %s: teardown stopped %d process(es), removed %s",
            handle.get("run"),
            len(terminated),
            work_dir,
        )
        return {"work_dir": work_dir, "stopped_pids": terminated, "work_dir_removed": True}

    # ---- segments --------------------------------------------------------------------------------

    def segment_dir(self, handle: Handle, index: int) -> str:
        return os.path.join(handle["work_dir"], "segments", f"seg-{index:02d}")

    def launch_segment(self, handle: Handle, spec: SegmentSpec) -> dict[str, Any]:
        seg_dir = self.segment_dir(handle, spec.index)
        spec_path = os.path.join(seg_dir, "spec.json")
        # The launcher's scratch (node logs, staged data) lives in the work folder that teardown frees.
        scratch = os.path.join(seg_dir, "scratch")
        command = [
            sys.executable,
            "-m",
            "syncswitch.cli",
            "train",
            "--spec",
            spec_path,
            "--work-dir",
            scratch,
            "--forkserver",
            handle["forkserver_dir"],
            # Staged once per cluster: a switch does not download the run's data again.
            "--data-cache",
            os.path.join(handle["work_dir"], "data"),
        ]
        return self.launch_command(handle, spec.index, command, {"spec.json": spec.to_json()})

    def launch_command(
        self, handle: Handle, index: int, command: list[str], files: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Write ``files`` into the segment's folder and start ``command`` as segment ``index``:
        detached, in its own session, under the exit-code wrapper, with the run's marker in its
        environment. Refused (ClusterError), writing nothing, while the segment runs already."""
        seg_dir = self.segment_dir(handle, index)
        env = cluster_environment(
            **{CLUSTER_ENV: handle["work_dir"], SEGMENT_ENV: seg_dir, "PYTHONUNBUFFERED": "1"}
        )
        try:
            record = {"index": index, **supervise.launch(seg_dir, command, env, SEGMENT_ENV, files)}
        except supervise.SegmentRunning:
            message = f"run {handle.get('run')}: segment {index} is already running"
            raise SegmentAlreadyRunning(message) from None
        log.info(
            "run %s: launched segment %d (pid %d), log %s",
            handle.get("run"),
            index,
            record["pid"],
            record["log"],
        )
        return record

    def segment_status(self, handle: Handle, index: int) -> SegmentStatus:
        answer = supervise.status(self.segment_dir(handle, index), SEGMENT_ENV)
        return SegmentStatus(answer["state"], exit_code=answer["exit_code"], pid=answer["pid"])

    def segment_log_tail(self, handle: Handle, index: int, lines: int = 20) -> str:
        return supervise.log_tail(self.segment_dir(handle, index), lines)

    def stop_segment(self, handle: Handle, index: int, grace_seconds: float = 30.0) -> list[int]:
        seg_dir = self.segment_dir(handle, index)
        scope = supervise.ProcessScope(supervise.launch_records(seg_dir), SEGMENT_ENV, seg_dir)
        outcome = scope.stop(grace_seconds)
        if outcome["leftovers"]:
            raise ClusterError(
                f"run {handle.get('run')}: segment {index} processes survived: {outcome['leftovers']}"
            )
        if outcome["stopped"]:
            log.info(
                "run %s: stopped segment %d (%d process(es))",
                handle.get("run"),
                index,
                len(outcome["stopped"]),
            )
        return outcome["stopped"]


class StandbyForkServer:
    """Keeps one standby fork server for the next local cluster (see the module's docstring): the
    owner (a long-lived process: the WarmLocalExecutor in the scheduler) calls ``keep`` now and then
    and ``stop`` when it ends. A server it started dies with it."""

    def __init__(self, backend: LocalBackend | None = None) -> None:
        self.backend = backend or LocalBackend()
        self.started: list[subprocess.Popen] = []  # reaped once they end

    def keep(self) -> int | None:
        """Start a standby server unless one runs, a local cluster is up (the import would take the
        cores it trains on) or ``[syncswitch] local_standby_forkserver`` is 0; its pid if started."""
        self._reap_ended()
        standby_dir = self.backend.standby_dir
        if (
            not settings.get_int(STANDBY_SETTING)
            or forkserver_client.status(standby_dir) != forkserver_client.ABSENT
        ):
            return None
        if self.backend.capacity().holders():
            return None
        try:
            self.backend._check_memory(1)
        except ClusterError:
            return None
        shutil.rmtree(standby_dir, ignore_errors=True)  # what a dead one left
        env = cluster_environment(**{CLUSTER_ENV: ENV_PLACEHOLDER})
        server = forkserver_client.start(standby_dir, env=env, die_with_parent=True, standby=True)
        self.started.append(server)
        log.info("started a standby fork server (pid %d) in %s", server.pid, standby_dir)
        return server.pid

    def stop(self) -> int | None:
        """Kill the standby server (not the servers it forked for clusters: those are the clusters');
        its pid."""
        pid = forkserver_client.kill_started(self.backend.standby_dir)
        shutil.rmtree(self.backend.standby_dir, ignore_errors=True)
        self._reap_ended()
        return pid

    def _reap_ended(self) -> None:
        self.started = [p for p in self.started if p.poll() is None]


def upload_logs(run: str | None, work_dir: str) -> list[str]:
    """The logs of a cluster folder that the run folder lacks, uploaded before the folder goes (what
    a launcher killed before its own upload left; the launchers' logs). Never raises: the teardown
    goes on without them."""
    try:
        uploaded = nodelogs.upload_folder(work_dir)
    except Exception as exc:  # noqa: BLE001 - a log must not keep a cluster alive
        log.warning("run %s: node logs in %s not uploaded: %s", run, work_dir, exc)
        return []
    if uploaded:
        log.info("run %s: teardown uploaded %d log(s) to the run folder", run, len(uploaded))
    return uploaded


def deployment_refusal(executors: str) -> str:
    """Why a local cluster cannot work under ``[core] executor`` = ``executors`` ("" if it can).

    A local cluster lives on the Airflow worker that provisioned it (its processes, its fork server,
    its folder), and a later task of the run that lands on another worker could not reach it. So a
    deployment whose executors run tasks on other machines (Celery, Kubernetes, Edge ...) refuses
    the local backend when it validates, before anything is provisioned."""
    distributed = distributed_executors(executors)
    if not distributed:
        return ""
    return (
        f"cluster_backend: 'local' runs the cluster on the Airflow worker that provisions it, but this "
        f"Airflow runs tasks on other machines too ([core] executor: {', '.join(distributed)}); "
        "use 'hosts' or 'gce'"
    )


def _cluster_gone(lease: dict[str, Any]) -> bool:
    """A local cluster lives while its fork server or any process of it does, or while its folder was
    written to lately: a live run's cluster has no process only between segments and retries."""
    cluster_dir = lease.get("cluster_dir", "")
    if forkserver_client.status(os.path.join(cluster_dir, "forkserver")) != forkserver_client.ABSENT:
        return False
    if processes_with_env(CLUSTER_ENV, cluster_dir):
        return False
    return time.time() - _last_write(cluster_dir) >= IDLE_CLUSTER_GONE_S


def _last_write(folder: str) -> float:
    """The newest modification time of ``folder`` or anything in it (0 when it is gone)."""
    newest = 0.0
    for root, dirs, files in os.walk(folder):
        for path in [root, *(os.path.join(root, name) for name in (*dirs, *files))]:
            try:
                newest = max(newest, os.stat(path).st_mtime)
            except OSError:
                continue
    return newest
