"""``syncswitch sweep``: an experiment as a matrix of job configs x repeats, run one after another as
sync_switch DAG runs on the embedded Airflow, then one comparison report (syncswitch_airflow.tools.compare).

    syncswitch sweep experiments/digits-staleness.yaml [--airflow-home DIR] [--out DIR] [--keep-ui]

    # experiments/digits-staleness.yaml
    name: digits-staleness
    repeats: 3
    baseline: bsp                 # the config the others are normalised to
    target_accuracy: 0.97         # for time-to-accuracy
    base:                         # JobSpec params shared by every config
      num_workers: 8
      total_steps: 600
    configs:                      # label -> the params that make this config
      bsp: {switch_order: "1"}
      asp: {switch_order: "0"}
      sync-switch-25: {switch_order: "10", bsp_fraction: 0.25}
    references:                   # optional: the paper's rows, shown beside ours
      - {source: "Sync-Switch, ResNet-32/CIFAR-10, 8 workers", config: bsp, accuracy: 0.919}

Every config is validated (naming the config and the field) before anything runs. Runs interleave the
configs (repeat 1 of each, then repeat 2, ...) so that a slow patch of a shared machine does not fall
on one config, and repeat r runs with seed = base seed + r. Each run has its own job_name
``<name>-<label>`` and run folder; the report goes to ``<bucket_dir>/_sweeps/<name>/`` (or --out).
The last stdout line is one JSON object: the comparison's numbers and where the report is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from syncswitch import storage
from syncswitch.layout import RunLayout, join
from syncswitch.spec import JobSpec, SpecError

from syncswitch_airflow.job_files import usr_dir_beside
from syncswitch_airflow.tools.airflow_api import AirflowError
from syncswitch_airflow.tools.cli import DAG_ID, dag_conf, default_project_dir
from syncswitch_airflow.tools.embedded import EmbeddedAirflow

PROG = "syncswitch sweep"
KEYS = ("name", "repeats", "baseline", "target_accuracy", "base", "configs", "references")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
RUN_TIMEOUT_SECONDS = 24 * 3600.0


class SweepError(ValueError):
    """A sweep file that does not validate; the message names the key (and config) at fault."""


@dataclass(frozen=True)
class Sweep:
    name: str
    repeats: int
    baseline: str
    target_accuracy: float | None
    configs: dict[str, JobSpec]
    references: list[dict[str, Any]] = field(default_factory=list)


def read_sweep(path: Path) -> Sweep:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"{path}: not readable YAML: {exc}") from None
    unknown = sorted(set(data) - set(KEYS)) if isinstance(data, dict) else ["(not a mapping)"]
    if unknown:
        raise SweepError(f"{path.name}: {unknown[0]}: unknown key; accepted: {', '.join(KEYS)}")
    name = str(data.get("name") or path.stem)
    repeats = data.get("repeats", 3)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SweepError(f"{path.name}: repeats: must be an integer >= 1, got {repeats!r}")
    configs_raw = data.get("configs")
    if not isinstance(configs_raw, dict) or not configs_raw:
        raise SweepError(
            f"{path.name}: configs: must map labels to job params, e.g. bsp: {{switch_order: '1'}}"
        )
    base = data.get("base") or {}
    configs = {
        str(label): _config(path, name, str(label), base, params) for label, params in configs_raw.items()
    }
    baseline = str(data.get("baseline") or next(iter(configs)))
    if baseline not in configs:
        raise SweepError(
            f"{path.name}: baseline: {baseline!r} is not one of the configs: {', '.join(configs)}"
        )
    target = data.get("target_accuracy")
    if target is not None and not (isinstance(target, int | float) and 0 < target <= 1):
        raise SweepError(f"{path.name}: target_accuracy: must be in (0, 1], got {target!r}")
    return Sweep(name, repeats, baseline, target, configs, list(data.get("references") or []))


def _config(path: Path, name: str, label: str, base: dict, params: Any) -> JobSpec:
    if not isinstance(params, dict):
        raise SweepError(f"{path.name}: configs.{label}: must be a mapping of job params")
    try:
        merged = usr_dir_beside({**base, **params}, path.parent)
        job = JobSpec.from_params({**merged, "job_name": f"{name}-{label}"})
    except SpecError as err:
        raise SweepError(f"{path.name}: configs.{label}: {err}") from None
    return job


# ---- running ----------------------------------------------------------------------------------------


def run_sweep(sweep: Sweep, airflow: EmbeddedAirflow, say: Any) -> list[dict[str, Any]]:
    """Every run of the sweep, one after another; returns {label, repeat, run_id, run_dir, state}."""
    done: list[dict[str, Any]] = []
    plan = [(repeat, label, job) for repeat in range(sweep.repeats) for label, job in sweep.configs.items()]
    for number, (repeat, label, job) in enumerate(plan, start=1):
        conf = {**dag_conf(job), "seed": job.seed + repeat}
        started = time.monotonic()
        run_id = airflow.api.trigger(DAG_ID, conf)
        layout = RunLayout.for_run(conf["bucket_dir"], job.job_name, run_id)
        which = f"[{number}/{len(plan)}] {label} repeat {repeat + 1}"
        say(f"{which}: run {run_id}")
        state = airflow.api.wait(DAG_ID, run_id, timeout=RUN_TIMEOUT_SECONDS)
        say(f"{which}: {state} in {time.monotonic() - started:.0f} s")
        done.append(
            {"label": label, "repeat": repeat, "run_id": run_id, "run_dir": layout.root, "state": state}
        )
    return done


def report_dir(sweep: Sweep, out: str | None) -> str:
    if out:
        return out
    bucket = next(iter(sweep.configs.values())).bucket_dir
    bucket = bucket if storage.is_remote(bucket) else str(Path(bucket).resolve())
    return join(bucket, "_sweeps", sweep.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_file", type=Path)
    parser.add_argument("--out", default=None, help="report folder (default <bucket_dir>/_sweeps/<name>)")
    parser.add_argument("--airflow-home", default=None, help="AIRFLOW_HOME (default <project>/.airflow)")
    parser.add_argument("--keep-ui", action="store_true", help="leave the embedded Airflow running")
    args = parser.parse_args(argv)
    try:
        sweep = read_sweep(args.sweep_file)
    except SweepError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from syncswitch_airflow.tools.compare import RunRef, build_comparison

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    airflow = EmbeddedAirflow(
        default_project_dir(), Path(args.airflow_home).resolve() if args.airflow_home else None
    )
    try:
        airflow.start(wait_for_dags=(DAG_ID,))
        runs = run_sweep(sweep, airflow, say)
    except AirflowError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not args.keep_ui:
            airflow.stop()
    out = report_dir(sweep, args.out)
    refs = [RunRef(label=r["label"], run_dir=r["run_dir"]) for r in runs if r["state"] == "success"]
    comparison = build_comparison(
        refs, out, baseline=sweep.baseline, target_accuracy=sweep.target_accuracy, references=sweep.references
    )
    failed = [r for r in runs if r["state"] != "success"]
    say(
        f"comparison report: {join(out, 'comparison.html')}"
        + (f"; {len(failed)} run(s) failed" if failed else "")
    )
    print(
        json.dumps({"sweep": sweep.name, "runs": runs, "report": out, "comparison": comparison}, default=str)
    )
    return EXIT_FAILED if failed else EXIT_OK
