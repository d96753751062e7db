"""Faults under the real scheduler (issue 7): Airflow components killed while a segment is deferred,
a bucket outage mid-segment, manual "mark failed" and "clear", and a restart of the whole embedded
Airflow under a running `syncswitch run`. Training keeps going through each; the tests check the
final global step, that no segment was relaunched (one segment_start each), and the process table.

All of them share the session's one embedded Airflow (conftest ``embedded_airflow``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from airflow_runs import (
    DAG_ID,
    LocalSegmentNodes,
    assert_stopped_by_hand,
    checkpoint_names,
    checkpoint_step,
    component_pid,
    is_error_line,
    latest_step,
    new_component_pid,
    relaunch_evidence,
    segment_starts,
    state_of,
    task_instances,
    task_log_lines,
    trigger,
    wait_for_restart,
    wait_for_step,
    wait_for_task,
    wait_run,
    wait_until_answered,
)
from proc_utils import assert_no_processes, environ, wait_for
from syncswitch import checkpoints, procs, storage
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch_airflow import history
from syncswitch_airflow.backends.base import CLUSTER_ENV
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.airflow_api import AirflowApi
from syncswitch_airflow.embedded.instance import ADMIN_PASSWORD, ADMIN_USER
from syncswitch_airflow.embedded.supervisor import LIMIT_GROWTH, PROBE_SECONDS, ProbeLimits, read_status

pytestmark = [pytest.mark.airflow, pytest.mark.cluster]

SYNCSWITCH = Path(sys.executable).parent / "syncswitch"


BSP_STEPS = 800  # segment 0 of job(): half of 1600


def job(tmp_path: Path, name: str, **conf: object) -> dict:
    """A digits job with checkpoints every 100 steps (so that a relaunch would show)."""
    return {
        "job_name": name,
        "bucket_dir": str(tmp_path / "runs"),
        "switch_order": "10",
        "total_steps": 1600,
        "bsp_fraction": 0.5,
        "ckpt_frequency": [100],
        **conf,
    }


def kill_component(airflow: EmbeddedAirflow, name: str) -> None:
    """SIGKILL one component and wait for its restart. What it had started (a scheduler's
    LocalExecutor workers and log server, a triggerer's log server, its standby fork server) must
    not outlive it: left alone they would wait forever on a queue nobody writes, and a log server
    would keep its port. A fork server that a run's claim forked from the standby is that run's
    cluster's (it carries the cluster's marker) and outlives the scheduler as every cluster process
    does."""
    pid = component_pid(airflow, name)
    children = [
        (child.pid, child.start_ticks)
        for child in procs.children_of(pid)
        if child.alive and environ(child.pid).get(CLUSTER_ENV, procs.ENV_PLACEHOLDER) == procs.ENV_PLACEHOLDER
    ]
    assert children, f"the {name} has no child processes to check"
    os.kill(pid, signal.SIGKILL)
    wait_for_restart(airflow, name, pid)
    wait_for(
        lambda: not any(procs.is_alive(child, ticks) for child, ticks in children),
        timeout=10,
        what=f"the killed {name}'s processes gone",
    )


def test_killed_triggerer_and_scheduler_and_a_hung_api_server_lose_no_training_and_clear_does_not_retrain(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """While a run trains, the api-server hangs (SIGSTOP: alive, its port open, no answers) and
    meanwhile the triggerer and then the scheduler are SIGKILLed. The supervisor restarts each, the
    hung one once its health probe has gone unanswered for the limit (20 s in the test session); the
    run's tasks and this test's client wait for it. The run succeeds with each segment started once.
    A second client that logs in and triggers a run while the api-server hangs gets its run, once."""
    airflow = embedded_airflow
    # The faults come during BSP's 800 steps; the ASP segment after them only has to run once.
    run_id, layout = trigger(airflow, job(tmp_path, "kills", train_steps=[BSP_STEPS, 200]))
    wait_for_task(airflow, run_id, "segment_0.bsp", ("deferred",))
    wait_for_step(layout, 0, "bsp", 20)

    wait_until_answered(airflow)  # "answered, then hung": not one still booting
    api_server = component_pid(airflow, "api-server")
    os.kill(api_server, signal.SIGSTOP)
    # An unregistered model passes the form and fails the run's validate task: nothing provisioned.
    late_conf = {"job_name": "kills-late", "bucket_dir": str(tmp_path / "runs"), "model": "no_such_model"}
    late_client = AirflowApi(lambda: airflow.url, ADMIN_USER, ADMIN_PASSWORD)
    late_trigger = ThreadPoolExecutor(max_workers=1).submit(late_client.trigger, DAG_ID, late_conf)
    kill_component(airflow, "triggerer")
    # Training goes on under the new triggerer, unless the segment's 800 steps were done already
    # (a fast machine runs them during the restart): the final step and segment starts below tell.
    before = latest_step(layout, 0, "bsp")
    wait_for(
        lambda: latest_step(layout, 0, "bsp") > before or before >= BSP_STEPS,
        timeout=120,
        what=f"training goes on past step {before}",
    )

    kill_component(airflow, "scheduler")
    limit = ProbeLimits.from_environ(os.environ).hung * LIMIT_GROWTH  # (the session's environment)
    wait_for_restart(airflow, "api-server", api_server, timeout=limit + 2 * PROBE_SECONDS + 60)
    assert "killing it (hung)" in airflow.log_path.read_text()
    late = late_trigger.result(timeout=150)
    assert [r["dag_run_id"] for r in airflow.api.dag_runs(DAG_ID) if r["conf"] == late_conf] == [late]

    assert wait_run(airflow, run_id) == "success"
    state = state_of(layout)
    assert state["final"]["global_step"] == BSP_STEPS + 200
    assert segment_starts(layout) == {0: 1, 1: 1}, relaunch_evidence(airflow, run_id, layout)
    restarts = airflow.component_restarts()
    exits = [restarts[name]["last_exit"] for name in ("triggerer", "scheduler", "api-server")]
    assert exits == [-signal.SIGKILL] * 3, restarts
    assert_no_processes(r"/kills-", timeout=30)
    assert wait_run(airflow, late) == "failed"  # (before the clear below, which it would hold up)

    # "Clear" of a finished segment: Airflow reruns it (and its setup and teardown), and it finds
    # its result instead of training again.
    checkpoints = checkpoint_names(layout)
    cleared = airflow.api.clear_tasks(DAG_ID, run_id, ["segment_0.bsp"])
    assert "segment_0.bsp" in cleared
    assert wait_run(airflow, run_id) == "success"
    assert segment_starts(layout) == {0: 1, 1: 1}, "clear retrained a finished segment"
    assert checkpoint_names(layout) == checkpoints
    assert state_of(layout)["status"] == "success"


def test_an_api_server_stopped_before_its_first_answer_is_killed_at_its_boot_limit(
    embedded_airflow: EmbeddedAirflow,
) -> None:
    """The api-server wedges as it starts, before any probe has had an answer from it (SIGSTOP right
    after its restart): the supervisor kills it once the boot limit has passed since its start (60 s
    in the test session), says so with both times, and the next one serves."""
    airflow = embedded_airflow
    wait_until_answered(airflow)
    old = component_pid(airflow, "api-server")
    os.kill(old, signal.SIGKILL)
    booting = new_component_pid(airflow, "api-server", old)
    os.kill(booting, signal.SIGSTOP)
    status = read_status(Path(airflow.home))["components"]["api-server"]
    assert status["pid"] == booting and status["answered"] is False, status  # stopped before answering

    limit = ProbeLimits.from_environ(os.environ).boot * LIMIT_GROWTH
    wait_for_restart(airflow, "api-server", booting, timeout=limit + 2 * PROBE_SECONDS + 60)
    kills = [line for line in airflow.log_path.read_text().splitlines() if f"(pid {booting})" in line]
    boot_kill = re.compile(r"started at \d\d:\d\d:\d\d, no answer since .*: killing it \(no answer since")
    assert any(boot_kill.search(line) for line in kills), kills
    wait_until_answered(airflow)
    assert airflow.api.health()["metadatabase"]["status"] == "healthy"


def test_a_failed_run_cleared_resumes_on_a_new_cluster_from_its_last_checkpoint(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """A long run that failed mid-segment, past its retries (the job allows none: segment_retries 0),
    fails at once, without a retry; it is resumed the way Airflow users resume a run: "Clear" of the
    failed segment with its downstream. Airflow reruns the segment's setup (a new cluster) and
    teardown; the segment goes on from the last checkpoint the failed one left, not from step 0; the
    run ends a success, in the job's history too."""
    airflow = embedded_airflow
    conf = {
        "job_name": "resume",
        "bucket_dir": str(tmp_path / "runs"),
        "switch_order": "10",
        "train_steps": [1200, 100],
        "ckpt_frequency": [100, 100],
        "segment_retries": 0,
    }
    run_id, layout = trigger(airflow, conf)
    wait_for_task(airflow, run_id, "segment_0.bsp", ("deferred",))
    # Right past a checkpoint (no lag, unlike the step events), ~1,000 steps before the segment's end.
    wait_for(lambda: checkpoint_step(layout) >= 200, timeout=300, what="segment 0's checkpoint 200")
    nodes = LocalSegmentNodes("resume", 0)()
    assert nodes, "segment 0's nodes were not found"
    for pid in nodes:  # the cluster crashes
        os.kill(pid, signal.SIGKILL)
    assert wait_run(airflow, run_id) == "failed"
    segment = task_instances(airflow.api, run_id)["segment_0.bsp"]
    assert (segment["state"], segment["try_number"]) == ("failed", 1), segment  # no retry left: none
    assert_no_processes(r"/resume-", timeout=30)
    left_at = checkpoints.latest(layout)["global_step"]
    assert left_at >= 100

    cleared = airflow.api.clear_tasks(DAG_ID, run_id, ["segment_0.bsp"], include_downstream=True)
    assert {"provision_cluster", "segment_0.bsp", "segment_1.asp", "teardown_cluster", "finalize"} <= set(
        cleared
    )
    assert wait_run(airflow, run_id) == "success", failed_tasks_and_logs(airflow, run_id)
    state = state_of(layout)
    assert state["final"]["global_step"] == 1300 and state["status"] == "success"
    provision = task_instances(airflow.api, run_id)["provision_cluster"]
    assert provision["try_number"] == 2 and provision["state"] == "success"  # provisioned again
    starts = [e for e in read_events(layout.metrics, event="segment_start") if e.get("segment") == 0]
    assert len(starts) == 2 and starts[0]["start_step"] == 0, starts
    assert starts[1]["start_step"] >= left_at, starts  # resumed, not retrained from step 0
    records = history.read_records(conf["bucket_dir"], "resume")
    assert [(r["run_id"], r["status"]) for r in records] == [(run_id, "success")], records
    assert_no_processes(r"/resume-", timeout=30)


