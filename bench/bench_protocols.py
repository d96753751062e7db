"""The communication-efficient guide's comparison: every protocol alone, the 12.5% hybrids, stragglers.

    .venv/bin/python bench/bench_protocols.py experiments/mnist1d-protocols.yaml \\
        --workers 8 --total-steps 600 --repeats 2 --log bench/protocols-mnist1d.jsonl
    .venv/bin/python bench/bench_protocols.py experiments/resnet20-protocols.yaml \\
        --workers 4 --total-steps 160 --repeats 1 --configs bsp,asp,fp16
    .venv/bin/python bench/bench_protocols.py experiments/mnist1d-protocols.yaml --report-only \\
        --log bench/protocols-mnist1d.jsonl

The configs are the sweep file's (the one definition: ``syncswitch sweep`` runs the same file on
Airflow, at full scale); this script runs them scaled down (``--workers``, ``--total-steps``,
``--repeats``) without Airflow: each plan entry of a config's JobSpec is one ``syncswitch train
--spec`` of the SegmentSpec the pipeline would launch, all through one fork server (a cluster's, as a
pipeline run's), in one run folder. Repeats are seeds 0.., configs interleaved within a repeat, so a
slow patch of the shared machine falls on all of them. The last segment is evaluated; with
``evaluate_checkpoints`` every checkpoint is, for time to the target accuracy.

Per config: final test accuracy (mean ± sd, and the mean difference to the baseline's run of the same
seed ± its standard error), total seconds (first launch to last segment's end: start-ups and switches
included) and its ratio to the baseline's, training seconds to the target accuracy (evaluations taken
out), examples/s over the whole run, and bytes a worker sent per BSP-equivalent step (the segments'
own counts, syncswitch.exchange). Where the sweep runs its baseline under a straggler too, a second
table gives each straggler config's share of that slowdown it gives back. ``--log`` keeps one JSON
line per run, so an interrupted run goes on where it stopped and ``--report-only`` prints the tables
again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import BenchError, log, machine_line, markdown_table, ratio, run_json_command, syncswitch_command
from syncswitch import forkserver_client, storage
from syncswitch.layout import RunLayout
from syncswitch.spec import JobSpec
from syncswitch_airflow.tools.compare import RunRef, run_numbers
from syncswitch_airflow.tools.sweep import read_sweep


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_protocols.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="a sweep file (experiments/*-protocols.yaml)")
    parser.add_argument("--workers", type=int, help="instead of the file's num_workers")
    parser.add_argument("--total-steps", type=int, help="instead of the file's total_steps")
    parser.add_argument("--ckpt-frequency", type=int, help="instead of the file's ckpt_frequency")
    parser.add_argument("--repeats", type=int, help="seeds 0..repeats-1 (default: the file's repeats)")
    parser.add_argument("--configs", help="comma-separated labels (default: every config of the file)")
    parser.add_argument("--out", help="run folders (default: a temporary folder, removed unless --keep)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--log", help="JSON lines, one per run: appended to, and runs in it are skipped")
    parser.add_argument("--report-only", action="store_true", help="the tables of --log, running nothing")
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="with --report-only: measure every logged run again from its run folder under --out (another "
        "--target, say)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per segment")
    parser.add_argument("--target", type=float, help="instead of the file's target_accuracy")
    return parser.parse_args(argv)


def scaled(job: JobSpec, args: argparse.Namespace, seed: int) -> JobSpec:
    changes: dict[str, Any] = {"seed": seed}
    if args.workers:
        changes["num_workers"] = args.workers
        changes["stragglers"] = tuple(s for s in job.stragglers if s.worker < args.workers)
    if args.total_steps:
        changes["total_steps"] = args.total_steps
    if args.ckpt_frequency is not None:
        changes["ckpt_frequency"] = (args.ckpt_frequency,)
    return dataclasses.replace(job, **changes)


def run_config(job: JobSpec, run_dir: str, work: str, forkserver: str, timeout: float) -> None:
    """Every plan entry of ``job`` as the pipeline would launch it, one after the other."""
    entries = job.plan_entries()
    for entry in entries:
        spec = job.segment_spec(entry, os.path.basename(run_dir), run_dir)
        spec = spec.replace(evaluate=entry is entries[-1])
        spec_file = os.path.join(work, f"seg-{entry['index']:02d}.json")
        storage.write_text(spec_file, spec.to_json())
        argv = syncswitch_command(
            "train", "--spec", spec_file, "--forkserver", forkserver, "--work-dir", work, "--quiet"
        )
        run_json_command(argv, os.path.join(work, f"seg-{entry['index']:02d}.log"), timeout=timeout)


def measure(label: str, seed: int, job: JobSpec, run_dir: str, target: float | None) -> dict[str, Any]:
    numbers = run_numbers(RunRef(label, run_dir), target)
    layout = RunLayout(run_dir)
    sent, steps = 0.0, 0.0
    for entry in job.plan_entries():
        result = storage.read_json(layout.segment_result(entry["index"], entry["protocol"]))
        done = result["end_step"] - result["start_step"]
        sent += result.get("bytes_per_worker_step", 0.0) * done
        steps += done
    numbers.pop("curve", None)
    return {
        "label": label,
        "seed": seed,
        "switch_order": job.switch_order,
        "bsp_fraction": job.planned_bsp_fraction(),
        "num_workers": job.num_workers,
        "total_steps": job.workload,
        "bytes_per_step": sent / steps if steps else None,
        **{k: v for k, v in numbers.items() if k not in ("label", "run_dir", "run_id")},
    }


def remeasure(
    run: dict[str, Any], job: JobSpec, args: argparse.Namespace, target: float | None
) -> dict[str, Any]:
    """A logged run measured again from its run folder (kept under --out)."""
    run_dir = os.path.join(args.out, run["label"], f"seed{run['seed']}")
    if not args.out or not os.path.isdir(run_dir):
        raise SystemExit(f"--remeasure needs the run folders under --out; {run_dir} is not there")
    return {
        **measure(run["label"], run["seed"], scaled(job, args, run["seed"]), run_dir, target),
        "scale": run["scale"],
    }


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def table(runs: list[dict[str, Any]], labels: list[str], baseline: str, target: float | None) -> str:
    by_label = {label: [r for r in runs if r["label"] == label] for label in labels}
    base_by_seed = {r["seed"]: r for r in by_label.get(baseline, [])}
    base_time = mean_sd([r["total_seconds"] for r in by_label.get(baseline, [])])[0]
    base_target = mean_sd(
        [r["seconds_to_target"] for r in by_label.get(baseline, []) if r["seconds_to_target"]]
    )[0]
    rows = []
    for label, done in by_label.items():
        if not done:
            continue
        accuracy, sd = mean_sd([r["final_accuracy"] for r in done])
        diffs = [
            r["final_accuracy"] - base_by_seed[r["seed"]]["final_accuracy"]
            for r in done
            if r["seed"] in base_by_seed
        ]
        diff, diff_sd = mean_sd(diffs)
        paired = "-" if label == baseline or diff is None else f"{100 * diff:+.1f}"
        if paired != "-" and diff_sd is not None:
            paired += f" ± {100 * diff_sd / math.sqrt(len(diffs)):.1f}"
        seconds = mean_sd([r["total_seconds"] for r in done])[0]
        reached = [r["seconds_to_target"] for r in done if r["seconds_to_target"] is not None]
        to_target = mean_sd(reached)[0]
        rows.append(
            [
                label,
                done[0]["switch_order"]
                + (
                    f" ({done[0]['bsp_fraction']:g} BSP)"
                    if "," in done[0]["switch_order"] or done[0]["switch_order"] == "10"
                    else ""
                ),
                str(len(done)),
                f"{accuracy:.4f}" + (f" ± {sd:.4f}" if sd is not None else ""),
                paired,
                seconds,
                ratio(seconds, base_time),
                to_target,
                ratio(to_target, base_target),
                f"{len(reached)}/{len(done)}",
                mean_sd([r["examples_per_sec"] for r in done])[0],
                mean_sd([r["bytes_per_step"] for r in done if r["bytes_per_step"] is not None])[0],
            ]
        )
    headers = [
        "config",
        "switch order",
        "runs",
        "final accuracy (mean ± sd)",
        "vs BSP (paired, pt ± SE)",
        "total s",
        "time / BSP",
        f"s to {target:g}" if target else "s to target",
        "to target / BSP",
        "reached",
        "examples/s",
        "bytes/worker/step",
    ]
    return markdown_table(headers, rows)


def straggler_baseline(configs: dict[str, JobSpec], baseline: str, labels: list[str]) -> str | None:
    """The config that runs the baseline's switch order under a straggler, if the sweep has one."""
    base = configs[baseline]
    if base.stragglers:
        return None
    for label in labels:
        if configs[label].stragglers and configs[label].switch_order == base.switch_order:
            return label
    return None


