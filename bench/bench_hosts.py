"""Hosts backend vs local backend (issue 10): switch gap and each protocol's throughput over emulated links.

    .venv/bin/python bench/bench_hosts.py                      # root: brings up its own testbed
    .venv/bin/python bench/bench_hosts.py --steps 200 --links same-zone cross-zone cross-region
    .venv/bin/python bench/bench_hosts.py --switch-order 10 --links lan delay=1 delay=5 delay=20 \
        rate=1000 rate=100 rate=20                           # latency alone, then bandwidth alone
    .venv/bin/python bench/bench_hosts.py --switch-order bsp,fp16,topk:0.01,local:4,ssp:2,asp \
        --links lan rate=50 rate=10                          # do fewer bytes buy time on a thin link?
    .venv/bin/python bench/bench_hosts.py --model resnet --steps 40 --switch-order 10 --links ...

One job (switch order --switch-order, "1010" by default, of --steps steps per segment; the digits CNN
or ResNet-20 on synthetic CIFAR with 32 examples per worker), 3 workers + 1 parameter server,
checkpoints in a GCS emulator, run through the cluster backends directly (launch a segment the moment
the previous one's launcher has exited: what the DAG's segment task does, without Airflow's own
scheduling in the way), once per configuration, side by side in one run:

    local           every node on this machine (127.0.0.1), the local backend's fork server
    hosts/<link>    every node on its own testbed host (chief, 3 workers, ps), every host's link
                    shaped alike: a testbed profile (docs/testbed.md) or ``delay=MS,rate=MBIT,
                    loss=PCT,jitter=MS`` (delay one-way per host link, so two hosts are 4 x delay
                    apart; rate in each direction of each host's link)

Per configuration it prints the measured round trip between two worker hosts (fastest of five TCP
connects); per protocol of the order, its examples/s (mean over its segments), against the order's
first protocol on the same cluster and against itself on the local cluster, and the bytes a worker
sent per step (the segments' own count); and the switch gaps (previous segment's end to the next
one's first step, as the report measures them): their mean, the longest, and the mean hand-off
(previous segment's result to the next launcher's start; the rest is the next segment's start-up).
The hosts here are namespaces of one 2-core machine: the processes compete for the same cores as in
the local run, so the differences are the network's and the launch path's (SSH, TCP fork servers,
per-host data staging), not more compute.
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

from _common import BenchError, fmt, log, machine_line, markdown_table, ratio

PROJECT_DIR = Path(__file__).resolve().parents[1]
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


def measures(summary: dict[str, Any]) -> dict[str, Any]:
    """Per protocol as the switch order spells it ('bsp', 'fp16', 'ssp:2'): examples/s and bytes a
    worker sent per step, each the mean over the segments that ran it; and the switch gaps."""

    def mean(values: list[float]) -> float | None:
        return statistics.mean(values) if values else None

    speed: dict[str, list[float]] = {}
    sent: dict[str, list[float]] = {}
    for segment in summary["segments"]:
        token = segment["protocol_token"]
        if segment.get("examples_per_sec"):
            speed.setdefault(token, []).append(segment["examples_per_sec"])
        if segment.get("bytes_per_worker_step") is not None:
            sent.setdefault(token, []).append(segment["bytes_per_worker_step"])
    gaps = [g for g in summary.get("switch_gaps_seconds", []) if g["seconds"] is not None]
    return {
        "speed": {token: mean(values) for token, values in speed.items()},
        "bytes": {token: mean(values) for token, values in sent.items()},
        "gap": mean([g["seconds"] for g in gaps]),
        "gap_max": max((g["seconds"] for g in gaps), default=None),
        # The part of the gap before the next launcher started (old nodes stopped, launcher start).
        "handoff": mean([g["handoff_seconds"] for g in gaps if g.get("handoff_seconds") is not None]),
    }


def speed_rows(results: dict[str, dict[str, Any]], protocols: list[str]) -> list[list[str]]:
    """One row per cluster and protocol: examples/s, against the first protocol of the order on the
    same cluster and against the same protocol on the local cluster, and bytes per worker-step."""
    local, first = results["local"], protocols[0]
    rows = []
    for name, r in results.items():
        for token in protocols:
            speed = r["speed"].get(token)
            rows.append(
                [
                    name,
                    fmt(r.get("rtt"), 2),
                    fmt(r.get("rate"), 0),
                    token,
                    fmt(speed, 0),
                    fmt(ratio(speed, r["speed"].get(first)), 2),
                    fmt(ratio(speed, local["speed"].get(token)), 2),
                    fmt(r["bytes"].get(token), 0),
                ]
            )
    return rows


def gap_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    local = results["local"]
    return [
        [
            name,
            fmt(r["gap"], 2),
            fmt(r["gap_max"], 2),
            fmt(r["handoff"], 2),
            fmt(r["gap"] - local["gap"] if r["gap"] is not None and local["gap"] is not None else None, 2),
        ]
        for name, r in results.items()
    ]


MODELS: dict[str, dict[str, Any]] = {
    "digits": {"problem": "digits", "model": "cnn"},
    "resnet": {
        "problem": "synthetic_cifar",
        "model": "resnet",
        "hparam_set": "resnet_cifar_20",
        "hparams": ["batch_size=32"],
    },
}
_LINK_KEYS = {"delay": "delay_ms", "rate": "rate_mbit", "loss": "loss_pct", "jitter": "jitter_ms"}


def link_shape(text: str, profiles: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """A --links item: a testbed profile's name, or ``delay=MS,rate=MBIT,loss=PCT,jitter=MS`` (any
    of them; the rest unshaped)."""
    if text in profiles:
        return dict(profiles[text])
    shape: dict[str, float | None] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in _LINK_KEYS or not value:
            raise argparse.ArgumentTypeError(
                f"--links {text!r}: a profile ({', '.join(profiles)}) or delay=,rate=,loss=,jitter="
            )
        shape[_LINK_KEYS[key]] = float(value)
    return shape


def host_round_trip_ms(bed: Any, source: Any, target: Any) -> float | None:  # noqa: ANN401
    """The fastest of five TCP connects from one testbed host to another's sshd, in ms."""
    result = bed.connect_ms(source, target.address, target.ssh_port, count=5, timeout=5.0)
    return result if isinstance(result, float) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per segment")
    p.add_argument("--model", choices=sorted(MODELS), default="digits")
    p.add_argument(
        "--switch-order",
        default="1010",
        help="the job's switch order: digits (1 = BSP, 0 = ASP) or protocols ('bsp,fp16,topk:0.01,ssp:2')",
    )
    p.add_argument(
        "--links",
        "--profiles",
        nargs="+",
        default=["same-zone", "cross-zone", "cross-region"],
        help="testbed profiles or delay=MS,rate=MBIT,loss=PCT,jitter=MS, one configuration each",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder (the emulator's objects)")
    args = p.parse_args(argv)

    import testbed as tb
    from gcs_emulator import GcsEmulator, free_port
    from syncswitch import storage
    from syncswitch.protocols import parse_switch_order
    from syncswitch.spec import JobSpec, SpecError
    from syncswitch_airflow.backends.hosts import HostsBackend
    from syncswitch_airflow.backends.local import LocalBackend
    from syncswitch_airflow.settings import setting

    try:
        links = {text: link_shape(text, tb.PROFILES) for text in args.links}
        protocols = [protocol.token for protocol in parse_switch_order(args.switch_order)]
    except (argparse.ArgumentTypeError, SpecError) as exc:
        p.error(str(exc))
    reason = tb.ensure_prerequisites()
    if reason:
        print(f"bench_hosts: needs the testbed: {reason}", file=sys.stderr)
        return 2
    machine = machine_line()
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    bed = tb.Testbed(f"bh{os.getpid() % 10000}", len(ROLES))
    hosts = bed.up()
    gcs = GcsEmulator(work, free_port(), host=bed.gateway)
    gcs.start()
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
    os.environ[setting("ssh_known_hosts").env] = bed.known_hosts_path
    os.environ["SYNCSWITCH_WORK_DIR"] = str(work / "local")
    results: dict[str, dict[str, float | None]] = {}
    segments = len(protocols)
    try:
        bucket = f"bench-hosts-{uuid.uuid4().hex[:8]}"
        storage.gcs_client().create_bucket(bucket)
        base = {
            "job_name": "bench-hosts",
            "bucket_dir": f"gs://{bucket}/runs",
            "switch_order": args.switch_order,
            "train_steps": [args.steps] * segments,
            "ckpt_frequency": [0],
            "num_workers": 3,
            "num_ps": 1,
            "evaluate_segments": False,
            "max_online_switches": 0,  # no online policy here; lets a plan use all six segments
            **MODELS[args.model],
        }
        host_list = [
            f"address={h.address},key={bed.key_path},role={role},name={h.name}"
            for h, role in zip(hosts, ROLES, strict=True)
        ]
        log(f"local: {segments} segments of {args.steps} steps")
        results["local"] = measures(run_job(LocalBackend(), JobSpec.from_params(base), "local"))
        for number, (text, shape) in enumerate(links.items()):
            for host in hosts:
                bed.set_link(host, **shape)
            rtt = host_round_trip_ms(bed, hosts[1], hosts[2])
            log(f"hosts/{text}: worker hosts {fmt(rtt, 2)} ms apart; {segments} x {args.steps} steps")
            job = JobSpec.from_params({**base, "cluster_backend": "hosts", "hosts": host_list})
            results[f"hosts/{text}"] = {
                **measures(run_job(HostsBackend(), job, f"hosts-{number}")),
                "rtt": rtt,
                "rate": shape.get("rate_mbit"),
            }
    except BenchError as exc:
        print(f"bench_hosts: {exc}", file=sys.stderr)
        return 1
    finally:
        gcs.stop()
        bed.down()
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    model = {"digits": "digits CNN", "resnet": "ResNet-20 synthetic CIFAR, 32 per worker"}[args.model]
    print(f"# bench_hosts: {model}, 3 workers + 1 PS, '{args.switch_order}'")
    print(f"machine: {machine}; {args.steps} steps per segment; testbed delays by {bed.delay_mechanism}")
    print()
    order = list(dict.fromkeys(protocols))
    headers = [
        "cluster",
        "host RTT ms",
        "Mbit/s",
        "protocol",
        "ex/s",
        f"vs {order[0]}",
        "vs local",
        "bytes/worker/step",
    ]
    print(markdown_table(headers, speed_rows(results, order)))
    print()
    print(
        markdown_table(
            ["cluster", "switch gap s", "max gap s", "hand-off s", "gap - local s"], gap_rows(results)
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
