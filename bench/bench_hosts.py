"""Hosts backend vs local backend (issue 10): switch gap and BSP/ASP throughput over emulated links.

    .venv/bin/python bench/bench_hosts.py                      # root: brings up its own testbed
    .venv/bin/python bench/bench_hosts.py --steps 200 --profiles same-zone cross-zone cross-region

One job, switch order "1010" (BSP, ASP, BSP, ASP) of --steps steps each, digits CNN, 3 workers + 1
parameter server, checkpoints in a GCS emulator, run through the cluster backends directly (launch a
segment the moment the previous one's launcher has exited: what the DAG's segment task does, without
Airflow's own scheduling in the way), once per configuration, side by side in one run:

    local           every node on this machine (127.0.0.1), the local backend's fork server
    hosts/<profile> every node on its own testbed host (chief, 3 workers, ps), each host's link
                    shaped with the testbed profile (docs/testbed.md)

Per configuration it prints BSP and ASP examples/s (mean over the segments of that protocol) and
the switch gaps (previous segment's end to the next one's first step, as the report measures them),
and each against local. The hosts here are namespaces of one 2-core machine: the processes compete
for the same cores as in the local run, so the differences are the network's and the launch path's
(SSH, TCP fork servers, per-host data staging), not more compute.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import BenchError, fmt, log, machine_line, markdown_table

PROJECT_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(PROJECT_DIR / "scripts"), str(PROJECT_DIR / "tests")]
ROLES = ("chief", "worker", "worker", "worker", "ps")


def run_job(backend: Any, job: Any, run_id: str) -> dict[str, Any]:  # noqa: ANN401
    """Every segment of the plan, one after the other; returns the report's summary of the run."""
    from syncswitch.layout import RunLayout
    from syncswitch_airflow.report import load_run, summarize

    layout = RunLayout.for_run(job.bucket_dir, job.job_name, run_id)
    handle = backend.provision(job, layout)
    try:
        for entry in job.plan_entries():
            spec = job.segment_spec(entry, run_id, layout.root)
            backend.launch_segment(handle, spec)
            while backend.segment_status(handle, spec.index).running:
                time.sleep(0.2)
            status = backend.segment_status(handle, spec.index)
            if status.exit_code != 0:
                raise BenchError(
                    f"{run_id} segment {spec.index} failed:\n{backend.segment_log_tail(handle, spec.index)}"
                )
    finally:
        backend.teardown(handle)
    return summarize(load_run(layout.root))


def measures(summary: dict[str, Any]) -> dict[str, float | None]:
    def mean(values: list[float]) -> float | None:
        return statistics.mean(values) if values else None

    by_protocol: dict[str, list[float]] = {"bsp": [], "asp": []}
    for segment in summary["segments"]:
        if segment.get("examples_per_sec"):
            by_protocol[segment["protocol"]].append(segment["examples_per_sec"])
    gaps = [g["seconds"] for g in summary.get("switch_gaps_seconds", [])]
    return {"bsp": mean(by_protocol["bsp"]), "asp": mean(by_protocol["asp"]), "gap": mean(gaps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per segment")
    p.add_argument("--profiles", nargs="+", default=["same-zone", "cross-zone", "cross-region"])
    args = p.parse_args(argv)

    import testbed as tb
    from conftest import GcsEmulator, _free_port
    from syncswitch import storage
    from syncswitch.spec import JobSpec
    from syncswitch_airflow.backends.hosts import KNOWN_HOSTS_ENV, HostsBackend
    from syncswitch_airflow.backends.local import LocalBackend

    reason = tb.ensure_prerequisites()
    if reason:
        print(f"bench_hosts: needs the testbed: {reason}", file=sys.stderr)
        return 2
    machine = machine_line()
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    bed = tb.Testbed(f"bh{os.getpid() % 10000}", len(ROLES))
    hosts = bed.up()
    gcs = GcsEmulator(work, _free_port(), host=bed.gateway)
    gcs.start()
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
    os.environ[KNOWN_HOSTS_ENV] = bed.known_hosts_path
    os.environ["SYNCSWITCH_WORK_DIR"] = str(work / "local")
    results: dict[str, dict[str, float | None]] = {}
    try:
        bucket = f"bench-hosts-{uuid.uuid4().hex[:8]}"
        storage.gcs_client().create_bucket(bucket)
        base = {
            "job_name": "bench-hosts",
            "bucket_dir": f"gs://{bucket}/runs",
            "switch_order": "1010",
            "train_steps": [args.steps] * 4,
            "ckpt_frequency": [0],
            "num_workers": 3,
            "num_ps": 1,
            "evaluate_segments": False,
        }
        host_list = [
            f"address={h.address},key={bed.key_path},role={role},name={h.name}"
            for h, role in zip(hosts, ROLES, strict=True)
        ]
        log(f"local: 4 segments of {args.steps} steps")
        results["local"] = measures(run_job(LocalBackend(), JobSpec.from_params(base), "local"))
        for profile in args.profiles:
            for host in hosts:
                bed.set_profile(host, profile)
            log(f"hosts/{profile}: 4 segments of {args.steps} steps")
            job = JobSpec.from_params({**base, "cluster_backend": "hosts", "hosts": host_list})
            results[f"hosts/{profile}"] = measures(run_job(HostsBackend(), job, f"hosts-{profile}"))
    except BenchError as exc:
        print(f"bench_hosts: {exc}", file=sys.stderr)
        return 1
    finally:
        gcs.stop()
        bed.down()
        shutil.rmtree(work, ignore_errors=True)

    local = results["local"]
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                fmt(r["bsp"], 0),
                fmt(r["asp"], 0),
                fmt(r["asp"] / r["bsp"] if r["asp"] and r["bsp"] else None, 2),
                fmt(r["bsp"] / local["bsp"] if r["bsp"] and local["bsp"] else None, 2),
                fmt(r["asp"] / local["asp"] if r["asp"] and local["asp"] else None, 2),
                fmt(r["gap"], 2),
                fmt(
                    r["gap"] - local["gap"] if r["gap"] is not None and local["gap"] is not None else None, 2
                ),
            ]
        )
    print("# bench_hosts: digits CNN, 3 workers + 1 PS, '1010'")
    print(f"machine: {machine}; {args.steps} steps per segment; testbed delays by {bed.delay_mechanism}")
    print()
    headers = [
        "cluster",
        "BSP ex/s",
        "ASP ex/s",
        "ASP/BSP",
        "BSP/local",
        "ASP/local",
        "switch gap s",
        "gap - local s",
    ]
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
