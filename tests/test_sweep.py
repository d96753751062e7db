"""`syncswitch sweep`: the sweep file is validated (naming the key and the config) before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROJECT_DIR
from syncswitch_airflow.job_files import read_job_file
from syncswitch_airflow.tools.sweep import SweepError, read_sweep

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
