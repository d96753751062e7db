"""Does Sync-Switch's trade-off hold with Adam? Momentum SGD and Adam on one workload as BSP, ASP and a
BSP-then-ASP hybrid, over seeds, side by side (issue 59).

    .venv/bin/python bench/bench_optimizers.py --workers 8 --steps 600 --seeds 3 \\
        --learning-rates momentum=1.2,adam=0.01 --log bench/optimizer-settings.jsonl

The workload is the MNIST-1D example (``examples/mnist1d``) with the step schedule of
``experiments/mnist1d-stepdecay.yaml`` (the rate for the first 12.5% of the job, then a quarter of it,
then a fortieth for the last quarter) and the runtime's default configuration policy: ASP divides the
rate by the number of workers; momentum SGD's momentum follows the momentum rule, Adam's beta1 stays.
Each optimizer has its own peak rate (``--learning-rates``); everything else is the example's hparam
set. Runs are ``syncswitch train`` segments without Airflow, each from scratch: BSP and ASP one segment
each, the hybrid BSP to ``--bsp-fraction`` of the steps, then ASP from its checkpoint to the end. Seeds,
optimizers and configurations interleave so that a slow patch of the shared machine falls on all.

Printed: final test accuracy mean ± standard error and per seed, the runs' summed segment wall time
(processes' start included), and that time against BSP's of the same optimizer. ``--log`` appends the
setting and every run's numbers as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import log, machine_line, markdown_table, run_json_command, syncswitch_command

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "mnist1d_example"
CONFIGS = ("bsp", "asp", "hybrid")
# experiments/mnist1d-stepdecay.yaml's schedule, as fractions of the peak rate.
STEP_SCHEDULE = (
    "learning_rate_decay_scheme=piecewise,learning_rate_boundaries=0.125;0.75,"
    "learning_rate_multiples=0.25;0.025"
)


def segments(config: str, steps: int, fraction: float) -> list[tuple[str, int]]:
    """(protocol, until_step) of each segment of a configuration."""
    if config == "hybrid":
        switch = max(1, round(steps * fraction))
        return [("bsp", switch), ("asp", steps)]
    return [(config, steps)]


def run_config(
    args: argparse.Namespace, optimizer: str, config: str, seed: int, run_dir: str
) -> dict[str, Any]:
    """Train one configuration from scratch; its final test accuracy and the segments' wall time."""
    hparams = f"optimizer={optimizer},learning_rate={args.rates[optimizer]},{STEP_SCHEDULE}"
    plan = segments(config, args.steps, args.bsp_fraction)
    wall = 0.0
    summary: dict[str, Any] = {}
    for index, (protocol, until) in enumerate(plan):
        argv = syncswitch_command(
            "train",
            f"--usr-dir={EXAMPLE}",
            "--model=mnist1d_cnn",
            "--problem=mnist1d",
            "--hparam-set=mnist1d_cnn",
            f"--hparams={hparams}",
            f"--protocol={protocol}",
            f"--workers={args.workers}",
            f"--ps={args.ps}",
            f"--run-dir={run_dir}",
            f"--segment-index={index}",
            f"--until-step={until}",
            f"--total-steps={args.steps}",
            "--ckpt-frequency=0",
            f"--seed={seed}",
            "--quiet",
            *(["--eval"] if index == len(plan) - 1 else []),
        )
        result = run_json_command(argv, f"{run_dir}-{index}.log", timeout=args.timeout)
        wall += result.wall_seconds
        summary = result.summary
    return {"accuracy": summary["test_accuracy"], "wall_seconds": wall}


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


def parse_rates(text: str) -> dict[str, float]:
    rates = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        rates[name.strip()] = float(value)
    return rates


def table(args: argparse.Namespace, runs: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    rows = []
    for optimizer in args.rates:
        bsp = runs[optimizer, "bsp"]
        bsp_wall = statistics.mean(r["wall_seconds"] for r in bsp) if bsp else math.nan
        for config in CONFIGS:
            done = runs[optimizer, config]
            if not done:
                continue
            mean, se = mean_se([r["accuracy"] for r in done])
            wall = statistics.mean(r["wall_seconds"] for r in done)
            label = f"hybrid ({args.bsp_fraction:.1%} BSP)" if config == "hybrid" else config.upper()
            rows.append(
                [
                    f"{optimizer} @ {args.rates[optimizer]:g}",
                    label,
                    f"{mean:.4f} ± {se:.4f}",
                    " ".join(f"{r['accuracy']:.3f}" for r in done),
                    f"{wall:.0f}",
                    f"{wall / bsp_wall:.2f}",
                ]
            )
    headers = ["optimizer @ peak LR", "config", "test accuracy ± SE", "per seed", "wall s", "vs BSP"]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--learning-rates",
        default="momentum=1.2,adam=0.01",
        help="optimizer=peak LR,... (one optimizer may appear once)",
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--bsp-fraction", type=float, default=0.125)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help="a subset of bsp,asp,hybrid")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--log", help="append the setting and every run's numbers to this .jsonl file")
    args = p.parse_args(argv)
    args.rates = parse_rates(args.learning_rates)
    configs = [c for c in args.configs.split(",") if c]
    print(machine_line())
    work_dir = tempfile.mkdtemp(prefix="bench-optimizers-")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(o, c): [] for o in args.rates for c in CONFIGS}
    started = time.time()
    try:
        for seed in range(args.seeds):
            order = [(o, c) for o in args.rates for c in configs]
            for optimizer, config in order if seed % 2 == 0 else reversed(order):
                log(f"seed {seed}: {optimizer} {config}")
                result = run_config(args, optimizer, config, seed, f"{work_dir}/{optimizer}-{config}-{seed}")
                log(f"  test accuracy {result['accuracy']:.4f}, {result['wall_seconds']:.0f} s")
                runs[optimizer, config].append(result)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(
        f"\nmnist1d_cnn on mnist1d, {args.workers} workers + {args.ps} PS, {args.steps} steps, step "
        f"schedule (peak, /4 from 12.5%, /40 from 75%), {args.seeds} seeds:\n"
    )
    print(table(args, runs))
    if args.log:
        record = {
            "time": started,
            "setting": {k: v for k, v in vars(args).items() if k not in ("log", "timeout")},
            "runs": {f"{o}/{c}": runs[o, c] for o, c in runs},
        }
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
