"""The job history store (local folder and the real GCS emulator), the fingerprint, the import format,
and the ``syncswitch history`` / ``syncswitch policy next`` commands run as the real console script."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from syncswitch import storage
from syncswitch.layout import JobHistoryLayout, join
from syncswitch.spec import JobSpec
from syncswitch_airflow.history import (
    RecordConflict,
    RecordError,
    claim_decision,
    import_records,
    job_fingerprint,
    read_claim,
    read_claims,
    read_jsonl,
    read_records,
    validate_record,
    write_claim,
    write_jsonl,
    write_record,
)

SYNCSWITCH = Path(sys.executable).parent / "syncswitch"
JOB = "res20"
FP = "0123456789abcdef"
T0 = 1_700_000_000.0


def record(
    run_id: str, fraction: float = 1.0, accuracy: float | None = 0.75, **changes: Any
) -> dict[str, Any]:
    base = {
        "job_name": JOB,
        "run_id": run_id,
        "logical_date": "2024-01-01T00:00:00+00:00",
        "status": "success",
        "bsp_fraction": fraction,
        "final_accuracy": accuracy,
        "total_seconds": 600.0,
        "training_seconds": {"bsp": 400.0 * fraction, "asp": 400.0 * (1 - fraction)},
        "fingerprint": FP,
        "policy_phase": "baseline",
        "finished_at": T0,
    }
    return {**base, **changes}


def claim(run_id: str, fraction: float = 1.0, claimed_at: float = T0) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "fingerprint": FP,
        "bsp_fraction": fraction,
        "phase": "baseline",
        "claimed_at": claimed_at,
    }


@pytest.fixture(params=["local", "gcs"])
def bucket_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A bucket_dir that does not exist yet: a local folder or a prefix in a fresh emulator bucket."""
    if request.param == "local":
        return str(tmp_path / "bucket")
    return join(request.getfixturevalue("gcs_bucket"), "runs")


# ---- the store -------------------------------------------------------------------------------------


def test_records_and_claims_round_trip_in_completion_order(bucket_dir: str) -> None:
    assert read_records(bucket_dir, JOB) == [] and read_claims(bucket_dir, JOB) == []
    late = record("manual__2024-01-01T00:00:00+00:00", finished_at=T0 + 50)
    early = record("scheduled__2024-01-02T00:00:00+00:00", 0.5, finished_at=T0 + 10)
    assert write_record(bucket_dir, JOB, late) is True
    assert write_record(bucket_dir, JOB, early) is True
    assert write_claim(bucket_dir, JOB, claim("b", claimed_at=T0 + 2)) is True
    assert write_claim(bucket_dir, JOB, claim("a", 0.5, claimed_at=T0 + 1)) is True

    records = read_records(bucket_dir, JOB)
    assert [r["run_id"] for r in records] == [early["run_id"], late["run_id"]]
    assert records[0] == {**early, "schema_version": 1}
    assert [c["run_id"] for c in read_claims(bucket_dir, JOB)] == ["a", "b"]
    assert read_claim(bucket_dir, JOB, "a") == claim("a", 0.5, claimed_at=T0 + 1)
    assert read_claim(bucket_dir, JOB, "never-started") is None
    # Where they live: <bucket_dir>/_history/<job>/runs/<safe_run_id>.json, and claims.json
    layout = JobHistoryLayout.for_job(bucket_dir, JOB)
    assert layout.root == join(bucket_dir, "_history", JOB)
    assert storage.exists(join(layout.root, "runs", "manual__2024-01-01T00_00_00_00_00.json"))
    assert sorted(storage.read_json(layout.claims)) == ["a", "b"]


