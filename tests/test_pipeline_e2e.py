"""End to end: real ``dag.test()`` runs of sync_switch with real training processes.

Each run trains the digits CNN on a local cluster (1 PS + 2 workers) through ``syncswitch train``;
step counts are small so that the whole file runs in a few minutes on 2 cores.

Under ``dag.test()`` tasks run one at a time in this process, in an order Airflow does not define
(a set of task instances), so a straggler sensor could run before its segment and wait out its
start timeout. The sensors are therefore marked successful here; the sensor's own tests and the
online-switching tests (real scheduler) cover it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from background import Poller
from proc_utils import ProgressThrottle, assert_no_processes
from syncswitch import storage
from syncswitch.layout import RunLayout, safe_run_id
from syncswitch.procs import processes_in_group
from syncswitch.state import read_state

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.airflow, pytest.mark.cluster]

SMALL_JOB = {"job_name": "e2e", "total_steps": 120, "ckpt_frequency": [30]}


def run_dag(dag, conf: dict[str, Any]):  # noqa: ANN001, ANN201 - airflow types
    # The straggler sensors run for real: under dag.test they end at once when their segment has
    # ended or has not started yet, so the sequential run cannot deadlock.
    return dag.test(run_conf=conf)


def task_states(dag_run) -> dict[str, str]:  # noqa: ANN001
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.state).where(
                TaskInstance.dag_id == dag_run.dag_id, TaskInstance.run_id == dag_run.run_id
            )
        )
        return {task_id: str(state) for task_id, state in rows}


def layout_of(bucket_dir: str, dag_run, job_name: str = "e2e") -> RunLayout:  # noqa: ANN001
    return RunLayout.for_run(bucket_dir, job_name, dag_run.run_id)


def assert_cluster_gone(work_root: Path) -> None:
    """No process of the run survives and the cluster's work folder is freed."""
    assert_no_processes(re.escape(str(work_root)))
    assert not list(work_root.glob("*/segments")), f"work folder left behind: {list(work_root.iterdir())}"


def assert_run_folder(layout: RunLayout, protocols: list[str]) -> dict[str, Any]:
    """The documented layout: state.json, checkpoints with manifests, per-segment metrics, report."""
    state = read_state(layout)
    assert state is not None
    assert [e["protocol"] for e in state["plan"]] == protocols
    checkpoints = [u for u in storage.list_files(layout.checkpoints) if u.endswith("/manifest.json")]
    assert checkpoints, "no complete checkpoint"
    for index, protocol in enumerate(protocols):
        assert storage.exists(layout.segment_result(index, protocol))
        assert storage.list_files(layout.segment_metrics(index, protocol), suffix=".jsonl")
    report = storage.list_files(layout.report)
    assert layout.report + "/index.html" in report and layout.report + "/summary.json" in report
    pngs = [u for u in report if u.endswith(".png")]
    assert len(pngs) >= 2
    for png in pngs:
        data = storage.read_bytes(png)
        assert data.startswith(b"\x89PNG") and len(data) > 5_000, f"{png} is empty or trivial"
    return state


def assert_exact_workload(state: dict[str, Any], workload: int) -> None:
    last = state["plan"][-1]
    assert last["until_step"] == workload
    assert state["segments"][str(last["index"])]["end_step"] == pytest.approx(workload)
    assert state["final"]["global_step"] == pytest.approx(workload)


