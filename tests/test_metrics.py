"""The pipeline's metrics (plugins/syncswitch_airflow/metrics.py, docs/metrics.md).

The first tests send through Airflow's real ``Stats`` in this process to a StatsD sink (conftest
``statsd_here``); the last runs a job on the session's embedded Airflow, which sends every metric to
the session's sink (conftest ``statsd_sink``), and reads them off the wire.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from airflow_runs import LocalSegmentNodes, trigger, wait_for_step, wait_run
from proc_utils import ProgressThrottle, wait_for
from statsd_sink import Sample, StatsdSink, parse_line
from syncswitch import storage
from syncswitch.layout import RunLayout
from syncswitch.state import create_run, store_segment_result
from syncswitch_airflow import metrics
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.triggers.segment import SegmentEvents

PROJECT_DIR = Path(__file__).resolve().parents[1]
PREFIX = "airflow."  # Airflow's default [metrics] statsd_prefix


def by_name(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == PREFIX + name]


def wait_for_samples(sink: StatsdSink, name: str, count: int = 1, timeout: float = 10.0) -> list[Sample]:
    wait_for(lambda: len(by_name(sink.received(), name)) >= count, timeout=timeout, what=f"{count} x {name}")
    return by_name(sink.received(), name)


# ---- the names and their table ----------------------------------------------------------------------


def test_every_metric_is_in_the_docs_table_with_its_kind_unit_and_tags() -> None:
    rows = {}
    for line in (PROJECT_DIR / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `syncswitch."):
            rows[cells[0].strip("`")] = cells[1:4]
    assert rows == {m.name: [m.kind, m.unit, ", ".join(m.tags)] for m in metrics.METRICS}
    assert len({m.name for m in metrics.METRICS}) == len(metrics.METRICS)
    assert all(m.name.startswith("syncswitch.") for m in metrics.METRICS)


def test_a_statsd_line_parses_with_its_tags() -> None:
    assert parse_line("airflow.syncswitch.switch.gap,dag_id=d,segment=1:1234.5|ms") == Sample(
        "airflow.syncswitch.switch.gap", 1234.5, "ms", {"dag_id": "d", "segment": "1"}
    )
    assert parse_line("garbage") is None


# ---- sending through Airflow's Stats ----------------------------------------------------------------


def test_each_kind_reaches_statsd_with_its_own_tags_made_safe(statsd_here: StatsdSink) -> None:
    """A gauge, a counter and a timing (seconds in, milliseconds out), each with only the tags its
    metric names, and values Airflow would refuse (':' '+' '/') made safe rather than dropped."""
    metrics.send(
        metrics.SEGMENT_EXAMPLES_PER_SEC,
        812.5,
        dag_id="sync_switch",
        job_name="j",
        segment=0,
        protocol="bsp",
        origin="plan",
        run_id="manual__2026:01+00",
    )
    metrics.send(
        metrics.ONLINE_SWITCHES,
        1,
        dag_id="a/b",
        job_name="j",
        protocol="bsp",
        segment=2,
        policy="greedy",
        action="switch",
    )
    metrics.send(
        metrics.SWITCH_GAP, 2.5, dag_id="d", job_name="j", segment=1, from_protocol="bsp", to_protocol="asp"
    )
    (gauge,) = wait_for_samples(statsd_here, "syncswitch.segment.examples_per_sec")
    assert (gauge.value, gauge.kind) == (812.5, "g")
    assert gauge.tags == {
        "dag_id": "sync_switch",
        "job_name": "j",
        "protocol": "bsp",
        "segment": "0",
        "origin": "plan",
    }  # no run_id: not one of the metric's tags
    (counter,) = wait_for_samples(statsd_here, "syncswitch.online.switches")
    assert (counter.value, counter.kind, counter.tags["dag_id"]) == (1, "c", "a_b")
    (timing,) = wait_for_samples(statsd_here, "syncswitch.switch.gap")
    assert (timing.value, timing.kind) == (2500.0, "ms")
    assert not statsd_here.unparsed


def test_a_segment_record_sends_its_metrics_once(tmp_path: Path, statsd_here: StatsdSink) -> None:
    """The first record of a SegmentResult sends its throughput, duration, the chief's retries and the
    switch gap before it; the same result recorded again (a restarted trigger, the task after its
    trigger) sends nothing."""
    layout = RunLayout(str(tmp_path / "run"))
    plan = [
        {"index": 0, "protocol": "bsp", "until_step": 10, "origin": "plan"},
        {"index": 1, "protocol": "asp", "until_step": 20, "origin": "online"},
    ]
    create_run(layout, "r", {"job_name": "job-a"}, plan)
    first = {
        "index": 0,
        "protocol": "bsp",
        "end_step": 10,
        "seconds": 4.0,
        "examples_per_sec": 100.0,
        "started_at": 100.0,
        "first_step_at": 102.0,
        "ended_at": 106.0,
        "bucket_retries": 0,
    }
    second = {
        "index": 1,
        "protocol": "asp",
        "end_step": 20,
        "seconds": 2.0,
        "examples_per_sec": 300.0,
        "started_at": 106.5,
        "first_step_at": 108.0,
        "ended_at": 110.0,
        "bucket_retries": 2,
    }
    for index, result in ((0, first), (1, second), (1, second)):
        state, new = store_segment_result(layout, index, result)
        if new:
            metrics.segment_recorded(state, index, result, "sync_switch")
    assert store_segment_result(layout, 1, second)[1] is False
    rates = wait_for_samples(statsd_here, "syncswitch.segment.examples_per_sec", 2)
    assert [(s.value, s.tags["protocol"], s.tags["origin"]) for s in rates] == [
        (100.0, "bsp", "plan"),
        (300.0, "asp", "online"),
    ]
    (gap,) = wait_for_samples(statsd_here, "syncswitch.switch.gap")
    assert gap.value == pytest.approx(2000.0) and gap.tags["from_protocol"] == "bsp"
    (handoff,) = wait_for_samples(statsd_here, "syncswitch.switch.handoff")
    assert handoff.value == pytest.approx(500.0)
    retries = wait_for_samples(statsd_here, "syncswitch.bucket.retries", 2)
    assert [(s.value, s.tags["side"], s.tags["segment"]) for s in retries] == [
        (0, "chief", "0"),
        (2, "chief", "1"),
    ]
    assert len(by_name(statsd_here.received(), "syncswitch.segment.duration")) == 2


def test_the_airflow_sides_bucket_retries_are_counted(
    statsd_here: StatsdSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storage.retrying counts each retry and tells its listeners; the provider's listener (registered
    by hooks.bucket) sends one metric per retry."""
    import syncswitch_airflow.hooks.bucket  # noqa: F401 - registers the listener

    monkeypatch.setattr(storage, "_FIRST_BACKOFF_SECONDS", 0.01)
    failures = iter([ConnectionError("refused"), ConnectionError("refused")])

    def flaky() -> str:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "ok"

    before = storage.retry_count()
    assert storage.retrying("read gs://b/x", flaky) == "ok"
    assert storage.retry_count() == before + 2
    retries = wait_for_samples(statsd_here, "syncswitch.bucket.retries", 2)
    assert [(s.value, s.tags) for s in retries] == [(1, {"side": "airflow"})] * 2


