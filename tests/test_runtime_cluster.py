"""The training runtime as users run it: `syncswitch train` on real multi-process TF clusters.

Each test starts real chief/worker/PS processes on 127.0.0.1, so they are slow-ish (20-60 s each on
2 cores); scenarios are combined to keep the suite inside CI's budget.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_utils import assert_no_processes
from syncswitch import checkpoints, storage
from syncswitch.events import read_events
from syncswitch.layout import RunLayout

pytestmark = pytest.mark.cluster

TRAIN = [sys.executable, "-m", "syncswitch.cli", "train", "--quiet"]
LAUNCH_TIMEOUT = 420


def train(*args: str, timeout: float = LAUNCH_TIMEOUT) -> tuple[int, dict | None, str]:
    """Run `syncswitch train`; returns (exit code, final JSON line or None, stderr)."""
    proc = subprocess.run([*TRAIN, *args], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return proc.returncode, result, proc.stderr


def start_train(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*TRAIN[:-1], *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_for_progress(work_dir: Path, step: float, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    path = work_dir / "progress.json"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"launcher exited early: {proc.communicate()[1][-3000:]}"
        if path.exists():
            progress = json.loads(path.read_text() or "{}")
            if progress.get("global_step", 0) >= step:
                return progress
        time.sleep(0.2)
    raise AssertionError(f"no progress to step {step} within {timeout}s")


def node_pid(work_dir: Path, name: str) -> int:
    """The pid of a live cluster process (e.g. 'worker-1'), from the launcher's process table."""
    table = json.loads((work_dir / "nodes.json").read_text())
    pid = table[name]["pid"]
    os.kill(pid, 0)  # raises if it is gone
    return pid


def segment_events(run_dir: str, index: int, protocol: str, event: str) -> list[dict]:
    return read_events(RunLayout(run_dir).segment_metrics(index, protocol), event=event)


# ---- protocols, accuracy and exact handoff ----------------------------------------------------------


def test_bsp_asp_bsp_handoff_is_exact_on_gcs(gcs_bucket: str, no_leftover_processes) -> None:
    """BSP -> ASP -> BSP through a gs:// run folder (GCS emulator), 6 optimizer steps per execution
    (checkpoints every 40 steps fall inside executions, targets are not multiples of 6): both protocols
    learn digits to >= 0.95, every restore is bit-identical, the global step continues and the loss
    does not jump."""
    run_dir = f"{gcs_bucket}/handoff"
    no_leftover_processes("syncswitch.node.*handoff|handoff.*syncswitch.node")
    common = [
        "--run-dir",
        run_dir,
        "--workers",
        "2",
        "--total-steps",
        "300",
        "--ckpt-frequency",
        "40",
        "--hparams",
        "steps_per_execution=6",
        "--eval",
    ]
    results = []
    for index, (protocol, until) in enumerate((("bsp", 120), ("asp", 240), ("bsp", 300))):
        rc, result, stderr = train(
            "--protocol", protocol, "--until-step", str(until), "--segment-index", str(index), *common
        )
        assert rc == 0, stderr[-4000:]
        results.append(result)
        assert result["protocol"] == protocol
        assert result["global_step"] == until, "a segment must stop exactly at its target"
        assert result["test_accuracy"] >= 0.95, result

    assert [r["start_step"] for r in results] == [0, 120, 240]
    # BSP counts one update per global batch, ASP one per worker batch (2 workers).
    assert results[-1]["updates"] == 120 + 2 * 120 + 60

    for index, (protocol, previous) in enumerate((("asp", results[0]), ("bsp", results[1])), start=1):
        (start,) = segment_events(run_dir, index, protocol, "segment_start")
        assert start["restored_from"] == previous["checkpoint"]
        assert start["checkpoint_digest"] == start["restored_digest"], "restored weights differ"
        last_loss = [
            e["loss"] for e in segment_events(run_dir, index - 1, ("bsp", "asp")[index - 1], "step")
        ][-3:]
        first_loss = segment_events(run_dir, index, protocol, "step")[0]["loss"]
        assert first_loss < max(0.5, 3 * max(last_loss)), (last_loss, first_loss)

    # A worker's step lasts until its next one starts, so a BSP step holds the gradient all-reduce (the
    # wait for the peer) and an ASP step the parameter servers' round trips. (Timed to the gradients
    # alone, BSP's wait was 0.5% of its step, its real waits falling between the timed steps: the report
    # showed a straggler's peers stepping as fast as with none.)
    for index, protocol in enumerate(("bsp", "asp")):
        timings = segment_events(run_dir, index, protocol, "worker_step")[2:]
        waited = sum(e["wait_time"] * e["steps"] for e in timings)
        stepped = sum(e["step_time"] * e["steps"] for e in timings)
        assert waited > 0.05 * stepped, (protocol, waited, stepped)

    layout = RunLayout(run_dir)
    latest = checkpoints.latest(layout)
    assert latest["global_step"] == 300 and latest["uri"].startswith("gs://")
    assert storage.exists(layout.segment_result(2, "bsp"))
    # One TensorBoard event file per segment, uploaded through the emulator-aware storage layer.
    assert len(storage.list_files(layout.tensorboard)) == 3


