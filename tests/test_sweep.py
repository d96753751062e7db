"""`syncswitch sweep`: the sweep file is validated (naming the key and the config) before anything runs,
and a sweep started again resumes (on the session's embedded Airflow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from airflow_runs import DAG_ID, LocalSegmentNodes, assert_stopped_by_hand
from conftest import PROJECT_DIR
from proc_utils import ProgressThrottle, wait_for
from syncswitch import usercode
from syncswitch_airflow.job_files import read_job_file
from syncswitch_airflow.tools.sweep import (
    PROGRESS_FILE,
    SweepError,
    SweepProgress,
    conf_digest,
    earlier_run,
    in_bucket_of,
    read_sweep,
    report_dir,
    run_sweep,
)

SYNCSWITCH = Path(sys.executable).parent / "syncswitch"

GOOD = """\
name: tiny
repeats: 2
baseline: bsp
target_accuracy: 0.9
base: {total_steps: 60, num_workers: 2}
configs:
  bsp: {switch_order: "1"}
  asp: {switch_order: "0"}
  hybrid: {switch_order: "10", bsp_fraction: 0.5}
"""


def test_a_sweep_file_becomes_validated_jobs_one_per_config(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(GOOD)
    sweep = read_sweep(path)
    assert (sweep.name, sweep.repeats, sweep.baseline, sweep.target_accuracy) == ("tiny", 2, "bsp", 0.9)
    assert {label: job.job_name for label, job in sweep.configs.items()} == {
        "bsp": "tiny-bsp",
        "asp": "tiny-asp",
        "hybrid": "tiny-hybrid",
    }
    assert sweep.configs["hybrid"].segment_steps() == [30, 30]
    # The report goes beside the first config's runs, where the Airflow plugin looks for it.
    out = report_dir(sweep, None)
    assert out == str((Path.cwd() / "runs" / "_sweeps" / "tiny").resolve())
    assert in_bucket_of(out, str(Path.cwd().resolve() / "runs" / "tiny-asp" / "manual__1"))
    assert not in_bucket_of(out, "gs://elsewhere/runs/tiny-asp/manual__1")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("configs:", "configs:\n  bad: {switch_order: '12'}"), "configs.bad: switch_order:"),
        (("baseline: bsp", "baseline: fastest"), "baseline: 'fastest' is not one of the configs"),
        (("repeats: 2", "repeats: 0"), "repeats: must be an integer >= 1"),
        (("target_accuracy: 0.9", "target_accuracy: 90"), "target_accuracy: must be in (0, 1]"),
        (("name: tiny", "name: tiny\nowner: me"), "owner: unknown key"),
    ],
)
def test_a_bad_sweep_file_names_the_key(tmp_path: Path, change: tuple[str, str], named: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace(*change, 1))
    with pytest.raises(SweepError) as error:
        read_sweep(path)
    assert named in str(error.value)
    # The command says it in one line and starts nothing.
    done = subprocess.run([str(SYNCSWITCH), "sweep", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("path", sorted((PROJECT_DIR / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_file_validates(path: Path) -> None:
    # The files the docs tell users to run: a key they misspell or a per-segment list of the wrong
    # length would otherwise surface only when the sweep is started.
    sweep = read_sweep(path)
    assert sweep.baseline in sweep.configs and sweep.repeats >= 1
    for job in sweep.configs.values():
        if job.usr_dir:
            usr_dir = Path(job.usr_dir).resolve()
            assert usr_dir.is_dir() and usr_dir.is_relative_to(PROJECT_DIR), f"{path.name}: {usr_dir}"


@pytest.mark.parametrize("path", sorted((PROJECT_DIR / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_job_file_validates(path: Path) -> None:
    job_file = read_job_file(path)
    assert job_file.job.job_name == path.stem


RESUMABLE = """\
name: resumable
repeats: 1
baseline: bsp
base: {{total_steps: 40, num_workers: 2, bucket_dir: "{bucket}"}}
configs:
  bsp: {{switch_order: "1"}}
  asp: {{switch_order: "0", total_steps: 300}}