def test_the_checkpoint_age_counts_from_the_newest_checkpoint_or_the_first_step() -> None:
    seen = SegmentEvents()
    assert seen.checkpoint_age(100.0) is None
    lost = seen.follow(
        [
            {"event": "step", "global_step": 5, "wall_time": 10.0},
            {"event": "node_lost", "node": "worker-1", "wall_time": 11.0},
            {"event": "step", "global_step": 9, "wall_time": 12.0},
        ]
    )
    assert [e["node"] for e in lost] == ["worker-1"]
    assert seen.checkpoint_age(15.0) == 5.0 and seen.progress.global_step == 9
    seen.follow([{"event": "checkpoint", "global_step": 10, "wall_time": 13.0}])
    assert seen.checkpoint_age(15.0) == 2.0


def test_a_node_loss_and_a_decision_send_their_tags(statsd_here: StatsdSink) -> None:
    metrics.node_lost(
        {"node": "worker-2", "outcome": "ASP continues with the survivors"},
        dag_id="d",
        job_name="j",
        protocol="asp",
        segment=1,
        backend="hosts",
    )
    metrics.node_lost(
        {"node": "ps-0", "outcome": "the segment fails"},
        dag_id="d",
        job_name="j",
        protocol="asp",
        segment=1,
        backend="hosts",
    )
    lost = wait_for_samples(statsd_here, "syncswitch.cluster.node_losses", 2)
    assert [(s.tags["role"], s.tags["outcome"], s.tags["backend"]) for s in lost] == [
        ("worker", "continues", "hosts"),
        ("ps", "fails", "hosts"),
    ]
    record = {"segment": 0, "protocol": "bsp", "policy": "greedy", "action": "stay", "change": "raised"}
    metrics.decision(record, "d", "j", switched=False)
    (decided,) = wait_for_samples(statsd_here, "syncswitch.online.decisions")
    assert decided.tags["action"] == "stay" and not by_name(
        statsd_here.received(), "syncswitch.online.switches"
    )


def test_metrics_off_sends_nothing_and_raises_nothing() -> None:
    with StatsdSink() as sink:
        metrics.send(metrics.RUN_FINISHED, 1, dag_id="d", job_name="j", status="success")
        metrics.run_finished("success", "d", "j", 0.9, 12.0)
    assert sink.received() == []


# ---- a run on the session's embedded Airflow ---------------------------------------------------------

JOB = "metrics-e2e"
BSP_STEPS = 4000


