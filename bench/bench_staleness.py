"""Where does ASP lose accuracy? BSP-only and ASP-only runs of one setting over several seeds, side by
side (issue 18's search for a workload that shows Sync-Switch's trade-off).

    .venv/bin/python bench/bench_staleness.py --usr-dir examples/mnist1d/mnist1d_example \\
        --model mnist1d_cnn --problem mnist1d --hparam-set mnist1d_cnn --workers 8 --steps 600 \\
        --hparams learning_rate=0.2 --seeds 5 --log bench/staleness-settings.jsonl

Each run is one ``syncswitch train`` segment from scratch to ``--steps`` (BSP-equivalent steps, so
both protocols see the same number of examples) with ``--eval``; seeds and protocols interleave so a
slow patch of the shared machine falls on both. Printed: test accuracy mean ± standard error per
protocol, BSP − ASP with its standard error (the search's criterion: ≥ 1 point and > 2 SE), and
examples/s. ``--log`` appends the setting and its numbers as one JSON line: every setting tried is
kept, for docs/benchmarks.md.
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
from typing import Any

from _common import log, machine_line, markdown_table, run_json_command, syncswitch_command
from syncswitch.plan import PROTOCOLS


def run_once(args: argparse.Namespace, protocol: str, seed: int, run_dir: str) -> dict[str, Any]:
    argv = syncswitch_command(
        "train",
        f"--protocol={protocol}",
        f"--workers={args.workers}",
        f"--ps={args.ps}",
        f"--problem={args.problem}",
        f"--model={args.model}",
        f"--hparam-set={args.hparam_set}",
        f"--hparams={args.hparams}",
        f"--run-dir={run_dir}",
        f"--until-step={args.steps}",
        "--ckpt-frequency=0",
        f"--seed={seed}",
        "--eval",
        "--quiet",
        *([f"--usr-dir={args.usr_dir}"] if args.usr_dir else []),
        *([f"--momentum-rule={args.momentum_rule}"] if args.momentum_rule else []),
    )
    return run_json_command(argv, run_dir + ".log", timeout=args.timeout).summary


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--usr-dir", default="")
    p.add_argument("--model", required=True)
    p.add_argument("--problem", required=True)
    p.add_argument("--hparam-set", required=True)
    p.add_argument("--hparams", default="", help="k=v,k=v overrides (both protocols)")
    p.add_argument("--momentum-rule", default="", help="ASP's momentum rule (default: the runtime's)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--log", help="append the setting and its numbers to this .jsonl file")
    args = p.parse_args(argv)
    print(machine_line())
    work_dir = tempfile.mkdtemp(prefix="bench-staleness-")
    results: dict[str, list[dict[str, Any]]] = {protocol: [] for protocol in PROTOCOLS}
    started = time.time()
    try:
        for seed in range(args.seeds):
            for protocol in PROTOCOLS if seed % 2 == 0 else reversed(PROTOCOLS):
                log(f"seed {seed}: {protocol}")
                results[protocol].append(run_once(args, protocol, seed, f"{work_dir}/{protocol}-{seed}"))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    accuracy = {p: [r["test_accuracy"] for r in results[p]] for p in PROTOCOLS}
    rates = {p: statistics.mean(r["examples_per_sec"] for r in results[p]) for p in PROTOCOLS}
    differences = [b - a for b, a in zip(accuracy["bsp"], accuracy["asp"], strict=True)]
    rows = []
    for protocol in PROTOCOLS:
        mean, se = mean_se(accuracy[protocol])
        rows.append([protocol.upper(), f"{mean:.4f}", f"{se:.4f}", f"{rates[protocol]:.0f}"])
    print(f"\n{args.model} on {args.problem}, {args.workers} workers, {args.steps} steps, hparams "
          f"{args.hparams or '(set defaults)'}, {args.seeds} seeds:\n")  # fmt: skip
    print(markdown_table(["protocol", "test accuracy", "± SE", "examples/s"], rows))
    gap, gap_se = mean_se(differences)
    shown = gap >= 0.01 and gap > 2 * gap_se
    speed = rates["asp"] / rates["bsp"]
    print(f"\nBSP - ASP: {gap:+.4f} ± {gap_se:.4f} (paired by seed); ASP / BSP examples/s {speed:.2f}; "
          f"staleness cost shown (>= 1 point, > 2 SE): {shown}")  # fmt: skip
    if args.log:
        record = {
            "time": started,
            "setting": {k: v for k, v in vars(args).items() if k not in ("log", "timeout")},
            "accuracy": accuracy,
            "examples_per_sec": rates,
            "bsp_minus_asp": [gap, gap_se],
            "shown": shown,
        }
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
