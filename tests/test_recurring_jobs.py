"""Recurring jobs under the real scheduler: a job file's DAG backfilled through Airflow's own
interfaces (the `airflow backfill create` CLI, then the REST API reprocessing a date), with the
offline timing policy searching (k = 1) while the backfill's runs overlap.

The job (conftest BACKFILL_JOB, `job_backfill_search`) is a daily digits job whose data_dir is a
template of the date. The backfill's three runs are active at once (a backfill's max_active_runs is
10 and not capped by the DAG's), so each claims its decision before provisioning: the first takes
the BSP baseline, the next ones the search's next candidates (0.5, 0.25). Only one local cluster
exists at a time (the backend's capacity): the others wait for it, deferred.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_utils import wait_for
from syncswitch.layout import RunLayout
from syncswitch.state import read_state
from syncswitch_airflow import history, timing
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.tools.compare import RunRef, build_comparison

pytestmark = [pytest.mark.airflow, pytest.mark.cluster]

DAG_ID = "job_backfill_search"
JOB = "backfill-search"
SYNCSWITCH = Path(sys.executable).parent / "syncswitch"


def finished_runs(airflow: EmbeddedAirflow, count: int, timeout: float = 900) -> list[dict]:
    runs: list[dict] = []

    def done() -> bool:
        runs[:] = airflow.api.dag_runs(DAG_ID)
        return len(runs) >= count and all(r["state"] in ("success", "failed") for r in runs)

    wait_for(done, timeout=timeout, what=f"{count} finished runs of {DAG_ID}", poll=3.0)
    return runs


def create_backfill(airflow: EmbeddedAirflow, from_date: str, to_date: str, attempts: int = 3) -> None:
    """``airflow backfill create`` as a user types it. On a loaded machine its SQLite write met
    "database is locked" while the scheduler wrote (two test workers on 2 cores). Airflow then
    deletes the partial backfill so that the user can retry (models/backfill.py), as this does, but
    only while the API lists no backfill of the DAG."""
    for _ in range(attempts):
        created = airflow.command(
            "backfill", "create", "--dag-id", DAG_ID, "--from-date", from_date, "--to-date", to_date
        )
        output = created.stdout + created.stderr
        if created.returncode == 0:
            return
        if "database is locked" not in output or airflow.api.backfills(DAG_ID):
            break
        time.sleep(5)
    raise AssertionError(output)


def training_windows(bucket: str, run_id: str) -> list[tuple[float, float]]:
    state = read_state(RunLayout.for_run(bucket, JOB, run_id)) or {}
    return [(s["started_at"], s["ended_at"]) for s in state.get("segments", {}).values()]


def test_a_backfill_over_three_dates_searches_the_switch_point_and_a_reprocessed_date_gets_its_own_run(
    embedded_airflow: EmbeddedAirflow,
) -> None:
    # The session's bucket folder: the job file's bucket_dir (conftest BACKFILL_JOB).
    airflow, bucket = embedded_airflow, os.environ["SYNCSWITCH_BUCKET_DIR"]
    # Job DAGs start paused (Airflow's default), and a paused DAG's backfill runs stay queued.
    unpaused = airflow.command("dags", "unpause", DAG_ID)
    assert unpaused.returncode == 0, unpaused.stdout + unpaused.stderr
    create_backfill(airflow, "2026-01-01", "2026-01-03")
    runs = finished_runs(airflow, 3)
    assert [r["state"] for r in runs] == ["success"] * 3, runs
    assert {r["run_type"] for r in runs} == {"backfill"}

    records = {r["run_id"]: r for r in history.read_records(bucket, JOB)}
    assert set(records) == {r["dag_run_id"] for r in runs}, "one history record per run"
    # Overlapping runs claimed distinct items of the search: the baseline and the next two candidates.
    assert sorted(r["bsp_fraction"] for r in records.values()) == [0.25, 0.5, 1.0]
    assert {r["policy_phase"] for r in records.values()} == {"baseline", "search"}
    for run in runs:
        layout = RunLayout.for_run(bucket, JOB, run["dag_run_id"])
        state = read_state(layout)
        assert state["status"] == "success" and Path(layout.root).is_dir()
        # The logical date reached the job through the template in its data_dir.
        assert state["job"]["data_dir"] == f"dates/{run['logical_date'][:10]}"
        assert state["timing"]["bsp_fraction"] == records[run["dag_run_id"]]["bsp_fraction"]
        summary = json.loads(Path(layout.report, "summary.json").read_text())
        assert summary["status"] == "success"
    # One cluster at a time: no two runs trained at once.
    windows = sorted(w for run in runs for w in training_windows(bucket, run["dag_run_id"]))
    assert all(earlier[1] <= later[0] for earlier, later in zip(windows, windows[1:], strict=False)), windows

    # The REST API reprocessing one date. Airflow takes one backfill of a DAG at a time, and marks one
    # complete up to 30 s after its last run. Airflow 3 reprocesses a date by clearing its DAG run: the
    # same run id runs again, and trains afresh as a new attempt with its own folder and record.
    wait_for(
        lambda: all(b["completed_at"] for b in airflow.api.backfills(DAG_ID)),
        timeout=120,
        what="the first backfill marked complete",
        poll=2.0,
    )
    [first] = [r for r in runs if r["logical_date"][:10] == "2026-01-02"]
    airflow.api.create_backfill(DAG_ID, "2026-01-02", "2026-01-02", reprocess_behavior="completed")
    wait_for(
        lambda: len(history.read_records(bucket, JOB)) == 4,
        timeout=900,
        what="the reprocessed date's history record",
        poll=3.0,
    )
    before, records = records, {r["run_id"]: r for r in history.read_records(bucket, JOB)}
    [again] = [run_id for run_id in records if run_id not in before]
    assert again.startswith(f"{first['dag_run_id']}.rerun") and records[again]["status"] == "success"
    assert records[again]["logical_date"][:10] == "2026-01-02"
    rerun_state = read_state(RunLayout.for_run(bucket, JOB, again))
    assert rerun_state["status"] == "success" and rerun_state["segments"], "the rerun trained afresh"
    assert read_state(RunLayout.for_run(bucket, JOB, first["dag_run_id"]))["status"] == "success"

    # What the policy decides next from this history is what `syncswitch policy next` prints.
    jsonl = Path(bucket) / "history.jsonl"
    history.write_jsonl(str(jsonl), list(records.values()))
    decided = subprocess.run(
        [str(SYNCSWITCH), "policy", "next", "--history", str(jsonl), "--repeats", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    decision = json.loads(decided.stdout.strip().splitlines()[-1])
    # Which phase comes next depends on the four accuracies (k = 1 on digits: a candidate may be
    # rejected, an exploit run may start a new generation); the CLI must say what the policy says.
    [fingerprint] = {r["fingerprint"] for r in records.values()}
    expected = timing.decide(list(records.values()), [], fingerprint, timing.TimingConfig(repeats=1), 0.0)
    assert (decision["bsp_fraction"], decision["phase"], decision["reason"]) == (
        expected.bsp_fraction,
        expected.phase,
        expected.reason,
    )
    assert decision["fingerprint"] == fingerprint
    shown = subprocess.run(
        [str(SYNCSWITCH), "history", JOB, "--bucket-dir", bucket], capture_output=True, text=True, check=True
    )
    assert all(run_id[:20] in shown.stdout for run_id in records)

    # The four runs as a comparison (the sweep's report), one config per BSP fraction.
    refs = [
        RunRef(f"bsp-{r['bsp_fraction']}", RunLayout.for_run(bucket, JOB, run_id).root)
        for run_id, r in records.items()
    ]
    out = Path(bucket) / "_sweeps" / "backfill"
    comparison = build_comparison(refs, str(out), baseline="bsp-1.0", target_accuracy=0.3)
    rows = {row["label"]: row for row in comparison["configs"]}
    assert {"bsp-0.25", "bsp-0.5", "bsp-1.0"} <= set(rows) and sum(r["runs"] for r in rows.values()) == 4
    assert rows["bsp-1.0"]["total_seconds_vs_baseline"] == pytest.approx(1.0)
    for run in comparison["runs"]:
        assert 0.3 <= run["final_accuracy"] <= 1.0
        # Checkpoints were evaluated: the first one at 0.3 or better is before the training's end.
        assert 0 < run["seconds_to_target"] < run["total_seconds"], run
    assert rows["bsp-0.5"]["switch_overhead_seconds"] > 0 and rows["bsp-1.0"]["switch_overhead_seconds"] == 0
    assert json.loads((out / "comparison.json").read_text())["baseline"] == "bsp-1.0"
    assert {p.name for p in out.iterdir()} >= {
        "comparison.html",
        "accuracy_and_time.png",
        "accuracy_over_time.png",
    }
    assert "bsp-0.25" in (out / "comparison.html").read_text()