def test_runs_deciding_at_once_each_see_the_claims_before_theirs(bucket_dir: str) -> None:
    """Deciding and claiming are one atomic step: six runs racing for items never take the same one."""
    items = [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]
    start = threading.Barrier(len(items))

    def next_item(run_id: str) -> Callable[[list[dict]], dict]:
        def decide(claims: list[dict]) -> dict:
            taken = {c["bsp_fraction"] for c in claims}
            time.sleep(0.05)  # a slow decision widens the window in which the others decide too
            return claim(run_id, next(f for f in items if f not in taken), claimed_at=time.time())

        return decide

    def run(number: int) -> float:
        start.wait()
        decided, new = claim_decision(bucket_dir, JOB, f"run-{number}", next_item(f"run-{number}"))
        assert new
        return decided["bsp_fraction"]

    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        taken = list(pool.map(run, range(len(items))))
    assert sorted(taken) == sorted(items)
    # A retried task gets its own claim back without deciding again.
    again, new = claim_decision(bucket_dir, JOB, "run-0", lambda _claims: pytest.fail("decided again"))
    assert (again["bsp_fraction"], new) == (taken[0], False)


def test_records_are_immutable(bucket_dir: str) -> None:
    first = record("scheduled__2024-01-01T00:00:00+00:00")
    assert write_record(bucket_dir, JOB, first) is True
    assert write_record(bucket_dir, JOB, dict(first)) is False  # a retried write: no-op
    with pytest.raises(RecordConflict, match="immutable"):
        write_record(bucket_dir, JOB, {**first, "final_accuracy": 0.5})
    assert write_claim(bucket_dir, JOB, claim(first["run_id"])) is True
    with pytest.raises(RecordConflict):
        write_claim(bucket_dir, JOB, claim(first["run_id"], 0.5))
    assert read_claim(bucket_dir, JOB, first["run_id"])["bsp_fraction"] == 1.0
    # A reprocessed date is a new DAG run with a new run id: its own record.
    again = record("manual__2024-01-05T10:00:00+00:00", final_accuracy=0.5, finished_at=T0 + 99)
    assert write_record(bucket_dir, JOB, again) is True
    assert [r["final_accuracy"] for r in read_records(bucket_dir, JOB)] == [0.75, 0.5]


def test_a_failed_record_gives_way_to_the_same_run_finishing_later_and_no_other(bucket_dir: str) -> None:
    """A failed run resumed by clearing its failed tasks finishes again; its record says how it ended.
    A success is final, and an older record never replaces a newer one."""
    failed = record("manual__2024-01-05T10:00:00+00:00", accuracy=None, status="failed", finished_at=T0 + 10)
    assert write_record(bucket_dir, JOB, failed) is True
    with pytest.raises(RecordConflict):  # not finished after the failure: not a resumption
        write_record(bucket_dir, JOB, {**failed, "status": "success", "finished_at": T0 + 5})
    failed_again = {**failed, "finished_at": T0 + 20}  # resumed, and failed again
    assert write_record(bucket_dir, JOB, failed_again) is True
    resumed = {**failed, "status": "success", "final_accuracy": 0.9, "finished_at": T0 + 30}
    assert write_record(bucket_dir, JOB, resumed) is True
    assert write_record(bucket_dir, JOB, dict(resumed)) is False
    with pytest.raises(RecordConflict, match="immutable"):
        write_record(bucket_dir, JOB, {**resumed, "status": "failed", "finished_at": T0 + 40})
    assert [(r["status"], r["final_accuracy"]) for r in read_records(bucket_dir, JOB)] == [("success", 0.9)]


def test_run_ids_that_share_a_file_name_do_not_overwrite_each_other(tmp_path: Path) -> None:
    bucket = str(tmp_path)
    write_record(bucket, JOB, record("a:b"))
    with pytest.raises(RecordConflict):
        write_record(bucket, JOB, record("a+b"))
    assert [r["run_id"] for r in read_records(bucket, JOB)] == ["a:b"]


def test_a_record_must_be_of_the_job_it_is_written_to(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="^job_name: the record is of job 'res20', not 'other'"):
        write_record(str(tmp_path), "other", record("r1"))
    with pytest.raises(RecordError, match="^job_name:"):
        read_records(str(tmp_path), "_history")