def test_adam_bsp_asp_bsp_handoff_is_exact_and_its_moments_are_checkpointed(tmp_path: Path) -> None:
    """Adam through BSP -> ASP -> BSP, checkpoints inside segments: every restore is bit-identical
    (the digest covers the weights and both moments), the checkpoint holds both moments of every
    variable, and a momentum-SGD segment is refused on that run folder before any process starts."""
    import tensorflow as tf

    run_dir = str(tmp_path / "run")
    common = ["--run-dir", run_dir, "--workers", "2", "--total-steps", "60", "--ckpt-frequency", "10"]
    hparams = "optimizer=adam,learning_rate=0.003,steps_per_execution=4"
    results = []
    for index, (protocol, until) in enumerate((("bsp", 24), ("asp", 48), ("bsp", 60))):
        rc, result, stderr = train(
            *("--protocol", protocol, "--until-step", str(until), "--segment-index", str(index)),
            *(*common, "--hparams", hparams),
        )
        assert rc == 0, stderr[-4000:]
        assert result["global_step"] == until, "a segment must stop exactly at its target"
        results.append(result)
    assert results[-1]["updates"] == 24 + 2 * 24 + 12

    # The digest is of the state as restored; then the second moment follows the update batch (digits:
    # 2 workers x 32 under BSP, 32 under ASP).
    for index, (protocol, previous, scale) in enumerate(
        (("asp", results[0], 2.0), ("bsp", results[1], 0.5)), 1
    ):
        (start,) = segment_events(run_dir, index, protocol, "segment_start")
        assert start["optimizer"] == "adam"
        assert start["restored_from"] == previous["checkpoint"]
        assert start["checkpoint_digest"] == start["restored_digest"], "restored weights or moments differ"
        assert start["second_moment_scale"] == scale

    manifest = checkpoints.latest(RunLayout(run_dir))
    assert manifest["signature"]["optimizer"] == "adam" and manifest["update_batch"] == 64
    saved = dict(tf.train.list_variables(os.path.join(manifest["uri"], checkpoints.CKPT_PREFIX)))
    from syncswitch.hparams import get_hparams
    from syncswitch.models import build_model
    from syncswitch.problems import get_problem

    weights = len(build_model(get_hparams("cnn_digits"), get_problem("digits")).trainable_variables)
    for slot in ("first_moments", "second_moments"):
        keys = [k for k in saved if k.startswith(f"optimizer/{slot}/")]
        assert len(keys) == weights, (slot, keys)
    assert not any(k.startswith("optimizer/velocities/") for k in saved)

    rc, _result, stderr = train("--protocol", "bsp", "--until-step", "70", "--segment-index", "3", *common)
    assert rc != 0
    assert "optimizer: checkpoint has 'adam', requested 'momentum'" in stderr, stderr[-2000:]


