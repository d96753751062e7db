"""Online policy benchmark (issue 4): the same job under a transient straggler with no policy, greedy and
elastic, and once without a straggler (greedy) to count false switches.

    .venv/bin/python bench/bench_policies.py
    .venv/bin/python bench/bench_policies.py --straggler worker=1,start=60,duration=600,slowdown=4
    .venv/bin/python bench/bench_policies.py --reference        # also: no policy, no straggler
    .venv/bin/python bench/bench_policies.py -- --total-steps 2000 --bsp-fraction 0.5
                                         # flags after -- follow the default job flags (later flags win)
    .venv/bin/python bench/bench_policies.py --testbed --policies none greedy
                                         # network straggler: 1 PS + 3 workers, each on a testbed
                                         # host, worker 1's link +30 ms per round trip (issue 10)

With --testbed (root) the cluster is the hosts backend on a 5-host network-namespace testbed
(testing/testbed: chief, three workers, a parameter server) with checkpoints in a GCS emulator on
the testbed's gateway, and the default job is the digits CNN, whose BSP a 30 ms link slows about
fivefold. Otherwise every run is on the local backend.

Every run is one `syncswitch run --json-only`, one after the other on the same
embedded Airflow (kept up between runs, stopped at the end). "time" is the DAG run wall (trigger ->
run finished); "speed-up" is the no-policy run's time over this run's. Switches are the online
decisions that changed the plan (state.json ``decisions`` with action switch / switch_back); without a
straggler every switch is a false one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    BenchError,
    add_airflow_home_argument,
    fmt,
    load_1m,
    log,
    machine_line,
    markdown_table,
    run_command,
    run_json_command,
    split_passthrough,
    syncswitch_command,
    tail,
)

PROJECT_DIR = Path(__file__).resolve().parents[1]
SPEEDUP_GOAL = 1.1
RUN_TIMEOUT_SECONDS = 2 * 3600.0
SWITCH_ACTIONS = ("switch", "switch_back")
# The job: ResNet-20 on synthetic CIFAR, 32 examples per worker, BSP for 80% of the steps, so that a
# straggler during BSP costs minutes. Digits is no use here: its ASP is no faster than BSP under a
# straggler (PS round trips dominate a tiny model), so no policy could win. The straggler lasts long
# enough (300 s) to be worth a switch there and back at this machine's ~50 s switch gaps.
DEFAULT_JOB_FLAGS = (
    "--problem",
    "synthetic_cifar",
    "--model",
    "resnet",
    "--hparam-set",
    "resnet_cifar_20",
    "--hparams",
    "batch_size=32",
    "--total-steps",
    "800",
    "--switch-order",
    "10",
    "--bsp-fraction",
    "0.8",
)
DEFAULT_STRAGGLER = "worker=1,start=60,duration=300,slowdown=6"
# --testbed: the network straggler of the original (tc netem delay on one worker's link). Digits
# suffices here: a slow link costs BSP several round trips per step, ASP only the slow worker's own.
TESTBED_JOB_FLAGS = (
    "--problem",
    "digits",
    "--model",
    "cnn",
    "--switch-order",
    "10",
    "--train-steps",
    "2000",
    "200",
    "--ckpt-frequency",
    "200",
    "--num-ps",
    "1",
    # Three workers at least: the detector names a slow link by each worker's smallest round trip to
    # a peer, and with two workers both see the same link.
    "--num-worker",
    "3",
)
TESTBED_STRAGGLER = "worker=1,start=20,duration=3600,delay_ms=30"
TESTBED_ROLES = ("chief", "worker", "worker", "worker", "ps")


@dataclass(frozen=True)
class Case:
    name: str
    policy: str
    straggler: bool


@dataclass
class Outcome:
    case: Case
    dag_seconds: float | None = None
    training_span: float | None = None  # first segment launch -> last segment end
    final_accuracy: float | None = None
    switches: int | None = None
    decisions: int | None = None
    segments: str = ""
    load_at_start: float = 0.0
    error: str | None = None


def cases(reference: bool, policies: list[str]) -> list[Case]:
    chosen = [
        Case("no policy, straggler", "none", True),
        Case("greedy, straggler", "greedy", True),
        Case("elastic, straggler", "elastic", True),
        Case("greedy, no straggler", "greedy", False),
    ]
    if reference:
        chosen.append(Case("no policy, no straggler", "none", False))
    return [c for c in chosen if c.policy in policies]


# ---- running ---------------------------------------------------------------------------------------


def run_case(case: Case, args: argparse.Namespace, job_flags: list[str], work_dir: str) -> Outcome:
    flags = [*job_flags, "--online-policy", case.policy, "--job-name", f"bench-{case.policy}"]
    if case.straggler:
        flags += ["--straggler", args.straggler]
    argv = syncswitch_command(
        "run",
        "--json-only",
        "--keep-ui",  # the next case reuses this Airflow; main() stops it at the end
        "--airflow-home",
        args.airflow_home,
        "--bucket-dir",
        os.path.join(work_dir, "runs"),
        *flags,
    )
    log_path = os.path.join(work_dir, f"{case.policy}-{'straggler' if case.straggler else 'clean'}.log")
    result = run_json_command(argv, log_path, timeout=RUN_TIMEOUT_SECONDS)
    run = result.summary
    if run.get("state") != "success":
        raise BenchError(f"the run ended {run.get('state')}: {run.get('error')}; log: {log_path}")
    return outcome_from_run(case, run)


def outcome_from_run(case: Case, run: dict[str, Any]) -> Outcome:
    from syncswitch import storage
    from syncswitch.layout import RunLayout

    layout = RunLayout(run["run_dir"])
    state = storage.read_json(layout.state, default={}) or {}
    decisions = state.get("decisions") or []
    summary = storage.read_json(layout.report + "/summary.json", default={}) or {}
    return Outcome(
        case,
        dag_seconds=run.get("dag_run_seconds"),
        training_span=summary.get("total_seconds", run.get("total_seconds")),
        final_accuracy=run.get("final_accuracy"),
        switches=sum(1 for d in decisions if d.get("action") in SWITCH_ACTIONS),
        decisions=len(decisions),
        segments=" ".join(
            f"{p['protocol'].upper()}{'*' if p.get('origin') == 'online' else ''}"
            for p in state.get("plan") or []
        ),
    )


def stop_airflow(airflow_home: str, work_dir: str) -> None:
    log_path = os.path.join(work_dir, "stop-ui.log")
    argv = syncswitch_command("run", "--stop-ui", "--airflow-home", airflow_home)
    code, _stdout, _wall = run_command(argv, log_path, timeout=300.0)
    if code != 0:
        log(f"stopping the embedded Airflow failed (exit {code}):\n{tail(log_path)}")


# ---- the report ------------------------------------------------------------------------------------


def no_policy_seconds(outcomes: list[Outcome]) -> float | None:
    return next((o.dag_seconds for o in outcomes if o.case.policy == "none" and o.case.straggler), None)


def results_table(outcomes: list[Outcome]) -> str:
    base = no_policy_seconds(outcomes)
    rows = []
    for o in outcomes:
        speedup = base / o.dag_seconds if base and o.dag_seconds and o.case.straggler else None
        rows.append(
            [
                o.case.name,
                fmt(o.dag_seconds, 1) if not o.error else "failed",
                fmt(speedup, 2),
                fmt(o.training_span, 1),
                fmt(o.final_accuracy, 4),
                fmt(o.switches),
                fmt(o.decisions),
                o.segments or "-",
                fmt(o.load_at_start, 1),
            ]
        )
    headers = [
        "case",
        "time (s)",
        "speed-up vs no policy",
        "segments span (s)",
        "final accuracy",
        "switches",
        "decisions",
        "plan (* = online)",
        "load 1m",
    ]
    return markdown_table(headers, rows)


def goal_lines(outcomes: list[Outcome]) -> list[str]:
    base = no_policy_seconds(outcomes)
    lines = []
    for o in outcomes:
        if o.error or o.dag_seconds is None:
            continue
        if o.case.straggler and o.case.policy != "none" and base:
            speedup = base / o.dag_seconds
            verdict = "met" if speedup >= SPEEDUP_GOAL else "NOT met"
            lines.append(f"goal >= {SPEEDUP_GOAL}x vs no policy: {o.case.name}: {speedup:.2f}x ({verdict})")
        if not o.case.straggler and o.case.policy != "none":
            verdict = "met" if o.switches == 0 else "NOT met"
            lines.append(
                f"goal 0 false switches without a straggler: {o.case.name}: {o.switches} ({verdict})"
            )
    return lines


def print_report(
    outcomes: list[Outcome], job_flags: list[str], args: argparse.Namespace, machine: str
) -> None:
    print("# bench_policies: the same job, online policies under a transient straggler")
    print(f"machine: {machine}")
    print(f"job flags: {' '.join(job_flags) or '(defaults)'}; straggler: {args.straggler}")
    print()
    print(results_table(outcomes))
    print()
    for line in goal_lines(outcomes):
        print(line)
    for o in outcomes:
        if o.error:
            print(f"{o.case.name} failed: {o.error.splitlines()[0]}")


# ---- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Arguments after -- are `syncswitch run` flags added after the default job flags "
        f"({' '.join(DEFAULT_JOB_FLAGS)}); a later flag wins.",
    )
    p.add_argument("--straggler", help="the transient straggler (syncswitch run form)")
    p.add_argument("--reference", action="store_true", help="also run: no policy, no straggler")
    p.add_argument("--policies", nargs="+", default=["none", "greedy", "elastic"], help="which to run")
    p.add_argument("--testbed", action="store_true", help="hosts backend on a testbed, network straggler")
    add_airflow_home_argument(p)
    p.add_argument("--keep", action="store_true", help="keep the run folders and logs")
    own, extra = split_passthrough(argv)
    args = p.parse_args(own)
    args.straggler = args.straggler or (TESTBED_STRAGGLER if args.testbed else DEFAULT_STRAGGLER)
    return args, [*(TESTBED_JOB_FLAGS if args.testbed else DEFAULT_JOB_FLAGS), *extra]


@contextlib.contextmanager
def testbed_cluster() -> Iterator[list[str]]:
    """A 5-host testbed and a GCS emulator on its gateway (this process's storage, and what the
    embedded Airflow started below inherits); yields the `syncswitch run` flags of that cluster."""
    import testbed as tb
    from gcs_emulator import GcsEmulator, free_port
    from syncswitch import storage
    from syncswitch_airflow.settings import setting

    reason = tb.ensure_prerequisites()
    if reason:
        raise BenchError(f"--testbed needs the testbed: {reason}")
    bed = tb.Testbed(f"bp{os.getpid() % 10000}", len(TESTBED_ROLES))
    hosts = bed.up()
    gcs_root = Path(tempfile.mkdtemp(prefix="bench-policies-gcs-"))
    gcs = GcsEmulator(gcs_root, free_port(), host=bed.gateway)
    gcs.start()
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
    os.environ[setting("ssh_known_hosts").env] = bed.known_hosts_path
    try:
        bucket = f"bench-policies-{uuid.uuid4().hex[:8]}"
        storage.gcs_client().create_bucket(bucket)
        flags = ["--cluster-backend", "hosts", "--bucket-dir", f"gs://{bucket}/runs"]
        for host, role in zip(hosts, TESTBED_ROLES, strict=True):
            flags += ["--host", f"address={host.address},key={bed.key_path},role={role},name={host.name}"]
        yield flags
    finally:
        gcs.stop()
        bed.down()
        shutil.rmtree(gcs_root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args, job_flags = parse_args(argv)
    machine = machine_line()
    work_dir = tempfile.mkdtemp(prefix="bench-policies-")
    outcomes: list[Outcome] = []
    failed = False
    with contextlib.ExitStack() as stack:
        if args.testbed:
            job_flags = [*job_flags, *stack.enter_context(testbed_cluster())]
        failed = run_cases(args, job_flags, work_dir, outcomes)
    print_report(outcomes, job_flags, args, machine)
    return 1 if failed else 0


def run_cases(args: argparse.Namespace, job_flags: list[str], work_dir: str, outcomes: list[Outcome]) -> bool:
    """Every chosen case, one after the other on one embedded Airflow; True if any failed."""
    failed = False
    try:
        for case in cases(args.reference, args.policies):
            load = load_1m()
            log(f"{case.name}: starting (load {load:.1f})")
            try:
                outcome = run_case(case, args, job_flags, work_dir)
            except BenchError as exc:
                failed = True
                log(f"{case.name}: FAILED: {exc}")
                outcome = Outcome(case, error=str(exc))
            outcome.load_at_start = load
            outcomes.append(outcome)
            if not outcome.error:
                log(f"{case.name}: {outcome.dag_seconds:.0f}s, {outcome.switches} switches")
    finally:
        stop_airflow(args.airflow_home, work_dir)
        if args.keep or failed:
            log(f"run folders and logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