# ---- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"status": "running"}, "status"),
        ({"bsp_fraction": 1.5}, "bsp_fraction"),
        ({"bsp_fraction": True}, "bsp_fraction"),
        ({"final_accuracy": "0.9"}, "final_accuracy"),
        ({"total_seconds": -1}, "total_seconds"),
        ({"training_seconds": {"bsp": 1.0}}, "training_seconds"),
        ({"training_seconds": {"bsp": 1.0, "asp": -2}}, "training_seconds.asp"),
        ({"logical_date": "yesterday"}, "logical_date"),
        ({"policy_phase": "guess"}, "policy_phase"),
        ({"job_name": "Res20"}, "job_name"),
        ({"fingerprint": ""}, "fingerprint"),
        ({"switch_order": "12"}, "switch_order"),
        ({"workload_steps": 0}, "workload_steps"),
        ({"schema_version": 2}, "schema_version"),
        ({"final_acc": 0.9}, "final_acc"),
    ],
)
def test_validate_record_names_the_bad_field(changes: dict[str, Any], field_name: str) -> None:
    with pytest.raises(RecordError, match=rf"^{field_name}: ") as caught:
        validate_record(record("r1", **changes))
    assert caught.value.field == field_name


def test_validate_record_requires_fields_and_fills_optional_defaults() -> None:
    incomplete = record("r1")
    del incomplete["fingerprint"]
    with pytest.raises(RecordError, match="^fingerprint: missing; required fields: job_name, run_id"):
        validate_record(incomplete)
    minimal = record("r1")
    del minimal["finished_at"]
    checked = validate_record({**minimal, "final_accuracy": None, "logical_date": None, "cost": None})
    assert checked["finished_at"] == 0.0 and checked["schema_version"] == 1
    assert checked["final_accuracy"] is None


# ---- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_covers_the_settings_that_change_accuracy_and_nothing_else() -> None:
    params = JobSpec(total_steps=400, bsp_fraction=0.25).to_params()
    fingerprint = job_fingerprint(params)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    unchanged = {
        "switch_order": "101",
        "bsp_fraction": 0.5,
        "data_dir": "gs://data/2024-01-02",
        "seed": 7,
        "bucket_dir": "gs://elsewhere",
        "job_name": "another-job",
        "online_policy": "greedy",
        "max_online_switches": 5,
        "stragglers": ["worker=1,start=1,duration=1,slowdown=2"],
        "ckpt_frequency": [10],
    }
    for name, value in unchanged.items():
        assert job_fingerprint({**params, name: value}) == fingerprint, name
    changed = {
        "model": "resnet",
        "hparam_set": "cnn_other",
        "problem": "image_cifar10",
        "num_workers": 4,
        "total_steps": 800,
        "hparams": ["learning_rate=0.4"],
        "momentum_rule": "zero",
        "momentum_ramp_steps": 10,
    }
    for name, value in changed.items():
        assert job_fingerprint({**params, name: value}) != fingerprint, name


def test_fingerprint_counts_the_workload_whether_given_as_train_steps_or_total_steps() -> None:
    by_total = JobSpec(total_steps=400).to_params()
    by_segments = JobSpec(train_steps=(100, 300), total_steps=999).to_params()
    assert job_fingerprint(by_total) == job_fingerprint(by_segments)
    # Left-out settings take JobSpec's defaults; raw conf strings are read as numbers.
    assert job_fingerprint({}) == job_fingerprint(JobSpec().to_params())
    assert job_fingerprint({"num_workers": "2", "total_steps": "400"}) == job_fingerprint({})


# ---- JSON lines ------------------------------------------------------------------------------------


def test_jsonl_round_trip_and_import(bucket_dir: str, tmp_path: Path) -> None:
    path = str(tmp_path / "history.jsonl")
    records = [record("r1", finished_at=T0 + 1), record("r2", 0.5, finished_at=T0 + 2)]
    write_jsonl(path, records)
    assert read_jsonl(path) == [{**r, "schema_version": 1} for r in records]
    assert import_records(bucket_dir, JOB, path) == {"written": 2, "unchanged": 0}
    assert import_records(bucket_dir, JOB, path) == {"written": 0, "unchanged": 2}
    assert [r["run_id"] for r in read_records(bucket_dir, JOB)] == ["r1", "r2"]