@pytest.mark.parametrize(("protocol", "workers"), [("asp", 1), ("bsp", 2)])
def test_one_execution_of_k_steps_equals_k_executions_of_one_step(
    protocol: str, workers: int, tmp_path: Path
) -> None:
    """Same data: 8 optimizer steps per execution (an ASP closure on one worker, a BSP call of two
    workers in lockstep) end with bit-identical weights and velocity (the checkpoint digest) as 8
    executions of one step each, also across a checkpoint boundary and a target that are not multiples
    of 8: every step reads the weights its predecessor's update wrote, however the steps are timed.
    BSP's other worker also outlives the chief: the chief may still fetch that worker's share of the
    last all-reduce from its server (a worker that exited first failed the chief, "Socket closed")."""
    digests = []
    for k in (1, 8):
        run_dir, work_dir = tmp_path / f"k{k}", tmp_path / f"work{k}"
        rc, result, stderr = train(
            *("--protocol", protocol, "--workers", str(workers), "--run-dir", str(run_dir)),
            *("--until-step", "30", "--ckpt-frequency", "12", "--hparams", f"steps_per_execution={k}"),
            *("--work-dir", str(work_dir)),
        )
        assert rc == 0, stderr[-3000:]
        if protocol == "bsp":
            assert exit_order(work_dir)[0] == "ss-worker-0", exit_order(work_dir)
        assert result["global_step"] == 30 and result["updates"] == 30
        manifest = checkpoints.latest(RunLayout(str(run_dir)))
        assert manifest["global_step"] == 30
        digests.append(manifest["digest"])
        (start,) = segment_events(str(run_dir), 0, protocol, "segment_start")
        assert start["steps_per_execution"] == k
    assert digests[0] == digests[1], "an execution of k steps must equal k executions of one step"


# ---- faults ----------------------------------------------------------------------------------------


def exit_order(work_dir: Path) -> list[str]:
    """The cluster's nodes in the order their private fork server saw them exit."""
    log = (work_dir / "forkserver" / "forkserver.log").read_text()
    return re.findall(r"forkserver: (\S+) \(pid \d+\) exited with", log)


def autograph_files(folder: str | Path) -> set[str]:
    return {p.name for p in Path(folder).glob("__autograph_generated_file*.py")}


def test_asp_survives_a_killed_worker_and_stops_gracefully(tmp_path: Path, no_leftover_processes) -> None:
    run_dir, work_dir = tmp_path / "run", tmp_path / "work"
    no_leftover_processes(re.escape(str(work_dir)))
    # The launcher's own temp folder stands for the system's: it is the nodes' unless they get theirs
    # (other processes on the machine, another test worker's, write to the real one meanwhile).
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    proc = start_train(
        "--protocol",
        "asp",
        "--workers",
        "2",
        "--ps",
        "1",
        "--run-dir",
        str(run_dir),
        "--until-step",
        "3000",
        "--ckpt-frequency",
        "50",
        "--work-dir",
        str(work_dir),
        env={**os.environ, "TMPDIR": str(system_temp)},
    )
    try:
        wait_for_progress(work_dir, 30, proc)
        os.kill(node_pid(work_dir, "worker-1"), signal.SIGKILL)
        killed_at = json.loads((work_dir / "progress.json").read_text())["global_step"]
        # The survivor keeps training: progress moves well past the kill.
        wait_for_progress(work_dir, killed_at + 40, proc)
        # Graceful stop through the control file: ends at a whole step, before the target.
        storage.write_text(RunLayout(str(run_dir)).stop_request(0), "test asked to stop")
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stopped_early"] is True
    assert killed_at + 40 <= result["global_step"] < 3000
    assert float(result["global_step"]).is_integer(), "an early ASP stop lands on a whole BSP step"
    assert "worker 1 exited" in err
    (lost,) = segment_events(str(run_dir), 0, "asp", "node_lost")
    assert (lost["node"], lost["host"]) == ("worker-1", None)
    assert lost["outcome"] == "ASP continues with the survivors"
    assert killed_at <= lost["global_step"] < result["global_step"]
    manifest = checkpoints.latest(RunLayout(str(run_dir)))
    assert manifest["global_step"] == result["global_step"]
    # Autograph's module files (removed only at a normal interpreter exit, which nodes never have) go
    # to the segment's work folder, not the system's temp folder.
    assert autograph_files(work_dir / "tmp"), "the nodes traced nothing into their temp folder"
    assert not autograph_files(system_temp), "a node traced into the launcher's temp folder"


