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
``<name>-<label>`` and run folder; the report goes to ``<bucket_dir>/_sweeps/<name>/`` (or --out). The
Airflow plugin serves it from there on the api-server, as the page ``sweep/`` of any of its runs
(syncswitch_airflow.ui), which ``--keep-ui`` prints.
The last stdout line is one JSON object: the comparison's numbers and where the report is.

A sweep takes hours. It records its runs in the report folder (``sweep-runs.json``) as it goes, so
that starting it again after an interruption (Ctrl-C, a closed terminal, a reboot) resumes it: a run
that succeeded with the same params and the same user code (the digest of the ``usr_dir`` files) is
kept, one that is still running is followed, and the rest run (again). ``--fresh`` forgets the record
and runs everything (after an upgrade of a package whose entry points register the model, say).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from syncswitch import storage, usercode
from syncswitch.layout import SWEEP_PROGRESS, RunLayout, SweepLayout, join
from syncswitch.spec import JobSpec, SpecError

from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.airflow_api import TERMINAL_RUN_STATES, AirflowError, AirflowUnavailable
from syncswitch_airflow.tools.cli import (
    DAG_ID,
    dag_conf,
    default_project_dir,
    fail_run_for_teardown,
    interrupt_on_sigterm,
    stop_airflow,
)
from syncswitch_airflow.ui import SWEEP_PAGE, run_path

PROG = "syncswitch sweep"
KEYS = ("name", "repeats", "baseline", "target_accuracy", "base", "configs", "references")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
RUN_TIMEOUT_SECONDS = 24 * 3600.0
# In the report folder: every run of the sweep as triggered and as ended, for a start that resumes it.
PROGRESS_FILE = SWEEP_PROGRESS


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
        merged = usercode.beside({**base, **params}, str(path.parent))
        job = JobSpec.from_params({**merged, "job_name": f"{name}-{label}"})
    except SpecError as err:
        raise SweepError(f"{path.name}: configs.{label}: {err}") from None
    return job


# ---- running ----------------------------------------------------------------------------------------


def run_sweep(
    sweep: Sweep, airflow: EmbeddedAirflow, say: Any, progress_uri: str | None = None
) -> list[dict[str, Any]]:
    """Every run of the sweep, one after another; returns {label, repeat, run_id, run_dir, state,
    conf_digest, kept}.

    With ``progress_uri`` the sweep records each run there as it is triggered and as it ends, and
    picks up what an earlier start of it recorded: a run that succeeded with the same params is kept,
    one still running is followed to its end, and any other runs again (failed, gone from this
    Airflow, or its params changed in the sweep file). Ctrl-C fails the run in flight (its teardown
    runs) before it stops the sweep."""
    progress = SweepProgress(progress_uri)
    if progress.earlier:
        say(
            f"resuming: {len(progress.earlier)} run(s) recorded by an earlier start in {progress_uri} "
            "(--fresh runs everything again)"
        )
    done: list[dict[str, Any]] = []
    plan = [(repeat, label, job) for repeat in range(sweep.repeats) for label, job in sweep.configs.items()]
    for number, (repeat, label, job) in enumerate(plan, start=1):
        conf = {**dag_conf(job), "seed": job.seed + repeat}
        which = f"[{number}/{len(plan)}] {label} repeat {repeat + 1}"
        started, digest = time.monotonic(), conf_digest(conf, usercode.digest(job.usr_dir))
        run = earlier_run(airflow, progress.earlier.get((label, repeat)), digest)
        if run is not None and run["state"] == "success":
            say(f"{which}: kept run {run['run_id']} (success, from an earlier start of this sweep)")
            done.append({**run, "kept": True})
            continue
        try:
            if run is None:
                run = _trigger(airflow, job, conf, digest, label, repeat)
                progress.record(run)
                say(f"{which}: run {run['run_id']}")
            else:
                say(f"{which}: following run {run['run_id']}, still {run['state']} from an earlier start")
            run["state"] = airflow.api.wait(DAG_ID, run["run_id"], timeout=RUN_TIMEOUT_SECONDS)
        except KeyboardInterrupt:
            if run is not None:  # the run in flight is failed and torn down, and runs again on resume
                fail_run_for_teardown(airflow.api, run["run_id"])
                progress.record({**run, "state": "failed"})
            raise
        progress.record(run)
        say(f"{which}: {run['state']} in {time.monotonic() - started:.0f} s")
        done.append({**run, "kept": False})
    return done


def _trigger(
    airflow: EmbeddedAirflow, job: JobSpec, conf: dict[str, Any], digest: str, label: str, repeat: int
) -> dict[str, Any]:
    run_id = airflow.api.trigger(DAG_ID, conf)
    return {
        "label": label,
        "repeat": repeat,
        "run_id": run_id,
        "run_dir": RunLayout.for_run(conf["bucket_dir"], job.job_name, run_id).root,
        "state": "queued",
        "conf_digest": digest,
    }