def test_imported_lines_without_a_phase_or_finish_time_get_documented_defaults(tmp_path: Path) -> None:
    line = record("r1")
    del line["policy_phase"], line["finished_at"]
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(line) + "\n\n")
    (imported,) = read_jsonl(str(path))
    assert imported["policy_phase"] == "imported" and imported["finished_at"] == 0.0


def test_a_bad_import_line_names_the_line_and_field_and_imports_nothing(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(record("r1")) + "\n" + json.dumps(record("r2", 1.25)) + "\n")
    with pytest.raises(RecordError, match=r"^line 2: bsp_fraction: must be a number in \[0, 1\], got 1.25"):
        import_records(bucket, JOB, str(path))
    path.write_text(json.dumps(record("r1")) + "\n{not json\n")
    with pytest.raises(RecordError, match="^line 2: json: not valid JSON"):
        import_records(bucket, JOB, str(path))
    path.write_text(json.dumps(record("r1")) + "\n" + json.dumps(record("r1", 0.5)) + "\n")
    with pytest.raises(RecordError, match="^line 2: run_id: 'r1' differs from line 1"):
        import_records(bucket, JOB, str(path))
    path.write_text(json.dumps(record("r1", job_name="other")) + "\n")
    with pytest.raises(RecordError, match="^line 1: job_name: 'other' is not the job 'res20'"):
        import_records(bucket, JOB, str(path))
    assert read_records(bucket, JOB) == []


# ---- the commands ----------------------------------------------------------------------------------


def syncswitch(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SYNCSWITCH), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _search_history(path: Path) -> None:
    """k=1: baseline 0.75, 0.5 accepted, 0.25 rejected, one failed run, all one fingerprint."""
    records = [
        record("scheduled__2024-01-01", 1.0, 0.75, finished_at=T0 + 1),
        record("scheduled__2024-01-02", 0.5, 0.75, finished_at=T0 + 2, policy_phase="search"),
        record("scheduled__2024-01-03", 0.25, None, status="failed", finished_at=T0 + 3),
        record("scheduled__2024-01-04", 0.25, 0.5, finished_at=T0 + 4, policy_phase="search"),
    ]
    write_jsonl(str(path), records)