def failed_tasks_and_logs(airflow: EmbeddedAirflow, run_id: str) -> str:
    """For an assertion message: the run's failed tasks and the error lines of their logs."""
    lines = []
    for task_id, ti in sorted(task_instances(airflow.api, run_id).items()):
        if ti["state"] in ("failed", "upstream_failed"):
            lines.append(f"{task_id}: {ti['state']}")
            if ti["state"] == "failed" and ti["try_number"]:
                lines += task_log_lines(airflow.api, run_id, task_id, ti["try_number"], is_error_line, 2500)
    return "\n".join(lines)


def test_mark_failed_on_a_running_segment_tears_down_and_leaves_no_process(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    airflow = embedded_airflow
    run_id, layout = trigger(airflow, job(tmp_path, "markfail", switch_order="1", total_steps=100000))
    wait_for_task(airflow, run_id, "segment_0.bsp", ("deferred",))
    wait_for_step(layout, 0, "bsp", 10)
    airflow.api.set_task_state(DAG_ID, run_id, "segment_0.bsp", "failed")
    assert wait_run(airflow, run_id) == "failed"
    tasks = airflow.api.task_states(DAG_ID, run_id)
    assert tasks["teardown_cluster"] == "success", tasks
    # The watcher ended with its segment task, instead of waiting out a timeout.
    assert tasks["segment_0.watch_stragglers"] == "success", tasks
    assert_no_processes(r"/markfail-", timeout=30)
    assert state_of(layout)["status"] == "failed"


def test_a_run_marked_failed_as_a_whole_ends_failed_torn_down_running_or_queued(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """The UI's "Mark run as failed" (and `syncswitch run`'s Ctrl-C): Airflow fails the running tasks
    and skips every pending one but the teardown tasks, and, with a teardown pending, leaves the run's
    state to them. The run ends failed, not success: finalize (a teardown itself) fails it, a training
    run after its cluster is torn down, a queued one once it starts, without training."""
    airflow = embedded_airflow
    running, layout = trigger(airflow, job(tmp_path, "markrun", switch_order="1", total_steps=100000))
    wait_for_task(airflow, running, "segment_0.bsp", ("deferred",))
    assert airflow.api.fail_run(DAG_ID, running, teardown_seconds=120, poll_seconds=0.5)
    assert_stopped_by_hand(airflow.api, running, "segment_0.bsp")
    assert state_of(layout)["status"] == "failed"
    assert_no_processes(r"/markrun-", timeout=30)

    airflow.api.pause(DAG_ID)  # its new runs stay queued
    try:
        conf = job(tmp_path, "markqueued")
        queued = airflow.api.trigger(DAG_ID, conf, unpause=False)
        queued_layout = RunLayout.for_run(conf["bucket_dir"], conf["job_name"], queued)
        assert airflow.api.run_state(DAG_ID, queued) == "queued"
        airflow.api.mark_failed(DAG_ID, queued)
    finally:
        airflow.api.unpause(DAG_ID)
    assert wait_run(airflow, queued) == "failed"
    tasks = airflow.api.task_states(DAG_ID, queued)
    assert tasks.pop("finalize") == "failed", tasks
    assert set(tasks.values()) == {"skipped"}, tasks  # nothing provisioned, nothing trained
    assert not storage.exists(queued_layout.state)


def test_a_bucket_outage_mid_segment_under_the_scheduler(
    embedded_airflow: EmbeddedAirflow, gcs_server, gcs_bucket: str, tmp_path: Path
) -> None:
    airflow = embedded_airflow
    conf = job(tmp_path, "outage", bucket_dir=f"{gcs_bucket}/runs", train_steps=[1000, 200])
    run_id, layout = trigger(airflow, conf)
    # Right past checkpoint 100 (no lag, unlike the step events), ~900 steps before the segment's end.
    wait_for(lambda: checkpoint_step(layout) >= 100, timeout=300, what="segment 0's checkpoint 100", poll=0.1)
    gcs_server.outage(60.0).join()  # the minute; BSP waits at its next checkpoint
    assert wait_run(airflow, run_id) == "success"
    state = state_of(layout)
    assert state["final"]["global_step"] == 1200
    assert segment_starts(layout) == {0: 1, 1: 1}, relaunch_evidence(airflow, run_id, layout)
    names = checkpoint_names(layout)
    assert all(storage.exists(f"{layout.checkpoints}/{n}/manifest.json") for n in names), names
    assert_no_processes(r"/outage-", timeout=30)


def start_syncswitch_run(airflow: EmbeddedAirflow, tmp_path: Path, *flags: str) -> subprocess.Popen:
    """`syncswitch run` on the session's embedded Airflow (kept running after it), run folders under
    ``tmp_path / "runs"``."""
    command = [str(SYNCSWITCH), "run", "--airflow-home", str(airflow.home), "--keep-ui"]
    command += ["--bucket-dir", str(tmp_path / "runs"), *flags]
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,  # noqa: PLW1509 - one signal call
    )


def _as_from_a_terminal() -> None:
    """Ctrl-C's SIGINT reaches the CLI as from a terminal, whatever this test process inherited (a
    process that starts with SIGINT ignored, a background job of a script, keeps it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def end_syncswitch_run(airflow: EmbeddedAirflow, cli: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The CLI's output once it exits. One still running after ``timeout`` fails the test with what
    it was doing (its signal masks and every thread's stack: ``kill -USR1``), after it is killed and
    its runs failed and torn down, so that the next tests find the local cluster slot free."""
    try:
        return cli.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    status = Path(f"/proc/{cli.pid}/status").read_text().splitlines()
    masks = [line for line in status if line.startswith("Sig")]
    cli.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    cli.kill()
    out, err = cli.communicate()
    for run in airflow.api.dag_runs(DAG_ID):
        if run["state"] in ("queued", "running"):
            airflow.api.fail_run(DAG_ID, run["dag_run_id"], teardown_seconds=120, poll_seconds=0.5)
    pytest.fail(f"syncswitch run ran on {timeout:.0f} s; {masks}\nout:\n{out[-3000:]}\nerr:\n{err[-8000:]}")


def test_ctrl_c_on_syncswitch_run_fails_its_run_and_tears_it_down(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """A user's Ctrl-C mid-training: the CLI fails its run (which ended success before finalize was
    a teardown task), waits for the teardown, and exits 130; the kept UI stays up."""
    airflow = embedded_airflow
    cli = start_syncswitch_run(
        airflow, tmp_path, "--job-name", "ctrlc", "--switch-order", "1", "--total-steps", "100000"
    )
    try:
        wait_for(
            lambda: (
                any(tmp_path.glob("runs/ctrlc/*/metrics/seg-00-bsp/worker-0.jsonl")) or cli.poll() is not None
            ),
            timeout=300,
            what="training",
        )
        cli.send_signal(signal.SIGINT)
        out, err = end_syncswitch_run(airflow, cli, timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, f"stdout:\n{out}\nstderr:\n{err}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["state"] == "interrupted" and "failing run" in err, err
    assert_stopped_by_hand(airflow.api, summary["run_id"], "segment_0.bsp")
    assert_no_processes(r"/ctrlc-", timeout=30)
    assert airflow.is_running()


def test_syncswitch_run_carries_on_through_a_restart_of_the_whole_embedded_airflow(
    embedded_airflow: EmbeddedAirflow, tmp_path: Path
) -> None:
    """Last in this file: the instance the session fixture started is replaced by the one the CLI
    starts again (the fixture's handle follows it)."""
    airflow = embedded_airflow
    runs = tmp_path / "runs"
    cli = start_syncswitch_run(
        airflow, tmp_path, "--job-name", "restart", "--total-steps", "1600", "--bsp-fraction", "0.5"
    )
    try:
        wait_for(
            lambda: any(runs.glob("restart/*/metrics/seg-00-bsp/worker-0.jsonl")),
            timeout=300,
            what="training",
        )
        # Stopped as a user stops a kept UI: each component gets one SIGTERM and ends by itself.
        stop = subprocess.run(
            [str(SYNCSWITCH), "run", "--airflow-home", str(airflow.home), "--stop-ui"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out, err = cli.communicate(timeout=900)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert stop.returncode == 0 and "embedded Airflow stopped" in stop.stderr, stop.stderr
    # The supervisor ended the whole process group (what this session's killed components left it
    # killed when they died): stop() never had to kill the group itself.
    assert "SIGKILL" not in stop.stderr, stop.stderr
    triggerer_log = (airflow.home / "logs" / "components" / "triggerer.log").read_text()
    assert "second exit signal" not in triggerer_log  # a signal reached it twice: "force exit"
    assert cli.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["state"] == "success"
    assert any("starting it again" in line for line in out.splitlines()), out
    # The database the first instance migrated and wrote was left as it was: no second migration.
    supervisor_log = (airflow.home / "embedded.log").read_text()
    assert supervisor_log.count("migrating the metadata database") == 1, supervisor_log
    assert "migrated for these Airflow packages and settings: no migration" in supervisor_log
    layout_root = Path(summary["run_dir"])
    assert sorted(p.name for p in (layout_root / "metrics").iterdir()) == ["seg-00-bsp", "seg-01-asp"]
    from syncswitch.layout import RunLayout

    layout = RunLayout(str(layout_root))
    assert segment_starts(layout) == {0: 1, 1: 1}, relaunch_evidence(airflow, summary["run_id"], layout)
    assert state_of(layout)["final"]["global_step"] == 1600
    assert airflow.is_running()  # the fixture's handle follows the restarted instance