def test_a_run_on_the_embedded_airflow_sends_each_metric_it_makes(
    metrics_airflow: EmbeddedAirflow, statsd_sink: StatsdSink, tmp_path: Path
) -> None:
    """A "10" digits job with greedy online switching on the real scheduler, which sends its metrics to
    the session's StatsD sink: worker 1 of the BSP segment runs at a quarter speed until greedy has
    switched to ASP (an online segment to the BSP target, then the planned ASP one), and worker 1 of
    the online ASP segment is killed once it steps (ASP goes on without it). Every metric such a run
    makes arrives, tagged, with a plausible value: the segments' throughput and duration, the two
    switch gaps, the decision and the switch, the checkpoint's age, the node loss, the chief's bucket
    retries (none) and the run's outcome and accuracy. (The Airflow side's bucket retries are
    above; a failed segment in test_segment_trigger and test_hosts_backend; revocations and
    replacements in test_gce_backend.)"""
    runs = tmp_path / "runs"

    def switched() -> bool:
        states = (json.loads(p.read_text()) for p in runs.glob(f"{JOB}/*/state.json"))
        return any(d["action"] == "switch" for state in states for d in state.get("decisions", []))

    conf = {
        "job_name": JOB,
        "bucket_dir": str(runs),
        "switch_order": "10",
        "train_steps": [BSP_STEPS, 100],
        "ckpt_frequency": [500],
        "online_policy": "greedy",
        "max_online_switches": 1,
    }
    with ProgressThrottle(LocalSegmentNodes(JOB, 0, "worker-1"), switched) as straggler:
        run_id, layout = trigger(metrics_airflow, conf)
        wait_for(switched, timeout=600, what="greedy's switch to ASP", poll=1)
    assert straggler.slowed, "the BSP segment's worker 1 was never found"
    wait_for_step(layout, 1, "asp", 1)
    (worker,) = LocalSegmentNodes(JOB, 1, "worker-1")()
    os.kill(worker, signal.SIGKILL)
    assert wait_run(metrics_airflow, run_id) == "success"
    state = json.loads(Path(layout.state).read_text())
    assert [(e["protocol"], e["origin"]) for e in state["plan"]] == [
        ("bsp", "plan"),
        ("asp", "online"),
        ("asp", "plan"),
    ]

    def ours(name: str, count: int = 1) -> list[Sample]:
        wait_for(lambda: len(mine(name)) >= count, timeout=30, what=lambda: f"{count} x {name}: {mine(name)}")
        return mine(name)

    def mine(name: str) -> list[Sample]:
        return [s for s in by_name(statsd_sink.received(), name) if s.tags.get("job_name") == JOB]

    rates = ours("syncswitch.segment.examples_per_sec", 3)
    assert [(s.tags["segment"], s.tags["protocol"], s.tags["origin"]) for s in rates] == [
        ("0", "bsp", "plan"),
        ("1", "asp", "online"),
        ("2", "asp", "plan"),
    ]
    assert all(s.tags["dag_id"] == "sync_switch" and 1 < s.value < 1e6 for s in rates), rates
    assert all(0 < s.value < 600_000 for s in ours("syncswitch.segment.duration", 3))
    gaps = ours("syncswitch.switch.gap", 2)
    assert [(s.tags["segment"], s.tags["from_protocol"], s.tags["to_protocol"]) for s in gaps] == [
        ("1", "bsp", "asp"),
        ("2", "asp", "asp"),
    ]
    assert all(0 < s.value < 120_000 for s in gaps), gaps
    handoffs = ours("syncswitch.switch.handoff", 2)
    assert all(0 < h.value <= g.value for h, g in zip(handoffs, gaps, strict=True)), (handoffs, gaps)
    switches = ours("syncswitch.online.switches")
    assert [(s.value, s.tags["policy"], s.tags["action"], s.tags["segment"]) for s in switches] == [
        (1, "greedy", "switch", "0")
    ]
    assert {"greedy"} == {s.tags["policy"] for s in ours("syncswitch.online.decisions")}
    ages = ours("syncswitch.checkpoint.age")
    assert {"0"} <= {s.tags["segment"] for s in ages} and all(0 <= s.value < 600 for s in ages), ages
    (lost,) = ours("syncswitch.cluster.node_losses")
    assert (lost.value, lost.tags["role"], lost.tags["outcome"], lost.tags["segment"]) == (
        1,
        "worker",
        "continues",
        "1",
    )
    retries = ours("syncswitch.bucket.retries", 3)
    assert [(s.value, s.tags["side"]) for s in retries] == [(0, "chief")] * 3
    (finished,) = ours("syncswitch.run.finished")
    assert finished.tags["status"] == "success"
    (accuracy,) = ours("syncswitch.run.final_accuracy")
    assert accuracy.value == pytest.approx(state["final"]["test_accuracy"]) and 0.3 < accuracy.value <= 1
    assert 0 < ours("syncswitch.run.duration")[0].value < 1_800_000
