"""The `syncswitch` command.

    syncswitch train ...   run one segment on a local process cluster (this module; no Airflow needed)
    syncswitch check ...   check a job's model, problem and hparams (user code too) on one batch
    syncswitch registry    the registered models, problems and hparam sets, and where each comes from
    syncswitch run ...     run a whole sync_switch DAG run on an embedded Airflow
    syncswitch sweep ...   run a sweep file's configurations and compare them
    syncswitch history ... a recurring job's history and timing search state
    syncswitch policy ...  the offline timing policy's next decision from a .jsonl history
(run, sweep, history and policy come with the Airflow provider: syncswitch_airflow.tools)

`train` prints progress on stderr and, as the last line of stdout, one JSON object with the result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
from typing import Any

from syncswitch import plan as plans
from syncswitch import storage
from syncswitch.fields import add_train_flags, params_from_flags
from syncswitch.layout import RunLayout
from syncswitch.protocols import SPELLINGS, parse_token
from syncswitch.spec import JobSpec, SegmentSpec, SpecError

DEFAULT_HPARAM_SET = {"cnn": "cnn_digits", "resnet": "resnet_cifar_20"}


def build_train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syncswitch train",
        description="Run one training segment (BSP, ASP, SSP, local SGD or compressed BSP) on a local "
        "cluster of TF processes. "
        "Rerunning with the same --run-dir and a higher --until-step continues from the "
        "latest checkpoint, in either protocol. The job's fields take this segment's one value; "
        "a straggler's start counts from the launch.",
    )
    p.add_argument("--spec", help="a SegmentSpec JSON file (the pipeline's interface); other flags ignored")
    p.add_argument(
        "--protocol",
        default="bsp",
        metavar="PROTOCOL",
        help=f"the segment's protocol, as a switch order spells one: {SPELLINGS}",
    )
    add_train_flags(p)  # the job fields a segment takes: syncswitch.fields
    p.add_argument("--run-dir", default="runs/train", help="run folder: local folder or gs:// URI")
    p.add_argument("--run-id", default="", help="default: the run folder's name")
    p.add_argument("--segment-index", type=int, help="default: the next free index in the run folder")
    p.add_argument(
        "--until-step",
        type=int,
        required=False,
        default=200,
        help="cumulative target in BSP-equivalent steps",
    )
    p.add_argument("--watchdog-seconds", type=float, default=60.0)
    p.add_argument("--eval", action="store_true", help="report test accuracy of the final checkpoint")
    p.add_argument("--work-dir", help="local scratch folder (default: a temp folder, removed at the end)")
    p.add_argument(
        "--data-cache",
        metavar="DIR",
        help="where data from a bucket is staged, reused by the next segments of the same cluster "
        "(default: in --work-dir)",
    )
    p.add_argument(
        "--forkserver",
        metavar="DIR",
        help="fork the cluster's processes from this running fork server (default: start a private one)",
    )
    p.add_argument(
        "--cluster",
        metavar="FILE",
        help="a hosts cluster's cluster.json (syncswitch.hosts.ClusterFile): fork the nodes on its hosts",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def spec_from_args(args: argparse.Namespace) -> SegmentSpec:
    if args.stall_seconds is not None and args.stall_seconds <= 0:
        raise SpecError("stall-seconds", f"must be > 0, got {args.stall_seconds}")
    spec = _spec_from_flags(args) if not args.spec else _spec_from_file(args.spec)
    if args.stall_seconds is not None:
        spec = spec.replace(stall_seconds=args.stall_seconds)
    return spec


def _spec_from_file(path: str) -> SegmentSpec:
    with open(path, encoding="utf-8") as f:
        return SegmentSpec.from_dict(json.load(f))


def _spec_from_flags(args: argparse.Namespace) -> SegmentSpec:
    """Segment ``--segment-index`` of the one-segment job the flags describe (JobSpec's defaults for
    the fields not given), built as the pipeline builds its segments (JobSpec.segment_spec)."""
    from syncswitch import usercode
    from syncswitch.registry import REGISTRY

    job = JobSpec(**JobSpec.parse_params(params_from_flags(args)))
    model = args.model or ("cnn" if job.problem == "digits" else "resnet")
    usercode.load(args.usr_dir)  # its names are registered once it is imported
    REGISTRY.entry("model", model)  # SpecError naming the field and the accepted names
    REGISTRY.entry("problem", job.problem)
    if not args.hparam_set and model not in DEFAULT_HPARAM_SET:
        raise SpecError("hparam-set", f"model {model!r} has no default hparam set; name one")
    for name, value in (("workers", job.num_workers), ("ps", job.num_ps), ("until-step", args.until_step)):
        if value < 1:
            raise SpecError(name, f"must be >= 1, got {value}")
    protocol = parse_token(args.protocol, "--protocol")
    run_dir = args.run_dir.rstrip("/")
    index = args.segment_index if args.segment_index is not None else next_segment_index(run_dir)
    job = dataclasses.replace(
        job,
        switch_order=protocol.token,
        train_steps=(args.total_steps or args.until_step,),  # the job's workload, for the LR schedule
        model=model,
        hparam_set=args.hparam_set or DEFAULT_HPARAM_SET[model],
        evaluate_segments=args.eval,
    )
    entry = {"index": index, **plans.entry_fields(protocol), "until_step": args.until_step, "plan_index": 0}
    spec = job.segment_spec(entry, args.run_id or os.path.basename(run_dir) or "run", run_dir)
    return spec.replace(watchdog_seconds=args.watchdog_seconds)


def next_segment_index(run_dir: str) -> int:
    names = storage.list_dirs(RunLayout(run_dir).metrics)
    indices = [int(n.split("-")[1]) for n in names if n.startswith("seg-") and n.split("-")[1].isdigit()]
    return max(indices, default=-1) + 1


def train_main(argv: list[str]) -> int:
    from syncswitch.errors import SegmentFailed
    from syncswitch.launcher import install_signal_handlers, run_segment

    args = build_train_parser().parse_args(argv)
    install_signal_handlers()
    started = time.time()
    try:
        spec = spec_from_args(args)
        result = run_segment(
            spec,
            args.work_dir,
            forkserver_dir=args.forkserver,
            cluster_file=args.cluster,
            data_cache=args.data_cache,
            show_progress=not args.quiet,
        )
    except KeyboardInterrupt as exc:
        print(f"syncswitch train: interrupted ({exc or 'Ctrl-C'}); the cluster was stopped", file=sys.stderr)
        return 130
    except SegmentFailed as exc:
        print(f"syncswitch train: segment failed: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, no traceback
        print(f"syncswitch train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary_line(result, time.time() - started)), flush=True)
    return 0


def summary_line(result: dict[str, Any], wall_seconds: float) -> dict[str, Any]:
    line = {
        "protocol": result["protocol"],
        "segment": result["index"],
        "start_step": result["start_step"],
        "global_step": result["end_step"],
        "updates": result["updates"],
        "examples_per_sec": result["examples_per_sec"],
        "training_seconds": result["seconds"],
        "wall_seconds": wall_seconds,
        "stopped_early": result["stopped_early"],
        "checkpoint": result["checkpoint"],
        "startup": result.get("startup", {}),
    }
    line.update({k: v for k, v in result.items() if k.startswith("test_")})
    return line


def registry_main(argv: list[str]) -> int:
    """``syncswitch registry [--usr-dir D]``: every registered name and where it comes from."""
    parser = argparse.ArgumentParser(prog="syncswitch registry")
    parser.add_argument("--usr-dir", "--t2t-usr-dir", default="")
    args = parser.parse_args(argv)
    from syncswitch import usercode
    from syncswitch.registry import REGISTRY

    try:
        usercode.load(args.usr_dir)
    except SpecError as err:
        print(f"syncswitch registry: {err}", file=sys.stderr)
        return 2
    for kind, entries in REGISTRY.sources().items():
        print(f"{kind}:")
        for name, source in entries.items():
            print(f"  {name:24s} {source}")
    return 0


def check_main(argv: list[str]) -> int:
    from syncswitch.check import main as check

    return check(argv)


# The pipeline-side commands live with the Airflow code and are imported only when used, so cluster
# nodes, which run `train` alone, never load Airflow.
PIPELINE_COMMANDS = {
    "run": "syncswitch_airflow.tools.cli:main",
    "sweep": "syncswitch_airflow.tools.sweep:main",
    "history": "syncswitch_airflow.tools.history_cli:history_main",
    "policy": "syncswitch_airflow.tools.history_cli:policy_main",
}


COMMAND_SUMMARIES = {
    "run": "run a job through the sync_switch DAG (the embedded Airflow, started if needed)",
    "sweep": "run an experiment file's configurations and repeats, resumable; compare them",
    "history": "a recurring job's runs and its switch-point search",
    "policy": "the BSP fraction a timing policy gives the next run of a history",
    "check": "check user code (--usr-dir) on one batch, as a run does before provisioning",
    "registry": "the registered models, problems and hparam sets, and where each comes from",
    "train": "run one segment on a cluster of TF processes (what a run's launcher runs)",
}


def usage() -> str:
    lines = ["usage: syncswitch <command> [options]   (syncswitch <command> --help)", "", "commands:"]
    lines += [f"  {name:10s} {summary}" for name, summary in COMMAND_SUMMARIES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr: what a command that seems
    # stuck (a `syncswitch run` following a week-long job) is doing, without stopping it.
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a stderr with no file descriptor
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    runtime = {"train": train_main, "check": check_main, "registry": registry_main}
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMAND_SUMMARIES:
        if argv:
            print(f"syncswitch: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in runtime:
        return runtime[argv[0]](argv[1:])
    module, _, function = PIPELINE_COMMANDS[argv[0]].partition(":")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        print(
            f"syncswitch {argv[0]}: needs the Airflow provider (pip install airflow-provider-syncswitch); "
            "this environment has the training runtime only",
            file=sys.stderr,
        )
        return 2
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