def straggler_table(
    runs: list[dict[str, Any]], configs: dict[str, JobSpec], baseline: str, labels: list[str]
) -> str:
    """Per straggler config, the share of the straggler's cost to the baseline it gives back.

    Per seed: 1 - (its time per example - the baseline's without a straggler) / (the baseline's under
    the straggler - without), then mean ± sd; 1 is all of it, above 1 faster than the baseline without
    a straggler. The online policies' ONLINE_RECOVERY holds these shares."""
    slowed = straggler_baseline(configs, baseline, labels)
    if slowed is None:
        return ""
    by_run = {(r["label"], r["seed"]): r for r in runs}

    def per_example(label: str, seed: int) -> float:
        return 1.0 / by_run[(label, seed)]["examples_per_sec"]

    rows = []
    for label in labels:
        if not configs[label].stragglers or label == slowed:
            continue
        seeds = [
            r["seed"]
            for r in runs
            if r["label"] == label and {(baseline, r["seed"]), (slowed, r["seed"])} <= by_run.keys()
        ]
        shares = [
            1
            - (per_example(label, seed) - per_example(baseline, seed))
            / (per_example(slowed, seed) - per_example(baseline, seed))
            for seed in seeds
        ]
        share, sd = mean_sd(shares)
        if share is not None:
            rows.append(
                [
                    label,
                    configs[label].switch_order,
                    str(len(shares)),
                    f"{share:.2f}" + (f" ± {sd:.2f}" if sd is not None else ""),
                ]
            )
    headers = [
        "config",
        "switch order",
        "seeds",
        f"gives back of the straggler's cost to {baseline} (mean ± sd)",
    ]
    return markdown_table(headers, rows) if rows else ""


