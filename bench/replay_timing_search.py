"""Replay the offline timing policy (``timing_policy: search``) over the runs of a sweep (issue 9).

    .venv/bin/python bench/replay_timing_search.py experiments/digits-staleness.yaml [--tolerance 0.005]

A sweep runs BSP and several fixed BSP fractions k times each (`syncswitch sweep`). This script asks
the policy (syncswitch_airflow.timing.decide, the code the timing_policy task runs) for its next
decision, answers it with the sweep's next unused run of the fraction it asked for (the history record
the run's finalize task wrote), and repeats until the policy exploits or asks for a fraction the sweep
did not run. It prints one table row per decision and, last, one JSON line: the chosen fraction and
after how many runs. Only completed runs count (the policy's own rule).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _common import markdown_table
from syncswitch_airflow import history
from syncswitch_airflow.timing import TimingConfig, completion_key, decide
from syncswitch_airflow.tools.sweep import read_sweep

REPLAY_JOB = "replay"


def sweep_records(sweep_file: Path) -> dict[float, list[dict[str, Any]]]:
    """The sweep's successful history records by BSP fraction (ASP-only configs left out)."""
    sweep = read_sweep(sweep_file)
    by_fraction: dict[float, list[dict[str, Any]]] = {}
    for job in sweep.configs.values():
        bucket = str(Path(job.bucket_dir).resolve())
        for record in history.read_records(bucket, job.job_name):
            if record["status"] == "success" and record["bsp_fraction"] > 0:
                by_fraction.setdefault(record["bsp_fraction"], []).append(record)
    for records in by_fraction.values():
        records.sort(key=completion_key)
    return by_fraction


def replay(by_fraction: dict[float, list[dict[str, Any]]], config: TimingConfig) -> dict[str, Any]:
    # One fingerprint for all: the sweep's configs differ only in what the policy varies.
    fingerprint = "sweep"
    used: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    while True:
        decision = decide(used, [], fingerprint, config, time.time())
        rows.append([str(len(used)), decision.phase, f"{decision.bsp_fraction:g}", decision.reason])
        if decision.phase == "exploit":
            break
        pool = by_fraction.get(decision.bsp_fraction, [])
        taken = sum(1 for r in used if r["bsp_fraction"] == decision.bsp_fraction)
        if taken >= len(pool):
            break
        used.append({**pool[taken], "job_name": REPLAY_JOB, "fingerprint": fingerprint})
    return {"decisions": rows, "runs_used": len(used), "last": rows[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_file", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=TimingConfig.tolerance)
    args = parser.parse_args(argv)
    config = TimingConfig(repeats=args.repeats, tolerance=args.tolerance)
    config.validate()
    by_fraction = sweep_records(args.sweep_file)
    counts = {f: len(r) for f, r in sorted(by_fraction.items(), reverse=True)}
    print(
        f"sweep runs by BSP fraction: {counts}; k = {args.repeats}, tolerance = {args.tolerance}",
        file=sys.stderr,
    )
    result = replay(by_fraction, config)
    print(markdown_table(["runs seen", "phase", "BSP fraction", "reason"], result["decisions"]))
    _runs, phase, fraction_text, _reason = result["last"]
    fraction = float(fraction_text)
    chosen = fraction if phase == "exploit" else None
    print(
        json.dumps({"phase": phase, "bsp_fraction": fraction, "chosen": chosen, "runs": result["runs_used"]})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
