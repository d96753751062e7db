"""The local cluster backend: a run's training processes on this machine, one work folder per run.

Work folder (``$SYNCSWITCH_WORK_DIR`` or ``<tmp>/syncswitch``, then ``<job_name>-<run_id>``)::

    cluster.json                  the handle
    forkserver/                   the cluster's fork server (syncswitch.forkserver): TensorFlow imported
                                  once at provisioning, every segment's processes forked from it warm
    segments/seg-<ii>/spec.json   the SegmentSpec given to ``syncswitch train --spec``
    segments/seg-<ii>/process.json  pid, process group and start time of the launch
    segments/seg-<ii>/launcher.log  the launcher's stdout and stderr (all attempts, appended)
    segments/seg-<ii>/exitcode      written by the supervise wrapper when the launcher exits
    segments/seg-<ii>/scratch/      the launcher's --work-dir: node logs, staged data

Every process of a run carries ``SYNCSWITCH_CLUSTER_DIR=<work folder>`` in its environment: the fork
server and launchers are started with it, and forked nodes inherit the server's. Teardown finds the
run's processes by that marker as well as by the process groups it started, so a process that left its
group, or whose launcher was SIGKILLed, is still found.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from syncswitch import forkserver
from syncswitch.layout import RunLayout
from syncswitch.procs import (
    ProcStat,
    is_alive,
    mem_available_gb,
    processes_with_env,
    read_stat,
    signal_group,
    signal_pid,
)
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow.backends.base import (
    EXITED,
    RUNNING,
    UNKNOWN,
    ClusterBusy,
    ClusterCapacity,
    ClusterError,
    Handle,
    SegmentStatus,
)

WORK_DIR_ENV = "SYNCSWITCH_WORK_DIR"
# How many local clusters may run at once. Each takes every core of a small machine, so one.
CAPACITY_ENV = "SYNCSWITCH_LOCAL_CLUSTERS"
CLUSTER_ENV = "SYNCSWITCH_CLUSTER_DIR"
SEGMENT_ENV = "SYNCSWITCH_SEGMENT_DIR"
GB_PER_TF_PROCESS = 0.9  # measured peak RSS 0.7-0.86 GB per TF process, plus headroom
TEARDOWN_GRACE_S = 15.0
VERIFY_TIMEOUT_S = 10.0
_POLL_S = 0.1

log = logging.getLogger(__name__)


def cluster_environment(**extra: str) -> dict[str, str]:
    """This process's environment without Airflow's own variables, plus ``extra``.

    Cluster processes outlive the Airflow task that starts them, and Airflow itself: the embedded
    Airflow finds (and on stop kills) its processes by AIRFLOW_HOME, so training must not carry it.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    return {**env, **extra}


def default_work_root() -> str:
    return os.environ.get(WORK_DIR_ENV) or os.path.join(tempfile.gettempdir(), "syncswitch")


