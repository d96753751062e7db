"""The pipeline on the Celery deployment against the embedded default, and concurrent runs (issue 19).

    sudo .venv/bin/python bench/bench_distributed.py                    # ~20 minutes on 2 cores
    sudo .venv/bin/python bench/bench_distributed.py --only-concurrent  # part 2 alone
    sudo .venv/bin/python bench/bench_distributed.py --only-side-by-side  # part 1 alone

Side by side in one run, on one testbed and one GCS emulator:

1. the same job ("101" on the ``hosts`` backend, three training hosts) on the embedded Airflow
   (SQLite, LocalExecutor) and on the Celery deployment (testing/celery_deployment.py: PostgreSQL,
   Redis, two Celery workers on their own hosts): the DAG run's fixed overhead (trigger to first step,
   last step to run end), its switch gaps, and the Airflow processes' CPU while the first segment
   trains (PostgreSQL and Redis counted on the Celery side);
2. on the Celery deployment, a backfill of a recurring job over four dates, its four runs active
   at once (the job file's ``max_active_runs: 4``), on a pool of six training hosts, three per
   cluster (``hosts_per_cluster=3``), with room for two clusters (``hosts_clusters=2``): each run's
   wait from the backfill's creation to its cluster's lease, and, from the capacity ledger itself
   (polled every 0.5 s), that no host was in two leases at once and how many clusters were held at
   once. The job file is in a folder every component sees (``[syncswitch] jobs_dir``), as a
   deployment's DAG bundle would be.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BenchError, fmt, log, machine_line, markdown_table, wait_for_bsp_step

PROJECT_DIR = Path(__file__).resolve().parents[1]
ROLES = ("chief", "worker", "ps")
WORKER_HOSTS = 2


def conf(bucket: str, job: str, hosts: list[str], first_steps: int) -> dict[str, Any]:
    return {
        "job_name": job,
        "cluster_backend": "hosts",
        "hosts": hosts,
        "bucket_dir": f"{bucket}/runs",
        "switch_order": "101",
        "train_steps": [first_steps, 200, 200],
        "ckpt_frequency": [500, 100, 100],
        "num_workers": 2,
        "num_ps": 1,
        "max_online_switches": 0,
    }


def host_params(bed: Any, hosts: list[Any], key: str) -> list[str]:
    return [
        f"address={h.address},key={key},role={r},name={h.name}" for h, r in zip(hosts, ROLES, strict=True)
    ]


def cpu_of(pids: list[int], seconds: float) -> float:
    from syncswitch import procs

    before = {pid: procs.cpu_seconds(pid) or 0.0 for pid in pids}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return sum(((procs.cpu_seconds(pid) or before[pid]) - before[pid]) for pid in pids) / elapsed


def airflow_pids(airflow: Any, extra_marker: str | None) -> list[int]:
    """The Airflow instance's processes (their marker), and the deployment's (PostgreSQL, Redis,
    Celery workers) where ``extra_marker`` names it."""
    from syncswitch import procs
    from syncswitch_airflow.embedded.instance import INSTANCE_ENV, instance_marker

    pids = {
        p.pid for p in procs.processes_with_env(INSTANCE_ENV, instance_marker(airflow.running_instance()))
    }
    if extra_marker:
        pids |= {p.pid for p in procs.processes_with_env("SYNCSWITCH_DEPLOYMENT", extra_marker)}
    return sorted(pids)


def one_job(name: str, airflow: Any, job_conf: dict[str, Any], sample_s: float, marker: str | None) -> dict:
    from syncswitch.layout import RunLayout
    from syncswitch_airflow.report import load_run, summarize

    api = airflow.api
    triggered = time.time()
    run_id = api.trigger("sync_switch", job_conf)
    layout = RunLayout.for_run(job_conf["bucket_dir"], job_conf["job_name"], run_id)
    wait_for_bsp_step(layout, 200, timeout=900)
    log(f"{name}: sampling Airflow's CPU for {sample_s:.0f} s while BSP trains")
    cpu = cpu_of(airflow_pids(airflow, marker), sample_s)
    state = api.wait("sync_switch", run_id, timeout=3600)
    if state != "success":
        raise BenchError(f"{name}: the run ended {state}")
    run = api.get_json(f"/api/v2/dags/sync_switch/dagRuns/{run_id}")
    ended = datetime.datetime.fromisoformat(run["end_date"]).timestamp()
    summary = summarize(load_run(layout.root))
    segments = summary["segments"]
    first_step = min(s["first_step_at"] for s in segments if s.get("first_step_at"))
    last_step = max(s["ended_at"] for s in segments if s.get("ended_at"))
    gaps = [g["seconds"] for g in summary["switch_gaps_seconds"] if g.get("seconds") is not None]
    first_segment = min(segments, key=lambda s: s.get("first_step_at") or float("inf"))
    return {
        "to_first_step": first_step - triggered,
        "after_last_step": ended - last_step,
        "gaps": gaps,
        "cpu": cpu,
        "timeline": fixed_overhead_timeline(api, run_id, triggered, first_segment, last_step, ended),
    }


def fixed_overhead_timeline(
    api: Any, run_id: str, triggered: float, first_segment: dict[str, Any], last_step: float, ended: float
) -> dict[str, str]:
    """Where the fixed overhead went: each task instance that started before the first step or ended
    after the last one, as "queued / started / ended" seconds after the trigger (the first segment's
    own start-up and the run's end beside them)."""
    body = api.get_json(f"/api/v2/dags/sync_switch/dagRuns/{run_id}/taskInstances?limit=1000")
    first_step = first_segment["first_step_at"]

    def after(stamp: str | None) -> float | None:
        return datetime.datetime.fromisoformat(stamp).timestamp() - triggered if stamp else None

    timeline = {}
    for ti in sorted(body["task_instances"], key=lambda t: t.get("start_date") or "~"):
        queued, started, finished = (after(ti.get(k)) for k in ("queued_when", "start_date", "end_date"))
        if started is None or not (
            started < first_step - triggered or (finished or 0) > last_step - triggered
        ):
            continue
        timeline[ti["task_id"]] = " / ".join(fmt(t, 1) for t in (queued, started, finished))
    timeline["first segment: launched / first step"] = " / ".join(
        fmt(t - triggered if t else None, 1) for t in (first_segment.get("started_at"), first_step)
    )
    timeline["last step / run end"] = f"{fmt(last_step - triggered, 1)} / {fmt(ended - triggered, 1)}"
    return timeline


BACKFILL_DATES = ("2026-01-01", "2026-01-04")  # four daily runs
POOLED_JOB = "pooled"
POOLED_DAG = "job_pooled"


def write_pooled_job(jobs_dir: Path, bucket: str, pool: list[str], steps: int) -> None:
    """A daily job over the pool whose date range is over, so that unpausing it (for the backfill)
    schedules no run of its own; four of its runs may be active at once."""
    import yaml

    params = conf(bucket, POOLED_JOB, pool, steps)
    params.update(train_steps=[steps, 100, 100], hosts_per_cluster=len(ROLES))
    job = {
        "description": "bench_distributed: four backfilled runs on a pool with room for two clusters",
        "schedule": "@daily",
        "start_date": BACKFILL_DATES[0],
        "end_date": "2026-01-31",
        "max_active_runs": 4,
        "params": params,
    }
    jobs_dir.mkdir(parents=True, exist_ok=True)
    (jobs_dir / f"{POOLED_JOB}.yaml").write_text(yaml.safe_dump(job, sort_keys=False))


Ledger = tuple[list[dict[str, Any]], list[tuple[str, str, str]], int]


def wait_until(condition: Any, what: str, timeout: float = 300.0) -> None:
    from syncswitch import procs

    if not procs.wait_until(condition, timeout, poll=1.0):
        raise BenchError(f"not within {timeout:.0f} s: {what}")


def backfilled_runs(deployment: Any, bucket: str) -> Ledger:
    """A backfill over BACKFILL_DATES (four runs at once): each run's wait from the backfill's
    creation to its cluster's lease; every host the ledger ever showed in two leases at once; the
    most leases held at once (2 when the ledger is what queues the runs)."""
    from celery_deployment import LedgerWatch
    from syncswitch.layout import safe_run_id

    api = deployment.airflow.api
    wait_until(
        lambda: any(d["dag_id"] == POOLED_DAG for d in api.get_json("/api/v2/dags?limit=1000")["dags"]),
        f"{POOLED_DAG} parsed from its job file",
    )
    api.unpause(POOLED_DAG)
    with LedgerWatch(f"{bucket}/_leases/hosts.json") as watch:
        created = time.time()
        api.create_backfill(POOLED_DAG, *BACKFILL_DATES, max_active_runs=4)
        wait_until(lambda: len(api.dag_runs(POOLED_DAG)) == 4, "the backfill's four runs created")
        runs = api.dag_runs(POOLED_DAG)
        states = {r["dag_run_id"]: api.wait(POOLED_DAG, r["dag_run_id"], timeout=3600) for r in runs}
    rows = []
    for run in sorted(runs, key=lambda r: r["logical_date"]):
        held = watch.held.get(safe_run_id(run["dag_run_id"]))  # a lease is named by its run folder
        rows.append(
            {
                "run": run["logical_date"][:10],
                "type": run["run_type"],
                "hosts": ", ".join(sorted(held["hosts"])) if held else "",
                "state": states[run["dag_run_id"]],
                "queued": held["from"] - created if held else float("nan"),
                "held": held["to"] - held["from"] if held else float("nan"),
            }
        )
    return rows, watch.shared, watch.most_at_once()


def main(argv: list[str] | None = None) -> int:
    import testbed as tb
    from celery_deployment import CeleryDeployment, missing_prerequisites
    from gcs_emulator import GcsEmulator, free_port
    from syncswitch import storage
    from syncswitch_airflow.embedded.airflow import EmbeddedAirflow

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--first-segment-steps", type=int, default=2000)
    p.add_argument("--sample-seconds", type=float, default=20.0)
    p.add_argument("--concurrent-steps", type=int, default=200)
    parts = p.add_mutually_exclusive_group()
    parts.add_argument("--only-concurrent", action="store_true", help="skip part 1 (the side-by-side job)")
    parts.add_argument("--only-side-by-side", action="store_true", help="skip part 2 (the concurrent runs)")
    args = p.parse_args(argv)
    reason = missing_prerequisites()
    if reason:
        print(f"bench_distributed: {reason}", file=sys.stderr)
        return 2
    machine = machine_line()
    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    bed = tb.Testbed(f"bdi{os.getpid() % 10000}", WORKER_HOSTS + 2 * len(ROLES))
    bed.up()
    gcs = GcsEmulator(work / "gcs", free_port(), host=bed.gateway)
    (work / "gcs").mkdir()
    gcs.start()
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
    os.environ["SYNCSWITCH_SSH_KNOWN_HOSTS"] = bed.known_hosts_path
    # The job file where every component finds it (the workers see /var/tmp, not /tmp).
    jobs_dir = Path(tempfile.mkdtemp(prefix="bench-distributed-jobs-", dir="/var/tmp"))
    results: dict[str, dict[str, Any]] = {}
    concurrent = None
    try:
        bucket = "gs://bench-distributed"
        storage.gcs_client().create_bucket(bucket.removeprefix("gs://"))
        key = f"{bucket}/keys/hosts"
        storage.write_bytes(key, Path(bed.key_path).read_bytes())
        set_a = host_params(bed, bed.hosts[WORKER_HOSTS : WORKER_HOSTS + 3], key)
        set_b = host_params(bed, bed.hosts[WORKER_HOSTS + 3 :], key)
        write_pooled_job(jobs_dir, bucket, set_a + set_b, args.concurrent_steps)
        shared = {
            "SYNCSWITCH__LEASES_DIR": f"{bucket}/_leases",
            "SYNCSWITCH__HOSTS_CLUSTERS": "2",
            "SYNCSWITCH__JOBS_DIR": str(jobs_dir),
        }

        if not args.only_concurrent:
            embedded = EmbeddedAirflow(PROJECT_DIR, home=work / "embedded", port=0, settings=shared)
            log("embedded Airflow: starting")
            embedded.start()
            try:
                results["embedded (SQLite, LocalExecutor)"] = one_job(
                    "embedded",
                    embedded,
                    conf(bucket, "embedded", set_a, args.first_segment_steps),
                    args.sample_seconds,
                    None,
                )
            finally:
                embedded.stop()

        log("Celery deployment: starting")
        with CeleryDeployment(work / "celery", bed, gcs, WORKER_HOSTS, settings=shared) as deployment:
            if not args.only_concurrent:
                results["Celery (PostgreSQL, Redis, 2 workers)"] = one_job(
                    "celery",
                    deployment.airflow,
                    conf(bucket, "celery", set_a, args.first_segment_steps),
                    args.sample_seconds,
                    str(deployment.root),
                )
            if not args.only_side_by_side:
                log("Celery deployment: a backfill of four runs at once, six hosts, room for two clusters")
                concurrent = backfilled_runs(deployment, bucket)
    except BenchError as exc:
        print(f"bench_distributed: {exc}", file=sys.stderr)
        return 1
    finally:
        gcs.stop()
        bed.down()
        shutil.rmtree(jobs_dir, ignore_errors=True)

    print("# bench_distributed: the embedded Airflow against the Celery deployment, hosts backend, '101'")
    print(f"machine: {machine}")
    print()
    if results:  # part 1 ran
        headers = [
            "Airflow",
            "trigger to first step (s)",
            "last step to run end (s)",
            "switch gaps (s)",
            "Airflow CPU while BSP trains (cores)",
        ]
        rows = [
            [
                name,
                fmt(r["to_first_step"], 1),
                fmt(r["after_last_step"], 1),
                " ".join(fmt(g, 1) for g in r["gaps"]),
                fmt(r["cpu"], 3),
            ]
            for name, r in results.items()
        ]
        print(markdown_table(headers, rows))
        print()
        overhead = {name: r["to_first_step"] + r["after_last_step"] for name, r in results.items()}
        mean_gap = {name: sum(r["gaps"]) / max(len(r["gaps"]), 1) for name, r in results.items()}
        (base, celery) = results
        print(
            f"Celery / embedded: fixed overhead x{fmt(overhead[celery] / overhead[base], 2)}, "
            f"mean switch gap x{fmt(mean_gap[celery] / mean_gap[base], 2)}"
        )
        print()
        print("Where the fixed overhead went: queued / started / ended, seconds after the trigger")
        print()
        events = list(dict.fromkeys(e for r in results.values() for e in r["timeline"]))
        print(
            markdown_table(
                ["task", *results],
                [[e, *(r["timeline"].get(e, "") for r in results.values())] for e in events],
            )
        )
        print()
    if concurrent is None:
        return 0
    runs, shared_hosts, most = concurrent
    print(
        markdown_table(
            ["date", "type", "hosts it took", "state", "waited for its cluster (s)", "held it (s)"],
            [
                [r["run"], r["type"], r["hosts"], r["state"], fmt(r["queued"], 1), fmt(r["held"], 1)]
                for r in runs
            ],
        )
    )
    print()
    print(f"most clusters held at once: {most} (room for 2)")
    print(
        "no host in two clusters at once"
        if not shared_hosts
        else f"HOSTS SHARED (host, run, run): {sorted(set(shared_hosts))}"
    )
    return 0 if not shared_hosts and all(r["state"] == "success" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
