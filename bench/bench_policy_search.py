"""The offline timing policy finding a job's switch point by itself, through Airflow's own backfill
(issue 18): a job file's DAG is unpaused and backfilled over several dates (``POST
/api/v2/backfills``) on the embedded Airflow; its overlapping runs claim the search's items (BSP
baseline, 50%, 25%, ...), train one at a time on the local cluster, and write their history.
Printed: every run with its fraction, phase and accuracy, then `syncswitch history JOB` (the
search's path and what the next run gets).

    .venv/bin/python bench/bench_policy_search.py --job mnist1d-search \\
        --from-date 2026-01-01 --to-date 2026-01-04

The job's history is kept in its bucket folder (``--fresh`` removes it first, to search from scratch).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import log, machine_line, markdown_table
from syncswitch.layout import JobHistoryLayout
from syncswitch.spec import JobSpec
from syncswitch_airflow import history
from syncswitch_airflow.dag_params import default_bucket_dir
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.job_files import jobs_dir, read_job_file

PROJECT = Path(__file__).resolve().parents[1]
SYNCSWITCH = Path(sys.executable).parent / "syncswitch"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="a job file's name in jobs/ (without .yaml)")
    p.add_argument("--from-date", required=True)
    p.add_argument("--to-date", required=True)
    p.add_argument("--fresh", action="store_true", help="remove the job's history first")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    print(machine_line())
    job_file = read_job_file(jobs_dir(PROJECT) / f"{args.job}.yaml")
    # Where the job DAG's runs go: the job's own bucket_dir, else the project's default (as the DAG).
    default = JobSpec().bucket_dir
    bucket = job_file.job.bucket_dir if job_file.job.bucket_dir != default else default_bucket_dir(PROJECT)
    if args.fresh:
        shutil.rmtree(JobHistoryLayout.for_job(bucket, args.job).root, ignore_errors=True)
    before = {r["run_id"] for r in history.read_records(bucket, args.job)}
    airflow = EmbeddedAirflow(PROJECT)
    airflow.start(wait_for_dags=(job_file.dag_id,))
    started = time.monotonic()
    try:
        airflow.api.unpause(job_file.dag_id)
        # Through the REST API, which retries the backfill that SQLite refuses when it meets the
        # scheduler's write ("database is locked" at once: the unpause just scheduled today's run);
        # `airflow backfill create` fails there with no retry.
        airflow.api.create_backfill(job_file.dag_id, args.from_date, args.to_date)
        log(f"backfill of {job_file.dag_id} from {args.from_date} to {args.to_date} created")
        while time.monotonic() - started < args.timeout:
            runs = [r for r in airflow.api.dag_runs(job_file.dag_id) if r["run_type"] == "backfill"]
            if runs and all(r["state"] in ("success", "failed") for r in runs):
                break
            time.sleep(10)
    finally:
        airflow.api.pause(job_file.dag_id)
        airflow.stop()
    records = [r for r in history.read_records(bucket, args.job) if r["run_id"] not in before]
    print(f"\n{len(records)} runs in {time.monotonic() - started:.0f} s, in completion order:\n")
    # A run's wall includes its wait for the cluster slot while an earlier run trained.
    rows = [
        [r["logical_date"][:10], f"{r['bsp_fraction']:g}", r["policy_phase"], r["status"],
         f"{r['final_accuracy']:.4f}", f"{sum(r['training_seconds'].values()):.1f}",
         f"{r['total_seconds']:.1f}"]
        for r in records
    ]  # fmt: skip
    headers = ["date", "BSP fraction", "phase", "status", "accuracy", "training (s)", "run wall (s)"]
    print(markdown_table(headers, rows))
    shown = subprocess.run(
        [str(SYNCSWITCH), "history", args.job, "--bucket-dir", bucket], capture_output=True, text=True
    )
    print("\n" + shown.stdout + shown.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
