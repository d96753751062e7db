"""SSP, local SGD and compressed BSP as `syncswitch train` runs them: real TF processes on 127.0.0.1.

One fork server serves every segment of the module (the cluster's, as a pipeline run's), so a
segment's start is a fork, not a TensorFlow import. Short segments on 2 workers: the tests check what
the protocols do, never how fast: exact handoffs between every two of them, SSP's staleness bound
from the workers' step records, local SGD's averaging period and its H=1 equality with BSP, the
bytes each compression sends, and each protocol's behaviour when a worker is lost.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from proc_utils import wait_for
from syncswitch import checkpoints, forkserver_client, storage
from syncswitch.events import read_events
from syncswitch.layout import RunLayout
from syncswitch.protocols import parse_token
from test_runtime_cluster import LAUNCH_TIMEOUT, node_pid, wait_for_progress

pytestmark = pytest.mark.cluster

TRAIN = [sys.executable, "-m", "syncswitch.cli", "train", "--quiet"]
# One of each protocol (compressed BSP twice: both compressions), in the order the handoff circuit
# starts from.
PROTOCOLS = ("bsp", "asp", "ssp:1", "local:2", "topk:0.1")


@pytest.fixture(scope="module")
def forkserver_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = str(tmp_path_factory.mktemp("forkserver"))
    server = forkserver_client.start(folder, die_with_parent=True)
    try:
        forkserver_client.wait_ready(folder, 300)
        yield folder
    finally:
        server.terminate()
        server.wait(timeout=30)


def train(forkserver: str, *args: str) -> dict:
    """One segment through the module's fork server; its summary line (fails the test otherwise)."""
    proc = subprocess.run(
        [*TRAIN, "--forkserver", forkserver, *args], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def events(run_dir: str | Path, index: int, protocol: str, event: str) -> list[dict]:
    return read_events(RunLayout(str(run_dir)).segment_metrics(index, protocol), event=event)


def result(run_dir: str | Path, index: int, protocol: str) -> dict:
    return storage.read_json(RunLayout(str(run_dir)).segment_result(index, protocol))


def every_ordered_pair(nodes: tuple[str, ...]) -> list[str]:
    """A walk from ``nodes[0]`` that takes every switch between two different nodes once (an Eulerian
    circuit of the complete directed graph: Hierholzer's)."""
    unused = {a: [b for b in nodes if b != a] for a in nodes}
    stack, walk = [nodes[0]], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


# ---- every switch hands off exactly ------------------------------------------------------------------


@pytest.fixture(scope="module")
def circuit(forkserver_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One run folder through every switch between two of the protocols, then one FP16 segment: 3
    steps a segment (local SGD 5, so that it averages on its period and at its end)."""
    run_dir = tmp_path_factory.mktemp("circuit") / "run"
    walk = [*every_ordered_pair(PROTOCOLS), "fp16"]
    step = 0
    for index, spelled in enumerate(walk):
        step += 5 if spelled.startswith("local") else 3
        summary = train(
            forkserver_dir,
            *("--protocol", spelled, "--workers", "2", "--run-dir", str(run_dir)),
            *("--until-step", str(step), "--segment-index", str(index), "--ckpt-frequency", "0"),
        )
        assert summary["global_step"] == step, "every protocol stops exactly at its target"
    return run_dir, walk


def test_every_switch_between_two_protocols_hands_off_exactly(circuit: tuple[Path, list[str]]) -> None:
    run_dir, walk = circuit
    pairs = set(zip(walk, walk[1:], strict=False))
    assert {(a, b) for a, b in itertools.permutations(PROTOCOLS, 2)} <= pairs
    for index in range(1, len(walk)):
        protocol = parse_token(walk[index], "test").name
        previous = result(run_dir, index - 1, parse_token(walk[index - 1], "test").name)
        (start,) = events(run_dir, index, protocol, "segment_start")
        assert start["restored_from"] == previous["checkpoint"]
        assert start["start_step"] == previous["end_step"]
        # The digest the sender wrote in the manifest, and the one the receiver computed after a round
        # trip through the variables it trains (on parameter servers, mirrored, or a local replica).
        assert start["checkpoint_digest"] == start["restored_digest"], (walk[index - 1], walk[index])


def test_compressed_bsp_sends_the_bytes_its_compression_says(circuit: tuple[Path, list[str]]) -> None:
    """Bytes per step from the workers' step events: FP16 halves the gradients' all-reduce input,
    top-k sends k values and k indices; the batch-norm statistics' all-reduce stays dense."""
    run_dir, walk = circuit

    def sent(spelled: str) -> set[float]:
        index = walk.index(spelled)
        return {
            e["bytes_sent"] for e in events(run_dir, index, parse_token(spelled, "t").name, "worker_step")
        }

    (dense,), (half,), (topk,) = sent("bsp"), sent("fp16"), sent("topk:0.1")
    # dense = 4 P + 4 S, half = 2 P + 4 S: P gradient entries, S statistics.
    params, stats = (dense - half) / 2, (2 * half - dense) / 4
    assert params > 1000 and stats >= 0 and float(params).is_integer()
    kept = round(0.1 * params)
    assert topk == 8 * kept + 4 * stats, "top-k sends a float32 value and an int32 index per kept entry"
    assert result(run_dir, walk.index("topk:0.1"), "cbsp")["bytes_per_worker_step"] == topk


def test_local_sgd_averages_on_its_period_and_at_its_end(circuit: tuple[Path, list[str]]) -> None:
    run_dir, walk = circuit
    for index in (i for i, spelled in enumerate(walk) if spelled == "local:2"):
        start = result(run_dir, index, "local")["start_step"]
        averages = events(run_dir, index, "local", "average")
        assert [(a["global_step"] - start, a["steps"]) for a in averages] == [(2, 2), (4, 2), (5, 1)]
        assert result(run_dir, index, "local")["averaging"] == {"period": 2, "averages": 3}
        timings = events(run_dir, index, "local", "worker_step")
        total = sum(e["bytes_sent"] * e["steps"] for e in timings if e["worker"] == 0)
        assert total == pytest.approx(3 * averages[0]["bytes"]), "bytes only where the replicas average"


# ---- SSP's bound, and its two limits ------------------------------------------------------------------


@pytest.mark.parametrize(("staleness", "bounded"), [(0, True), (2, True), (10_000, False)])
def test_ssp_keeps_every_worker_within_s_steps_of_the_slowest(
    forkserver_dir: str, tmp_path: Path, staleness: int, bounded: bool
) -> None:
    """Worker 1 runs at a quarter speed. The clock lead each step started with (the workers' step
    records) never exceeds s, and the bound binds (closures cut short); s=0 is lockstep. With an s no
    run reaches, SSP is ASP: nothing is held back and the fast worker runs ahead freely."""
    run_dir = tmp_path / "run"
    train(
        forkserver_dir,
        *("--protocol", f"ssp:{staleness}", "--workers", "2", "--run-dir", str(run_dir)),
        *("--until-step", "60", "--ckpt-frequency", "0", "--hparams", "steps_per_execution=8"),
        *("--straggler", "worker=1,start=0,duration=600,slowdown=4"),
    )
    leads = [e["clock_lead"] for e in events(run_dir, 0, "ssp", "worker_step")]
    staleness_record = result(run_dir, 0, "ssp")["staleness"]
    assert len(leads) > 2 and staleness_record["bound"] == staleness
    if bounded:
        assert max(leads) <= staleness and staleness_record["max_lead"] <= staleness
        assert staleness_record["cut_closures"] > 0, "the straggler never held the fast worker back"
    else:
        assert max(leads) > 2 and staleness_record["cut_closures"] == 0


def test_ssp_on_one_worker_is_asp_bit_for_bit(forkserver_dir: str, tmp_path: Path) -> None:
    """With one worker no clock is ever behind: SSP's steps are ASP's, the same numbers."""
    digests = []
    for spelled in ("asp", "ssp:0"):
        run_dir = tmp_path / spelled.replace(":", "")
        train(
            forkserver_dir,
            *("--protocol", spelled, "--workers", "1", "--run-dir", str(run_dir), "--until-step", "12"),
        )
        digests.append(checkpoints.latest(RunLayout(str(run_dir)))["digest"])
    assert digests[0] == digests[1]


# ---- local SGD with H=1 is BSP --------------------------------------------------------------------------


def checkpoint_tensors(run_dir: Path, scratch: Path) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(
        checkpoints.fetch(checkpoints.latest(RunLayout(str(run_dir))), str(scratch))
    )
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith(("model/", "optimizer/"))]
    return {n: reader.get_tensor(n) for n in names if np.issubdtype(reader.get_tensor(n).dtype, np.floating)}


def test_local_sgd_averaging_every_step_follows_bsps_trajectory(forkserver_dir: str, tmp_path: Path) -> None:
    """Same data, same schedule: averaging weights and velocities after every step is BSP's update (the
    gradient all-reduce and the momentum update are linear), to float rounding."""
    tensors = []
    for spelled in ("bsp", "local:1"):
        run_dir = tmp_path / spelled.replace(":", "")
        train(
            forkserver_dir,
            *("--protocol", spelled, "--workers", "2", "--run-dir", str(run_dir), "--until-step", "15"),
            *("--ckpt-frequency", "0", "--hparams", "steps_per_execution=4"),
        )
        tensors.append(checkpoint_tensors(run_dir, tmp_path))
    bsp, local = tensors
    assert bsp.keys() == local.keys() and len(bsp) > 4
    for name, value in bsp.items():
        np.testing.assert_allclose(local[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert all(np.abs(v).max() > 0 for n, v in bsp.items() if n.startswith("optimizer/")), "it trained"


# ---- AdamW through every kind of handoff ----------------------------------------------------------------


def test_adamw_hands_off_exactly_through_ssp_local_sgd_and_compressed_bsp(
    forkserver_dir: str, tmp_path: Path
) -> None:
    """AdamW (Adam's slots and rescale, plus the decoupled weight decay; plain Adam crosses BSP and ASP
    in test_runtime_cluster): its two moments cross every switch bit for bit (the digest is of the
    state as restored, before the second moment's rescale), the rescale follows each protocol's update
    batch (2 workers of 32: BSP and compressed BSP 64, SSP, local SGD and ASP 32), and the job's update
    count (Adam's bias correction) goes on across them: one per step for the all-reduce protocols, N
    for ASP and SSP."""
    run_dir = tmp_path / "run"
    walk = ("bsp", "ssp:1", "local:2", "topk:0.1", "asp", "fp16")
    update_batch = {"bsp": 64, "cbsp": 64, "ssp": 32, "local": 32, "asp": 32}
    per_step = {"bsp": 1, "cbsp": 1, "local": 1, "ssp": 2, "asp": 2}
    step, updates = 0, 0
    for index, spelled in enumerate(walk):
        steps = 4 if spelled.startswith("local") else 3
        step += steps
        updates += steps * per_step[parse_token(spelled, "test").name]
        summary = train(
            forkserver_dir,
            *("--protocol", spelled, "--workers", "2", "--run-dir", str(run_dir)),
            *("--until-step", str(step), "--segment-index", str(index), "--ckpt-frequency", "0"),
            *("--hparams", "optimizer=adamw,learning_rate=0.003,weight_decay=0.01,steps_per_execution=2"),
        )
        assert summary["global_step"] == step
    for index in range(1, len(walk)):
        before, protocol = (parse_token(walk[i], "test").name for i in (index - 1, index))
        previous = result(run_dir, index - 1, before)
        (start,) = events(run_dir, index, protocol, "segment_start")
        assert start["optimizer"] == "adamw"
        assert start["restored_from"] == previous["checkpoint"]
        assert start["checkpoint_digest"] == start["restored_digest"], (walk[index - 1], walk[index])
        assert start["second_moment_scale"] == update_batch[before] / update_batch[protocol]
    assert result(run_dir, len(walk) - 1, "cbsp")["updates"] == updates
    manifest = checkpoints.latest(RunLayout(str(run_dir)))
    assert manifest["signature"]["optimizer"] == "adamw" and manifest["update_batch"] == 64
    tensors = checkpoint_tensors(run_dir, tmp_path)
    for slot in ("first_moments", "second_moments"):
        moments = [v for n, v in tensors.items() if n.startswith(f"optimizer/{slot}/")]
        assert moments and all(np.isfinite(v).all() for v in moments), slot
        assert any(np.abs(v).max() > 0 for v in moments), f"{slot} trained"


# ---- worker loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelled", ["ssp:2", "local:4", "fp16"])
def test_a_lost_worker_fails_the_segment_and_the_checkpoint_stands(
    forkserver_dir: str, tmp_path: Path, spelled: str, no_leftover_processes
) -> None:
    """As documented (syncswitch.protocols): only ASP goes on without a worker. SSP fails at once (its
    bound would stop the survivors within s steps), local SGD and compressed BSP as BSP does (their
    collectives abort); the last checkpoint is complete, for the retry to resume from."""
    run_dir, work_dir = tmp_path / "run", tmp_path / "work"
    no_leftover_processes(re.escape(str(work_dir)))
    proc = subprocess.Popen(
        [*TRAIN[:-1], "--forkserver", forkserver_dir, "--protocol", spelled, "--workers", "2"]
        + ["--run-dir", str(run_dir), "--until-step", "5000", "--ckpt-frequency", "10"]
        + ["--work-dir", str(work_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        wait_for_progress(work_dir, 25, proc)
        os.kill(node_pid(work_dir, "worker-1"), signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    protocol = parse_token(spelled, "test")
    lost = [e for e in events(run_dir, 0, protocol.name, "node_lost") if e["node"] == "worker-1"]
    outcomes = ("the segment fails", f"{protocol.family.title} cannot continue without it")
    assert lost and lost[0]["outcome"] in outcomes, lost
    manifest = checkpoints.latest(RunLayout(str(run_dir)))
    assert manifest is not None and manifest["global_step"] >= 10 and manifest["global_step"] % 10 == 0
    # The nodes were forked by the module's server (their command lines are its own): by pid.
    for node in json.loads((work_dir / "nodes.json").read_text()).values():
        wait_for(lambda pid=node["pid"]: not alive(pid), timeout=30, what=f"node pid {node['pid']} gone")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