def read_log(path: str | None) -> list[dict[str, Any]]:
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sweep = read_sweep(args.sweep)
    labels = args.configs.split(",") if args.configs else list(sweep.configs)
    unknown = set(labels) - set(sweep.configs)
    if unknown:
        raise SystemExit(f"unknown config(s) {sorted(unknown)}; the file has {', '.join(sweep.configs)}")
    repeats = args.repeats or sweep.repeats
    target = args.target or sweep.target_accuracy
    runs = read_log(args.log)
    scale = {k: getattr(args, k) for k in ("workers", "total_steps", "ckpt_frequency")}
    done = {(r["label"], r["seed"]) for r in runs if r.get("scale") == scale}
    if not args.report_only:
        out = args.out or tempfile.mkdtemp(prefix="bench-protocols-")
        forkserver = os.path.join(out, "forkserver")
        server = forkserver_client.start(forkserver, die_with_parent=True)
        failed = False
        try:
            forkserver_client.wait_ready(forkserver, 600)
            for seed in range(repeats):
                for label in labels:
                    if (label, seed) in done:
                        continue
                    job = scaled(sweep.configs[label], args, seed)
                    run_dir = os.path.join(out, label, f"seed{seed}")
                    work = os.path.join(out, "work", label, f"seed{seed}")
                    shutil.rmtree(run_dir, ignore_errors=True)
                    log(f"{label} seed {seed}: {job.switch_order}, {job.num_workers} x {job.workload} steps")
                    try:
                        run_config(job, run_dir, work, forkserver, args.timeout)
                    except BenchError as err:
                        failed = True
                        log(f"{label} seed {seed} failed: {err}")
                        continue
                    record = {**measure(label, seed, job, run_dir, target), "scale": scale}
                    log(
                        f"{label} seed {seed}: accuracy {record['final_accuracy']}, "
                        f"{record['total_seconds']:.1f} s, {record['bytes_per_step']:.0f} B/step"
                    )
                    runs.append(record)
                    if args.log:
                        with open(args.log, "a", encoding="utf-8") as f:
                            f.write(json.dumps(record) + "\n")
        finally:
            server.terminate()
            server.wait(timeout=60)
            if not (args.keep or args.out or failed):
                shutil.rmtree(out, ignore_errors=True)
    runs = [r for r in runs if r.get("scale") == scale]
    if args.report_only and args.remeasure:
        runs = [remeasure(r, sweep.configs[r["label"]], args, target) for r in runs if r["label"] in labels]
    print(f"# bench_protocols: {sweep.name}, scale {scale}, {repeats} repeat(s)\n# {machine_line()}\n")
    print(table(runs, labels, sweep.baseline, target))
    recovery = straggler_table(runs, sweep.configs, sweep.baseline, labels)
    if recovery:
        print(f"\n{recovery}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