def conf_digest(conf: dict[str, Any], code_digest: str = "") -> str:
    """What identifies a run across starts of a sweep: its params (its seed included) and the digest
    of the user code's files (usercode.digest; "" for built-ins, which keeps their digest as it was)."""
    identity = {**conf, "_usr_dir_digest": code_digest} if code_digest else conf
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


class SweepProgress:
    """The sweep's record of its runs (``PROGRESS_FILE`` in the report folder), by (label, repeat):
    ``earlier`` as an earlier start left it, written again at each ``record``. No file: nothing kept."""

    def __init__(self, uri: str | None) -> None:
        self.uri = uri
        self.earlier: dict[tuple[str, int], dict[str, Any]] = {}
        if uri is not None:
            for run in storage.read_json(uri, default={}).get("runs", []):
                self.earlier[(run["label"], int(run["repeat"]))] = run
        self._runs = dict(self.earlier)

    def record(self, run: dict[str, Any]) -> None:
        if self.uri is None:
            return
        self._runs[(run["label"], run["repeat"])] = dict(run)
        runs = sorted(self._runs.values(), key=lambda r: (r["repeat"], r["label"]))
        storage.write_json(self.uri, {"runs": runs})


def earlier_run(airflow: EmbeddedAirflow, run: dict[str, Any] | None, digest: str) -> dict[str, Any] | None:
    """The earlier start's run of this config and repeat, with its state now, if it is worth keeping
    or following: the same params, and a success whose run folder still holds its state, or a run
    that this Airflow still runs. None: run it again."""
    if run is None or run.get("conf_digest") != digest:
        return None
    try:
        state = airflow.api.run_state(DAG_ID, run["run_id"])
    except AirflowUnavailable:
        raise
    except AirflowError:  # not in this Airflow (another AIRFLOW_HOME, or a wiped one)
        state = "success" if run["state"] == "success" else "gone"
    if state == "success" and storage.exists(RunLayout(run["run_dir"]).state):
        return {**run, "state": state}
    if state not in (*TERMINAL_RUN_STATES, "gone"):
        return {**run, "state": state}
    return None


def report_dir(sweep: Sweep, out: str | None) -> str:
    if out:
        return out
    bucket = next(iter(sweep.configs.values())).bucket_dir
    bucket = bucket if storage.is_remote(bucket) else str(Path(bucket).resolve())
    return SweepLayout.for_sweep(bucket, sweep.name).root


def in_bucket_of(sweep_dir: str, run_dir: str) -> bool:
    """Whether the run's folder is in the bucket folder of ``<bucket_dir>/_sweeps/<name>``."""
    return RunLayout(run_dir).bucket_dir == sweep_dir.rsplit("/", 2)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run an experiment's job configs x repeats one after another as sync_switch DAG runs "
        "on the embedded Airflow, then write one comparison report. Started again, it resumes.",
    )
    parser.add_argument(
        "sweep_file",
        type=Path,
        metavar="SWEEP.yaml",
        help="name, repeats, base params, configs (label: params) and baseline; see experiments/",
    )
    parser.add_argument("--out", default=None, help="report folder (default <bucket_dir>/_sweeps/<name>)")
    parser.add_argument("--airflow-home", default=None, help="AIRFLOW_HOME (default <project>/.airflow)")
    parser.add_argument("--keep-ui", action="store_true", help="leave the embedded Airflow running")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="run every config again: forget the runs that an earlier start of this sweep recorded in "
        f"the report folder ({PROGRESS_FILE}), which it otherwise keeps or follows",
    )
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
    out = report_dir(sweep, args.out)
    progress_uri = join(out, PROGRESS_FILE)
    if args.fresh:
        storage.delete(progress_uri)
    try:
        with interrupt_on_sigterm():
            airflow.start(wait_for_dags=(DAG_ID,))
            runs = run_sweep(sweep, airflow, say, progress_uri)
    except AirflowError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the same command resumes the sweep ({progress_uri})", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if not args.keep_ui:
            stop_airflow(airflow)
    refs = [RunRef(label=r["label"], run_dir=r["run_dir"]) for r in runs if r["state"] == "success"]
    comparison = build_comparison(
        refs, out, baseline=sweep.baseline, target_accuracy=sweep.target_accuracy, references=sweep.references
    )
    failed = [r for r in runs if r["state"] != "success"]
    say(
        f"comparison report: {join(out, 'comparison.html')}"
        + (f"; {len(failed)} run(s) failed" if failed else "")
    )
    # The plugin serves the report as a page of any of its runs that ran in the bucket that holds it.
    shown = next((r for r in runs if r["state"] == "success" and in_bucket_of(out, r["run_dir"])), None)
    if args.keep_ui and shown and not args.out:
        say(f"in the Airflow UI: {airflow.url}{run_path(DAG_ID, shown['run_id'], SWEEP_PAGE)}")
    print(
        json.dumps({"sweep": sweep.name, "runs": runs, "report": out, "comparison": comparison}, default=str)
    )
    return EXIT_FAILED if failed else EXIT_OK