class LocalBackend:
    """Processes on this host, reached through their work folder; holds no state between calls."""

    name = "local"

    def __init__(self, work_root: str | None = None, gb_per_process: float = GB_PER_TF_PROCESS) -> None:
        self.work_root = os.path.abspath(work_root or default_work_root())
        self.gb_per_process = gb_per_process

    # ---- cluster ---------------------------------------------------------------------------------

    def capacity(self) -> ClusterCapacity:
        return ClusterCapacity(os.path.join(self.work_root, "leases"), int(os.environ.get(CAPACITY_ENV, "1")))

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        """Take a cluster slot (ClusterBusy when none is free), then the cluster's folder and its fork
        server. Idempotent for the same run."""
        run = posixpath.basename(layout.root)
        work_dir = os.path.join(self.work_root, f"{job.job_name}-{run}")
        capacity = self.capacity()
        if not capacity.acquire(run, work_dir):
            holders = ", ".join(capacity.holders())
            raise ClusterBusy(
                f"all {capacity.capacity} local cluster slot(s) are taken (by {holders}); "
                f"${CAPACITY_ENV} sets how many run at once"
            )
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
        _write_json(os.path.join(work_dir, "cluster.json"), handle)
        self._start_forkserver(handle)
        log.info("run %s: provisioned local cluster (%d processes) in %s", run, processes, work_dir)
        return handle

    def _start_forkserver(self, handle: Handle) -> None:
        """Start the cluster's fork server unless one runs already (provision is idempotent). It
        imports TensorFlow in the background; the first segment's launcher waits for it."""
        server_dir = handle["forkserver_dir"]
        if forkserver.status(server_dir) != forkserver.ABSENT:
            return
        server = forkserver.start(server_dir, env=cluster_environment(**{CLUSTER_ENV: handle["work_dir"]}))
        log.info("run %s: started the cluster's fork server (pid %d)", handle.get("run"), server.pid)

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
        records = self._records(handle)
        terminated = self._terminate(records, CLUSTER_ENV, work_dir, TEARDOWN_GRACE_S)
        leftovers = self._kill_and_verify(records, CLUSTER_ENV, work_dir)
        if leftovers:
            raise ClusterError(f"run {handle.get('run')}: processes survived SIGKILL: {leftovers}")
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
        os.makedirs(seg_dir, exist_ok=True)
        spec_path = os.path.join(seg_dir, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            f.write(spec.to_json())
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
        ]
        return self.launch_command(handle, spec.index, command)

    def launch_command(self, handle: Handle, index: int, command: list[str]) -> dict[str, Any]:
        """Start ``command`` as segment ``index``: detached, in its own session, under the exit-code
        wrapper, with the run's marker in its environment."""
        if self.segment_status(handle, index).running:
            raise ClusterError(f"run {handle.get('run')}: segment {index} is already running")
        seg_dir = self.segment_dir(handle, index)
        os.makedirs(seg_dir, exist_ok=True)
        exit_path = os.path.join(seg_dir, "exitcode")
        if os.path.exists(exit_path):
            os.unlink(exit_path)
        env = cluster_environment(
            **{CLUSTER_ENV: handle["work_dir"], SEGMENT_ENV: seg_dir, "PYTHONUNBUFFERED": "1"}
        )
        wrapper = [sys.executable, "-m", "syncswitch_airflow.backends.supervise", exit_path, "--", *command]
        log_path = os.path.join(seg_dir, "launcher.log")
        with open(log_path, "ab") as out:
            out.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} launch: {' '.join(command)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                wrapper,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        stat = read_stat(proc.pid)
        record = {
            "index": index,
            "pid": proc.pid,
            "pgid": proc.pid,  # session leader: its pid is its process group id
            "start_ticks": stat.start_ticks if stat else None,
            "command": command,
            "log": log_path,
            "launched_at": time.time(),
        }
        _write_json(os.path.join(seg_dir, "process.json"), record)
        log.info("run %s: launched segment %d (pid %d), log %s", handle.get("run"), index, proc.pid, log_path)
        return record

    def segment_status(self, handle: Handle, index: int) -> SegmentStatus:
        seg_dir = self.segment_dir(handle, index)
        record = _read_json(os.path.join(seg_dir, "process.json"))
        if record is None:
            return SegmentStatus(UNKNOWN)
        exit_path = os.path.join(seg_dir, "exitcode")
        if not os.path.exists(exit_path) and is_alive(record["pid"], record.get("start_ticks")):
            return SegmentStatus(RUNNING, pid=record["pid"])
        # Checked again after the liveness test: the wrapper writes the file just before it exits.
        exit_code = _read_exit_code(exit_path)
        if exit_code is None:
            # The wrapper vanished: an orphaned launcher still works and will write its result
            # (its cluster processes die with it, so any survivor means the segment goes on).
            survivors = processes_with_env(SEGMENT_ENV, seg_dir)
            if survivors:
                return SegmentStatus(RUNNING, pid=survivors[0].pid)
        return SegmentStatus(EXITED, exit_code=exit_code, pid=record["pid"])

    def segment_log_tail(self, handle: Handle, index: int, lines: int = 20) -> str:
        path = os.path.join(self.segment_dir(handle, index), "launcher.log")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop_segment(self, handle: Handle, index: int, grace_seconds: float = 30.0) -> list[int]:
        seg_dir = self.segment_dir(handle, index)
        record = _read_json(os.path.join(seg_dir, "process.json"))
        records = [record] if record else []
        stopped = self._terminate(records, SEGMENT_ENV, seg_dir, grace_seconds)
        leftovers = self._kill_and_verify(records, SEGMENT_ENV, seg_dir)
        if leftovers:
            raise ClusterError(f"run {handle.get('run')}: segment {index} processes survived: {leftovers}")
        if stopped:
            log.info("run %s: stopped segment %d (%d process(es))", handle.get("run"), index, len(stopped))
        return stopped

    # ---- killing ---------------------------------------------------------------------------------

    def _records(self, handle: Handle) -> list[dict[str, Any]]:
        root = os.path.join(handle["work_dir"], "segments")
        if not os.path.isdir(root):
            return []
        records = (_read_json(os.path.join(root, name, "process.json")) for name in sorted(os.listdir(root)))
        return [r for r in records if r]

    def _live(self, records: list[dict[str, Any]], variable: str, value: str) -> list[ProcStat]:
        """Every live process of the scope: the launch wrappers and everything carrying the marker."""
        found = {p.pid: p for p in processes_with_env(variable, value)}
        for record in records:
            stat = read_stat(record["pid"])
            if stat and stat.alive and stat.start_ticks == record.get("start_ticks"):
                found[stat.pid] = stat
        return sorted(found.values(), key=lambda p: p.pid)

    def _terminate(
        self, records: list[dict[str, Any]], variable: str, value: str, grace_seconds: float
    ) -> list[int]:
        """SIGTERM the live launch wrappers first: each forwards it to its launcher, which stops its
        cluster gracefully. Only then SIGTERM whatever of the scope is left (an orphaned launcher, a
        process that escaped). Signalling everything at once would hit a launcher twice, and the
        second SIGTERM can land after its handler ran, killing it mid-cleanup. Waits up to
        ``grace_seconds`` in all."""
        deadline = time.monotonic() + grace_seconds
        wrapper_pids = {r["pid"] for r in records}
        live = self._live(records, variable, value)
        self._term_and_wait([p for p in live if p.pid in wrapper_pids], records, variable, value, deadline)
        rest = [p for p in self._live(records, variable, value) if p.pid not in wrapper_pids]
        self._term_and_wait(rest, records, variable, value, deadline)
        return sorted({p.pid for p in live + rest})

    def _term_and_wait(
        self, procs: list[ProcStat], records: list[dict[str, Any]], variable: str, value: str, deadline: float
    ) -> None:
        for proc in procs:
            signal_pid(proc.pid, signal.SIGTERM)
        pids = {p.pid for p in procs}
        while pids and time.monotonic() < deadline:
            if not pids & {p.pid for p in self._live(records, variable, value)}:
                return
            time.sleep(_POLL_S)

    def _kill_and_verify(self, records: list[dict[str, Any]], variable: str, value: str) -> list[int]:
        """SIGKILL what is left (whole process groups we started, then single marked processes);
        return the pids still alive after VERIFY_TIMEOUT_S (empty on success)."""
        deadline = time.monotonic() + VERIFY_TIMEOUT_S
        while True:
            live = self._live(records, variable, value)
            if not live:
                return []
            if time.monotonic() >= deadline:
                return [p.pid for p in live]
            # Only signal a recorded group while one of our processes is still in it, so a
            # process group id that the kernel has since handed to someone else is never hit.
            our_groups = {p.pgid for p in live}
            for record in records:
                if record.get("pgid") in our_groups:
                    signal_group(record["pgid"], signal.SIGKILL)
            for proc in live:
                signal_pid(proc.pid, signal.SIGKILL)
            time.sleep(_POLL_S)


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _read_exit_code(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