class LaunchKiller(Poller):
    """Kills launches of one segment as the local backend records them, from a background thread.

    ``ready`` says when the current launch may be killed; ``group`` kills the launch's whole process
    group (wrapper, launcher and cluster, like a host crash), otherwise only the launcher (a crash:
    the wrapper reports its exit status, its cluster processes die with it). Inside its block, every
    launch it has not killed yet runs at a sixteenth of its speed (``throttle``), so that a kill due
    after a checkpoint lands before the segment's end, however fast the machine.
    """

    def __init__(
        self, work_root: Path, index: int, times: int, ready: Callable[[], bool], *, group: bool
    ) -> None:
        self.pattern = str(work_root / "*" / "segments" / f"seg-{index:02d}" / "process.json")
        self.times, self.ready, self.group = times, ready, group
        self.killed: list[int] = []
        super().__init__(every=0.2)

    def poll(self) -> bool:
        for path in glob.glob(self.pattern):
            try:
                record = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if record["pid"] not in self.killed and self.ready():
                self._kill(record)
        return len(self.killed) >= self.times

    def unkilled_launch_pids(self) -> list[int]:
        """Every process of the launches not killed yet: the launch's process group, and the nodes
        that the cluster's fork server forked for it."""
        pids: list[int] = []
        for path in glob.glob(self.pattern):
            try:
                record = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if record["pid"] not in self.killed:
                pids += processes_in_group(record["pgid"])  # the wrapper and the launcher
                with contextlib.suppress(OSError, ValueError, KeyError):  # the nodes, once started
                    nodes = json.loads(Path(path).with_name("scratch").joinpath("nodes.json").read_text())
                    pids += [int(node["pid"]) for node in nodes.values()]
        return pids

    def __enter__(self) -> LaunchKiller:
        super().__enter__()
        done = lambda: len(self.killed) >= self.times  # noqa: E731
        self._throttle = ProgressThrottle(self.unkilled_launch_pids, done, slowdown=16).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._throttle.__exit__(*exc)
        super().__exit__(*exc)

    def _kill(self, record: dict[str, Any]) -> None:
        try:
            if self.group:
                os.killpg(record["pgid"], signal.SIGKILL)
            else:
                launcher = children_of(record["pid"])
                if not launcher:
                    return  # not started yet: try again at the next poll
                os.kill(launcher[0], signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed.append(record["pid"])


def children_of(pid: int) -> list[int]:
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
            children.append(int(entry))
    return children


def any_file(pattern: str) -> Callable[[], bool]:
    return lambda: bool(glob.glob(pattern, recursive=True))


# ---- the embedded demo's shape, local bucket ------------------------------------------------------


def test_bsp_then_asp_on_a_local_bucket(dag, tmp_path: Path, work_root: Path) -> None:  # noqa: ANN001
    bucket = str(tmp_path / "runs")
    dag_run = run_dag(dag, {**SMALL_JOB, "total_steps": 200, "ckpt_frequency": [50], "bucket_dir": bucket})

    assert dag_run.state == "success", task_states(dag_run)
    states = task_states(dag_run)
    assert states["segment_0.bsp"] == "success" and states["segment_0.asp"] == "skipped"
    assert states["segment_1.asp"] == "success" and states["segment_1.bsp"] == "skipped"
    # Past the plan, every later slot's tasks were skipped in one go: by the last segment's watcher,
    # or, where dag.test ran that watcher before its segment ended (one task at a time, in either
    # order), by the first unused slot's watcher (test_straggler_trigger checks the first way).
    assert states["segment_1.watch_stragglers"] == "success"
    slot_of = {t: int(t.split(".")[0].removeprefix("segment_")) for t in states if t.startswith("segment_")}
    unused = {t: states[t] for t, slot in slot_of.items() if slot >= 2}
    assert unused.pop("segment_2.watch_stragglers") in ("skipped", "success")
    assert set(unused.values()) == {"skipped"}, unused
    assert states["teardown_cluster"] == "success"
    layout = layout_of(bucket, dag_run)
    assert layout.root == f"{bucket}/e2e/{safe_run_id(dag_run.run_id)}"
    state = assert_run_folder(layout, ["bsp", "asp"])
    assert state["status"] == "success"
    assert [e["until_step"] for e in state["plan"]] == [50, 200]  # 25/75 split
    assert_exact_workload(state, 200)
    assert state["final"]["test_accuracy"] >= 0.95
    assert state["segments"]["1"]["start_step"] == pytest.approx(50)  # continued from segment 0
    # The handle's one copy, which the segments and the teardown read; the work folder it named is gone.
    assert state["cluster"]["backend"] == "local" and state["cluster"]["work_dir"].startswith(str(work_root))
    summary = json.loads(storage.read_text(layout.report + "/summary.json"))
    assert summary["final_accuracy"] >= 0.95
    # Every node's log is home, uploaded by its launcher and linked from the report; the teardown
    # added the launchers' own.
    linked = {entry["segment"]: set(entry["logs"]) for entry in summary["node_logs"]}
    assert linked["seg-00-bsp"] >= {"worker-0", "worker-1"}, linked
    assert linked["seg-01-asp"] >= {"chief-0", "worker-0", "worker-1", "ps-0"}, linked
    for index, protocol in ((0, "bsp"), (1, "asp")):
        home = {Path(uri).name for uri in storage.list_files(layout.segment_logs(index, protocol))}
        assert {"launcher-0.log", "worker-0.log"} <= home, home
    assert_cluster_gone(work_root)
    assert_evaluate_task_agrees_with_the_chief(layout, state)


def assert_evaluate_task_agrees_with_the_chief(layout: RunLayout, state: dict[str, Any]) -> None:
    """The evaluate task reuses the last chief's evaluation of the final checkpoint; without one it
    evaluates the checkpoint itself, and must find the same accuracy."""
    from syncswitch.state import update_state
    from syncswitch_airflow.operators.job import EvaluateRunOperator

    assert state["final"]["evaluated_by"] == "segment 1"
    chief = state["segments"]["1"]

    def forget_segment_evaluation(s: dict[str, Any]) -> None:
        del s["segments"]["1"]["test_accuracy"]

    update_state(layout, forget_segment_evaluation)
    EvaluateRunOperator(task_id="evaluate", run_dir=layout.root).execute(context={})
    final = read_state(layout)["final"]
    assert final["evaluated_by"] == "evaluate task"
    assert final["test_accuracy"] == pytest.approx(chief["test_accuracy"])
    assert final["test_loss"] == pytest.approx(chief["test_loss"], rel=1e-4)


# ---- GCS handoff ---------------------------------------------------------------------------------


def test_bsp_asp_bsp_through_a_gcs_bucket(dag, gcs_bucket: str, work_root: Path) -> None:  # noqa: ANN001
    bucket = f"{gcs_bucket}/runs"
    dag_run = run_dag(
        dag, {**SMALL_JOB, "switch_order": "101", "train_steps": [30, 60, 30], "bucket_dir": bucket}
    )

    assert dag_run.state == "success", task_states(dag_run)
    layout = layout_of(bucket, dag_run)
    assert layout.root.startswith("gs://")
    state = assert_run_folder(layout, ["bsp", "asp", "bsp"])
    assert [e["until_step"] for e in state["plan"]] == [30, 90, 120]
    assert_exact_workload(state, 120)
    # Each segment restored the previous one's final checkpoint from the bucket.
    for index in (1, 2):
        assert state["segments"][str(index)]["start_step"] == state["segments"][str(index - 1)]["end_step"]
        assert state["segments"][str(index - 1)]["checkpoint"].startswith(layout.checkpoints)
    assert_cluster_gone(work_root)


# ---- retry and failure ----------------------------------------------------------------------------


def test_a_killed_segment_is_retried_from_its_checkpoint(dag, tmp_path: Path, work_root: Path) -> None:  # noqa: ANN001
    bucket = str(tmp_path / "runs")
    first_checkpoint = any_file(f"{bucket}/e2e/*/checkpoints/*/manifest.json")
    with LaunchKiller(work_root, index=0, times=1, ready=first_checkpoint, group=True) as killer:
        dag_run = run_dag(dag, {**SMALL_JOB, "switch_order": "1", "bucket_dir": bucket})

    assert len(killer.killed) == 1
    assert dag_run.state == "success", task_states(dag_run)
    state = read_state(layout_of(bucket, dag_run))
    # The retry restored a checkpoint instead of starting over, and still stopped exactly at 120.
    assert state["segments"]["0"]["start_step"] >= 30
    assert_exact_workload(state, 120)
    assert_cluster_gone(work_root)


@pytest.mark.parametrize("segment_retries", [0, 2])
def test_a_failing_segment_fails_the_run_and_teardown_cleans_up(
    dag,  # noqa: ANN001
    tmp_path: Path,
    work_root: Path,
    segment_retries: int,
) -> None:
    """The launcher crashes in every try (a retry's as soon as it starts): the job's segment_retries
    retries, then the run fails, without a try more."""
    bucket = str(tmp_path / "runs")
    training = any_file(f"{bucket}/e2e/*/checkpoints/*/manifest.json")
    conf = {**SMALL_JOB, "train_steps": [300, 30], "bucket_dir": bucket, "segment_retries": segment_retries}
    with LaunchKiller(work_root, index=0, times=4, ready=training, group=False) as killer:
        dag_run = run_dag(dag, conf)

    assert len(killer.killed) == segment_retries + 1
    assert dag_run.state == "failed"
    states = task_states(dag_run)
    assert states["segment_0.bsp"] == "failed"
    assert states["evaluate"] == "upstream_failed" and states["report"] == "upstream_failed"
    assert states["teardown_cluster"] == "success"
    state = read_state(layout_of(bucket, dag_run))
    assert state["status"] == "failed" and "0" not in state["segments"]
    assert_cluster_gone(work_root)


# ---- bad params ----------------------------------------------------------------------------------


def test_cross_field_errors_fail_validate_before_provisioning(
    dag,  # noqa: ANN001
    tmp_path: Path,
    work_root: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    bucket = str(tmp_path / "runs")
    dag_run = run_dag(
        dag, {**SMALL_JOB, "switch_order": "101", "train_steps": [10, 20], "bucket_dir": bucket}
    )

    assert dag_run.state == "failed"
    states = task_states(dag_run)
    assert states["validate"] == "failed"
    assert states["provision_cluster"] == "upstream_failed"
    assert states["teardown_cluster"] in ("upstream_failed", "skipped")
    assert "train_steps: has 2 values but switch_order '101' has 3 segments" in capfd.readouterr().out
    assert not work_root.exists() and not Path(bucket).exists()


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("local", "cluster_backend: 'local' runs the cluster on the Airflow worker that provisions it"),
        ("hosts", "[syncswitch] leases_dir is unset, so every Airflow worker would count clusters"),
    ],
)
def test_a_distributed_airflow_refuses_at_validate_what_only_works_on_one_machine(
    dag,  # noqa: ANN001
    gcs_bucket: str,
    tmp_path: Path,
    work_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    backend: str,
    message: str,
) -> None:
    """Under a Celery executor (tasks on other machines, no shared disk) validate refuses a local
    cluster, and any cluster while the capacity ledger would be each worker's own; nothing runs."""
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    monkeypatch.delenv("SYNCSWITCH_LEASES_DIR", raising=False)
    monkeypatch.delenv("AIRFLOW__SYNCSWITCH__LEASES_DIR", raising=False)
    conf = {**SMALL_JOB, "bucket_dir": gcs_bucket, "cluster_backend": backend}
    if backend == "hosts":  # never reached: validate refuses before any login
        key = tmp_path / "id_ed25519"
        key.write_text("not read\n")
        conf["hosts"] = [
            f"address=127.0.0.{i},key={key},role={role}" for i, role in ((1, "ps"), (2, "chief"))
        ]
    dag_run = run_dag(dag, conf)

    assert dag_run.state == "failed"
    states = task_states(dag_run)
    assert states["validate"] == "failed" and states["provision_cluster"] == "upstream_failed"
    assert message in capfd.readouterr().out
    # Nothing provisioned: no cluster folder, no run state (only finalize's history record of the
    # failed run).
    assert not work_root.exists()
    assert not [uri for uri in storage.list_files(gcs_bucket) if uri.endswith("/state.json")]


def test_schema_errors_reject_the_conf_before_the_run(dag, tmp_path: Path) -> None:  # noqa: ANN001
    from airflow.sdk.exceptions import ParamValidationError

    bucket = str(tmp_path / "runs")
    with pytest.raises(ParamValidationError, match="param switch_order"):
        run_dag(dag, {**SMALL_JOB, "switch_order": 10, "bucket_dir": bucket})  # a number, not a string
    assert not Path(bucket).exists()


@pytest.fixture(autouse=True)
def _no_leftovers(work_root: Path) -> Iterator[None]:
    yield
    assert_no_processes(re.escape(str(work_root)))