"""


class Killed(Exception):
    """Stands in for a sweep process killed outright (SIGKILL, a lost terminal): nothing of it runs
    after this, unlike Ctrl-C."""


def test_a_sweep_started_again_keeps_its_finished_runs_follows_a_running_one_and_reruns_a_stopped_one(
    embedded_airflow, tmp_path: Path
) -> None:
    path, bucket = tmp_path / "resumable.yaml", tmp_path / "bucket"
    path.write_text(RESUMABLE.format(bucket=bucket))
    sweep, progress = read_sweep(path), str(tmp_path / "report" / PROGRESS_FILE)
    lines: list[str] = []

    def killed_once_the_second_run_is_triggered(line: str) -> None:
        lines.append(line)
        if line.startswith("[2/2]") and ": run " in line:
            raise Killed

    # The ASP run's nodes run at a sixteenth of their speed until the Ctrl-C below, and stand still
    # from then until the run is failed and torn down, so that its 300 steps cannot end before the
    # mark lands, however fast the machine and however long the API takes to answer it (it may wait
    # out a database lock first).
    brake = ProgressThrottle(LocalSegmentNodes("resumable-asp", 0), lambda: False, slowdown=16)
    with brake:
        with pytest.raises(Killed):
            run_sweep(sweep, embedded_airflow, killed_once_the_second_run_is_triggered, progress)
        first = SweepProgress(progress).earlier
        assert (first[("bsp", 0)]["state"], first[("asp", 0)]["state"]) == ("success", "queued")
        in_flight = first[("asp", 0)]["run_id"]

        # Started again: the finished run is kept and the one in flight followed, until Ctrl-C while
        # it trains, which fails that run and lets its teardown run before the sweep stops.
        def ctrl_c_while_following(line: str) -> None:
            lines.append(line)
            if ": following run" in line:
                wait_for(
                    lambda: (
                        embedded_airflow.api.task_states(DAG_ID, in_flight).get("segment_0.asp") == "deferred"
                    ),
                    timeout=120,
                    poll=0.2,
                    what="the followed run's segment training",
                )
                brake.hold()
                raise KeyboardInterrupt

        lines.clear()
        with pytest.raises(KeyboardInterrupt):
            run_sweep(sweep, embedded_airflow, ctrl_c_while_following, progress)
    assert lines[0].startswith("resuming: 2 run(s) recorded"), lines
    assert lines[1].startswith(f"[1/2] bsp repeat 1: kept run {first[('bsp', 0)]['run_id']} (success"), lines
    assert lines[2].startswith(f"[2/2] asp repeat 1: following run {in_flight}"), lines
    assert_stopped_by_hand(embedded_airflow.api, in_flight, "segment_0.asp")
    assert SweepProgress(progress).earlier[("asp", 0)]["state"] == "failed"

    # Started a third time: the stopped run runs again, as a new run; the kept one is not touched.
    runs = run_sweep(sweep, embedded_airflow, lines.append, progress)
    assert [(r["label"], r["state"], r["kept"]) for r in runs] == [
        ("bsp", "success", True),
        ("asp", "success", False),
    ]
    assert runs[0]["run_id"] == first[("bsp", 0)]["run_id"] and runs[1]["run_id"] != in_flight
    assert SweepProgress(progress).earlier[("asp", 0)] == {k: v for k, v in runs[1].items() if k != "kept"}
    runs_of_asp = [p.name for p in (bucket / "resumable-asp").iterdir()]
    assert len(runs_of_asp) == 2, runs_of_asp

    # Changed params, or a run that this Airflow does not know (a wiped AIRFLOW_HOME) and that did not
    # succeed: run again.
    assert earlier_run(embedded_airflow, runs[1], "other params") is None
    gone = {**runs[1], "run_id": "manual__gone", "state": "running"}
    assert earlier_run(embedded_airflow, gone, gone["conf_digest"]) is None
    assert earlier_run(embedded_airflow, runs[1], runs[1]["conf_digest"])["state"] == "success"


def test_a_run_of_a_resumed_sweep_is_kept_only_with_the_same_params_seed_and_user_code(
    tmp_path: Path,
) -> None:
    """The record's digest: params and seed, and the files of the user code a config names, so that
    a sweep started again after the model changed runs everything again (built-ins: params alone,
    their digest as before)."""
    code = tmp_path / "my_model"
    code.mkdir()
    (code / "__init__.py").write_text("from . import model\n")
    (code / "model.py").write_text("WIDTH = 64\n")
    conf = {"job_name": "mine", "usr_dir": str(code), "seed": 1}
    first = conf_digest(conf, usercode.digest(str(code)))
    assert conf_digest(conf, usercode.digest(str(code))) == first
    assert conf_digest({**conf, "seed": 2}, usercode.digest(str(code))) != first
    (code / "model.py").write_text("WIDTH = 128\n")
    assert conf_digest(conf, usercode.digest(str(code))) != first
    assert conf_digest({"job_name": "builtin"}, usercode.digest("")) == conf_digest({"job_name": "builtin"})