def test_policy_next_prints_the_decision_as_the_last_stdout_line(tmp_path: Path) -> None:
    _search_history(tmp_path / "h.jsonl")
    done = syncswitch("policy", "next", "--history", "h.jsonl", "--repeats", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    decision = json.loads(done.stdout.strip().splitlines()[-1])
    assert (decision["bsp_fraction"], decision["phase"]) == (0.5, "exploit")
    assert decision["fingerprint"] == FP and decision["numbers"]["config"]["repeats"] == 1
    assert "smallest accepted fraction 0.5" in decision["reason"]
    assert "decision: bsp_fraction 0.5 (exploit)" in done.stderr

    # Defaults (k=3) and another fingerprint give other answers from the same file.
    done = syncswitch("policy", "next", "--history", "h.jsonl", cwd=tmp_path)
    assert json.loads(done.stdout.splitlines()[-1])["bsp_fraction"] == 1.0
    done = syncswitch("policy", "next", "--history", "h.jsonl", "--fingerprint", "new", cwd=tmp_path)
    assert json.loads(done.stdout.splitlines()[-1])["phase"] == "baseline"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "two"], "--repeats: must be an integer >= 1, got 'two'"),
        (["--tolerance", "-0.1"], "--tolerance: must be a number >= 0"),
        (["--floor", "0.9"], "--floor: must be a number in (0, 0.5]"),
        (["--refine", "1.5"], "--refine: must be an integer >= 0"),
        (["--history", "missing.jsonl"], "--history: no such file: missing.jsonl"),
        (["--history", "bad.jsonl"], "line 1: status: 'done' is not one of: success, failed"),
        (["--wat"], "unrecognized arguments: --wat"),
    ],
)
def test_policy_next_rejects_bad_input_naming_the_flag(tmp_path: Path, args: list[str], message: str) -> None:
    _search_history(tmp_path / "h.jsonl")
    write_jsonl(str(tmp_path / "bad.jsonl"), [record("r1", status="done")])
    argv = args if "--history" in args else ["--history", "h.jsonl", *args]
    done = syncswitch("policy", "next", *argv, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("syncswitch policy next: error: ") and message in done.stderr


def test_history_import_then_show_the_table_and_search_state(tmp_path: Path) -> None:
    _search_history(tmp_path / "h.jsonl")
    done = syncswitch("history", "import", JOB, "h.jsonl", "--bucket-dir", "b", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "imported 4 record(s)" in done.stdout

    # The bucket defaults to $SYNCSWITCH_BUCKET_DIR.
    done = syncswitch("history", JOB, "--repeats", "1", cwd=tmp_path, env={"SYNCSWITCH_BUCKET_DIR": "b"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("finished_at"))
    assert lines[header].split() == [
        *("finished_at", "run_id", "logical_date", "status", "fraction", "accuracy"),
        *("total", "s", "bsp", "s", "asp", "s", "other", "s", "order", "phase", "fingerprint"),
    ]
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [row[2] for row in rows] == [f"scheduled__2024-01-0{i}" for i in range(1, 5)]
    assert rows[2][4:6] == ["failed", "0.25"] and rows[2][6] == "-"
    assert rows[3][-1] == FP[:8]
    text = [" ".join(line.split()) for line in lines[header + 5 :]]
    assert text[1].startswith(f"search state, fingerprint {FP} (current configuration; repeats 1,")
    assert text[2:6] == [
        "generation 1: 3 successful run(s) of this configuration",
        "baseline 1.0 0.7500 ± - (n=1) complete",
        "halving 0.5 0.7500 ± - (n=1) accepted",
        "halving 0.25 0.5000 ± - (n=1) rejected",
    ]
    assert text[-1].startswith("next run: bsp_fraction 0.5 (exploit): Search of generation 1 finished")

    done = syncswitch("history", JOB, "--bucket-dir", "b", "--json", cwd=tmp_path)
    data = json.loads(done.stdout.splitlines()[-1])
    assert [r["run_id"] for r in data["records"]][0] == "scheduled__2024-01-01"
    assert data["search"][0]["decision"]["bsp_fraction"] == 1.0  # default k=3: baseline still


def test_history_commands_on_a_gs_bucket(gcs_bucket: str, tmp_path: Path) -> None:
    _search_history(tmp_path / "h.jsonl")
    bucket_dir = join(gcs_bucket, "runs")
    done = syncswitch("history", "import", JOB, "h.jsonl", "--bucket-dir", bucket_dir, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(read_records(bucket_dir, JOB)) == 4
    done = syncswitch("history", JOB, "--bucket-dir", bucket_dir, "--repeats", "1", cwd=tmp_path)
    assert done.returncode == 0 and "next run: bsp_fraction 0.5 (exploit)" in done.stdout


def test_history_commands_reject_bad_input(tmp_path: Path) -> None:
    done = syncswitch("history", "Not_A_Job", cwd=tmp_path)
    assert done.returncode == 2 and "syncswitch history: error: job_name: 'Not_A_Job' must be" in done.stderr
    done = syncswitch("history", "jobs/not-there.yaml", cwd=tmp_path)
    assert (
        done.returncode == 2
        and "syncswitch history: error: JOB: no job file jobs/not-there.yaml" in done.stderr
    )
    (tmp_path / "h.jsonl").write_text(json.dumps(record("r1")) + "\n" + json.dumps(record("r2", -1)) + "\n")
    done = syncswitch("history", "import", JOB, "h.jsonl", "--bucket-dir", "b", cwd=tmp_path)
    assert done.returncode == 2
    assert "syncswitch history import: error: line 2: bsp_fraction: must be a number in [0, 1]" in done.stderr
    assert not (tmp_path / "b").exists()
    done = syncswitch("policy", cwd=tmp_path)
    assert done.returncode == 2 and "usage: syncswitch policy next" in done.stderr
    done = syncswitch("nonsense", cwd=tmp_path)
    assert (
        done.returncode == 2 and "unknown command 'nonsense'" in done.stderr and "  history " in done.stderr
    )


def test_history_shows_the_search_under_the_job_files_timing_settings(tmp_path: Path) -> None:
    """Issue 21's bug: the job file's timing_repeats/timing_tolerance govern its runs, so the history
    command must show the search state (and the next run) under them, not under the defaults."""
    _search_history(tmp_path / "h.jsonl")
    assert syncswitch("history", "import", JOB, "h.jsonl", "--bucket-dir", "b", cwd=tmp_path).returncode == 0
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / f"{JOB}.yaml").write_text(
        "schedule: '@daily'\nstart_date: 2024-01-01\nparams:\n  timing_policy: search\n"
        "  timing_repeats: 1\n  timing_tolerance: 0.01\n"
    )
    env = {"SYNCSWITCH_JOBS_DIR": str(jobs)}
    done = syncswitch("history", JOB, "--bucket-dir", "b", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    state_line = next(line for line in done.stdout.splitlines() if line.startswith("search state"))
    assert "repeats 1, tolerance 0.01" in " ".join(state_line.split()), state_line
    # The next run's line is what the job's next run does (with k=1: 0.5, accepted; the defaults,
    # k=3, would still want baseline runs: 1.0).
    next_line = next(line for line in done.stdout.splitlines() if line.strip().startswith("next run:"))
    assert "next run: bsp_fraction 0.5 (exploit)" in next_line, next_line
    # A flag still wins over the job file.
    done = syncswitch("history", JOB, "--bucket-dir", "b", "--repeats", "2", cwd=tmp_path, env=env)
    assert "repeats 2, tolerance 0.01" in " ".join(done.stdout.split())


def test_history_reads_the_job_files_bucket_and_says_when_nothing_matches(tmp_path: Path) -> None:
    """A job file's bucket_dir is where its DAG runs write their records, so `history JOB` reads there
    without --bucket-dir (the flag still wins). A name with neither records nor a job file is said to
    be so: a typo must not look like a job that never ran."""
    _search_history(tmp_path / "h.jsonl")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / f"{JOB}.yaml").write_text(
        f"schedule: '@daily'\nstart_date: 2024-01-01\nparams:\n  bucket_dir: {tmp_path / 'job-bucket'}\n"
    )
    env = {"SYNCSWITCH_JOBS_DIR": str(jobs)}
    done = syncswitch("history", "import", JOB, "h.jsonl", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert len(read_records(str(tmp_path / "job-bucket"), JOB)) == 4
    done = syncswitch("history", JOB, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"job {JOB} in {tmp_path / 'job-bucket'}: 4 record(s)"), done.stdout
    # Or the job file itself, wherever it is: its job's name and bucket.
    done = syncswitch("history", str(jobs / f"{JOB}.yaml"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"job {JOB} in {tmp_path / 'job-bucket'}: 4 record(s)"), done.stdout
    done = syncswitch("history", JOB, "--bucket-dir", "elsewhere", cwd=tmp_path, env=env)
    assert done.stdout.splitlines()[:2] == [
        f"job {JOB} in elsewhere: 0 record(s), 0 claim(s)",
        "no records yet: the next run is a BSP baseline run (bsp_fraction 1.0)",
    ]
    assert "no job file" not in done.stdout  # the job exists: it has not run there
    done = syncswitch("history", "no-such-job", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert f"(no job file no-such-job.yaml in {jobs} either: check the name and --bucket-dir)" in done.stdout