def test_bsp_worker_loss_fails_cleanly_and_rerun_resumes(tmp_path: Path, no_leftover_processes) -> None:
    """A dead BSP worker aborts the segment; the last checkpoint is intact and a rerun resumes from it.
    The failure names the worker that died first (not the chief its death aborted) with its last
    lines, and every node's log is in the run folder. The rerun also injects a straggler, which must
    show in that worker's compute time."""
    run_dir, work_dir = tmp_path / "run", tmp_path / "work"
    no_leftover_processes(re.escape(str(tmp_path)))
    args = [
        "--protocol",
        "bsp",
        "--workers",
        "2",
        "--run-dir",
        str(run_dir),
        # A step mostly compute (~11 ms of it against ~4 ms at the default 32): the straggler's stops
        # fall where its compute is timed more often than into the all-reduce or the host loop.
        "--hparams",
        "batch_size=128",
        "--until-step",
        "2000",
        "--ckpt-frequency",
        "20",
        "--segment-index",
        "0",
    ]
    proc = start_train(*args, "--work-dir", str(work_dir))
    try:
        wait_for_progress(work_dir, 50, proc)
        os.kill(node_pid(work_dir, "worker-1"), signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "segment failed" in err
    assert "worker-1" in {e["node"] for e in segment_events(str(run_dir), 0, "bsp", "node_lost")}
    logs = RunLayout(str(run_dir)).segment_logs(0, "bsp")
    assert "the node that failed first: worker-1 (killed by signal 9); its last lines:" in err, err[-3000:]
    assert f"every node's log: {logs}/" in err
    (failed,) = segment_events(str(run_dir), 0, "bsp", "segment_failed")
    assert (failed["node"], failed["exit_code"], failed["lost"]) == ("worker-1", -9, False), failed
    assert failed["log"] == f"{logs}/worker-1.log" and failed["reason"].startswith("the chief exited with")
    worker_1 = Path(logs, "worker-1.log").read_text().splitlines()
    assert worker_1[0].startswith("worker 1 of segment 0 (bsp), pid ")
    assert failed["last_lines"] == worker_1[-20:]
    assert sorted(p.name for p in Path(logs).iterdir()) == ["worker-0.log", "worker-1.log"]
    manifest = checkpoints.latest(RunLayout(str(run_dir)))
    assert manifest is not None and manifest["global_step"] >= 40
    resumed_from = manifest["global_step"]

    rc, result, stderr = train(
        *args[:-4],
        "--until-step",
        str(int(resumed_from) + 60),
        "--segment-index",
        "1",
        "--straggler",
        "worker=1,start=0,duration=600,slowdown=4",
    )
    assert rc == 0, stderr[-4000:]
    assert result["start_step"] == resumed_from
    assert result["global_step"] == resumed_from + 60

    # Seconds of compute per step over the segment (each event averages a window of steps), without
    # each worker's first window, its first step: with the graph's warm-up that is 10-100 times a
    # step's compute, and one slow first step of worker 0 weighs on a 60-step mean (a whole-segment
    # mean fell to 1.30x once). The duty cycle's stops land in compute in proportion to compute's share
    # of the straggler's running time, so a mean over all steps keeps its ~4x; a median of windows
    # does not (1.14x and 1.28x in two suites: most windows had no stop in their compute). Beside two
    # or three busy processes this measured 3.1-4.4x at batch 128 (7 runs) and 1.55-4.3x at 32 (6).
    timings = segment_events(str(run_dir), 1, "bsp", "worker_step")
    compute = {w: compute_per_step([e for e in timings if e["worker"] == w][1:]) for w in (0, 1)}
    assert compute[1] > 1.5 * compute[0], compute
    assert segment_events(str(run_dir), 1, "bsp", "straggler")[0]["worker"] == 1


def compute_per_step(windows: list[dict]) -> float:
    """Seconds of compute per step over ``worker_step`` events (each the mean of its ``steps``)."""
    return sum(e["compute_time"] * e["steps"] for e in windows) / sum(e["steps"] for e in windows)


def test_a_bsp_segment_stepping_past_the_stall_limit_lives_and_a_frozen_one_fails(
    tmp_path: Path, no_leftover_processes
) -> None:
    """BSP (where the chief is worker 0) keeps stepping for longer than --stall-seconds and is left
    alone; then every node is frozen (as a hung collective would leave them): the launcher gives up
    after the limit without a new step, stops the cluster and keeps the last checkpoint."""
    run_dir, work_dir = tmp_path / "run", tmp_path / "work"
    no_leftover_processes(re.escape(str(work_dir)))
    stall_seconds = 15
    proc = start_train(
        *("--protocol", "bsp", "--workers", "2", "--run-dir", str(run_dir), "--until-step", "100000"),
        *("--ckpt-frequency", "20", "--stall-seconds", str(stall_seconds), "--work-dir", str(work_dir)),
    )
    try:
        wait_for_progress(work_dir, 1, proc)
        time.sleep(2 * stall_seconds)
        assert proc.poll() is None, f"a healthy BSP segment was failed: {proc.communicate()[1][-3000:]}"
        for name in json.loads((work_dir / "nodes.json").read_text()):
            os.kill(node_pid(work_dir, name), signal.SIGSTOP)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "no new step for" in err and "resumes from the last checkpoint" in err
    manifest = checkpoints.latest(RunLayout(str(run_dir)))
    assert manifest is not None and manifest["global_step"] >= 20


def test_a_bucket_outage_mid_segment_is_ridden_out_and_a_longer_one_fails_cleanly(
    gcs_server, gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftover_processes
) -> None:
    """The GCS emulator goes away for 20 s while BSP trains into a gs:// run folder: checkpoint writes,
    event uploads and the stop-request poll retry with backoff, the segment ends on target, and every
    checkpoint is complete. With a retry limit shorter than the next outage the segment fails, and a
    rerun resumes from the last complete checkpoint."""
    run_dir, work_dir = f"{gcs_bucket}/outage", tmp_path / "work"
    no_leftover_processes(re.escape(str(work_dir)))
    common = ["--protocol", "bsp", "--workers", "2", "--run-dir", run_dir, "--ckpt-frequency", "20"]
    proc = start_train(*common, "--until-step", "400", "--work-dir", str(work_dir))
    wait_for_progress(work_dir, 30, proc)
    gcs_server.outage(20.0).join()
    _out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    chief_log = (work_dir / "worker-0.log").read_text()
    assert "bucket unreachable:" in chief_log and "bucket reachable again:" in chief_log
    layout = RunLayout(run_dir)
    names = storage.list_dirs(layout.checkpoints)
    assert names and all(storage.exists(f"{layout.checkpoints}/{n}/manifest.json") for n in names), names
    assert checkpoints.latest(layout)["global_step"] == 400
    steps = [e["global_step"] for e in segment_events(run_dir, 0, "bsp", "step")]
    assert steps == sorted(steps) and steps[-1] > 30, "events written during the outage were kept"

    monkeypatch.setenv("SYNCSWITCH_BUCKET_RETRY_SECONDS", "5")
    proc = start_train(*common, "--until-step", "4000", "--work-dir", str(tmp_path / "work2"))
    wait_for_progress(tmp_path / "work2", 430, proc)
    restarted = gcs_server.outage(25.0)
    _out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    restarted.join()
    assert proc.returncode == 1, err[-3000:]
    last_complete = checkpoints.latest(layout)["global_step"]
    assert 400 < last_complete < 4000
    monkeypatch.delenv("SYNCSWITCH_BUCKET_RETRY_SECONDS")
    target = int(last_complete) + 40
    rc, result, err = train(*common, "--until-step", str(target), "--segment-index", "1")
    assert rc == 0, err[-3000:]
    assert result["start_step"] == last_complete and result["global_step"] == target


def test_asp_with_pinned_cores_trains(tmp_path: Path) -> None:
    """Pinned to one core each, the ASP servers once got a single inter-op thread and deadlocked
    before the first step (node.run_server now sizes their pools itself)."""
    rc, result, stderr = train(
        *("--protocol", "asp", "--workers", "2", "--ps", "1", "--pin-cores"),
        *("--run-dir", str(tmp_path / "run"), "--until-step", "40", "--stall-seconds", "180"),
    )
    assert rc == 0, stderr[-3000:]
    assert result["global_step"] == 40 and result["updates"] == 80


def test_sigterm_stops_every_process_and_frees_ports(tmp_path: Path) -> None:
    work_dir = tmp_path / "work"
    proc = start_train(
        "--protocol",
        "asp",
        "--workers",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--until-step",
        "5000",
        "--work-dir",
        str(work_dir),
    )
    try:
        wait_for_progress(work_dir, 5, proc)
        spec = json.loads((work_dir / "segment.json").read_text())
        assert spec["protocol"] == "asp"
        nodes = json.loads((work_dir / "nodes.json").read_text())
        ports = [int(node["address"].rsplit(":", 1)[1]) for node in nodes.values()]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert_no_processes(re.escape(str(work_dir)), timeout=15)
    assert len(ports) == 4  # chief, 2 workers, 1 PS
    for port in ports:
        with socket.socket() as s:
            # SO_REUSEADDR tolerates TIME_WAIT leftovers of closed connections, but bind + listen
            # still fail if any process is listening on the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


# ---- bad input: one clear message, before any process is spawned -------------------------------------


@pytest.fixture
def short_cifar(tmp_path: Path) -> Path:
    from cifar_fixtures import write_cifar10

    folder = tmp_path / "cifar"
    write_cifar10(folder)
    with open(folder / "data_batch_3.bin", "ab") as f:
        f.write(b"\0" * 100)  # no longer a whole number of 3073-byte records
    return folder


@pytest.fixture
def other_model_run(tmp_path: Path) -> Path:
    """A run folder whose latest checkpoint manifest says it holds the digits CNN."""
    run = tmp_path / "cnn-run"
    storage.write_json(
        str(run / "checkpoints" / f"ckpt-{0:012d}" / "manifest.json"),
        {
            "samples": 0,
            "global_step": 0,
            "updates": 0,
            "files": [],
            "signature": {
                "model": "cnn",
                "depth": None,
                "filters": 16,
                "input_shape": [8, 8, 1],
                "num_classes": 10,
            },
        },
    )
    return run


@pytest.mark.parametrize(
    ("extra", "field", "accepted"),
    [
        (["--model", "vgg"], "model: unknown 'vgg'", "resnet"),
        (["--problem", "mnist"], "problem: unknown 'mnist'", "digits"),
        (
            ["--hparam-set", "resnet_cifar_99", "--problem", "synthetic_cifar"],
            "hparam_set",
            "resnet_cifar_20",
        ),
        (["--hparams", "learning_rat=0.1"], "hparams", "learning_rate"),
        (["--hparams", "learning_rate"], "hparams", "k=v"),
        (["--hparams", "batch_size=many"], "hparams", "int"),
        (["--problem", "image_cifar10", "--data-dir", "/nonexistent/cifar"], "data_dir", "data_batch_1.bin"),
        (["--straggler", "worker=1,start=0"], "straggler", "duration"),
        (["--stall-seconds", "0"], "stall-seconds", "> 0"),
    ],
)
def test_bad_input_is_one_clear_error_before_spawning(
    tmp_path: Path, extra: list[str], field: str, accepted: str
) -> None:
    rc, _result, stderr = train(
        "--run-dir", str(tmp_path / "run"), "--work-dir", str(tmp_path / "w"), *extra, timeout=120
    )
    assert rc == 2
    assert field in stderr and accepted in stderr, stderr
    assert "Traceback" not in stderr
    assert not list((tmp_path / "w").glob("*.log")), "no process may be spawned on bad input"


def test_short_cifar_file_and_foreign_checkpoint_are_rejected(
    tmp_path: Path, short_cifar: Path, other_model_run: Path
) -> None:
    rc, _r, stderr = train(
        "--problem",
        "image_cifar10",
        "--data-dir",
        str(short_cifar),
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert rc == 2 and "data_dir" in stderr and "data_batch_3.bin" in stderr, stderr
    rc, _r, stderr = train("--problem", "synthetic_cifar", "--run-dir", str(other_model_run), timeout=120)
    assert rc == 2 and "run_dir" in stderr and "different model" in stderr, stderr
    assert "Traceback" not in stderr
