"""One process of a segment's TF cluster. Reads its role from TF_CONFIG, so the same code runs on
localhost (started by syncswitch.launcher) and on separate hosts (started by a node agent/image).

Roles, by the protocol's topology (syncswitch.protocols):
    all-reduce (BSP, compressed BSP, local SGD): worker i (worker 0 is the chief)
                                           -> MultiWorkerMirroredStrategy: bsp.py, or local_sgd.py
    parameter server (ASP, SSP): chief     -> ParameterServerStrategy coordinator loop (asp.py)
         worker i, ps i                    -> a tf.distribute.Server that runs what it is sent
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from typing import NoReturn

from syncswitch import peers
from syncswitch.layout import RunLayout
from syncswitch.protocols import ALLREDUCE
from syncswitch.spec import SegmentSpec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m syncswitch.node")
    parser.add_argument("--spec", required=True, help="SegmentSpec JSON file")
    parser.add_argument("--work-dir", required=True, help="local scratch folder of this segment")
    parser.add_argument("--data-dir", default="", help="local data folder prepared by the launcher")
    parser.add_argument(
        "--stage-data", action="store_true", help="on another host than the launcher: stage the data here"
    )
    parser.add_argument(
        "--data-cache", default="", help="with --stage-data: the host's cache, kept across segments"
    )
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--inter-op-threads", type=int, default=2)
    return parser.parse_args(argv)


def use_segment_temp_dir(work_dir: str) -> str:
    """Make the segment's work folder this process's temp folder. Autograph writes a module file per
    converted function there (and the gs:// event writer its buffers) and removes them only at a
    normal interpreter exit, which a node never has (it ends with os._exit, or killed): in the
    system's temp folder they would pile up with every process start. The work folder goes with the
    cluster's teardown."""
    path = os.path.join(work_dir, "tmp")
    os.makedirs(path, exist_ok=True)
    tempfile.tempdir = path
    return path


def main(argv: list[str] | None = None) -> int:
    # A crash inside TensorFlow's C++ (a fatal signal such as SIGSEGV) otherwise leaves nothing in the
    # node's log: this writes every thread's Python stack there first.
    faulthandler.enable()
    args = parse_args(argv)
    timings = {"launch": float(os.environ.get("SYNCSWITCH_LAUNCH_TIME", time.time()))}
    tf_config = json.loads(os.environ["TF_CONFIG"])
    role, task = tf_config["task"]["type"], int(tf_config["task"]["index"])
    with open(args.spec, encoding="utf-8") as f:
        spec = SegmentSpec.from_dict(json.load(f))
    use_segment_temp_dir(args.work_dir)
    # The log's first line says whose it is: a log read far from its host (the run folder's
    # logs/, a failure's last lines) names its node and segment.
    print(f"{role} {task} of segment {spec.index} ({spec.protocol}), pid {os.getpid()}", flush=True)

    import tensorflow as tf

    # Several TF processes share few cores: one intra-op thread each avoids oversubscription
    # (stack-findings.md).
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    timings["imported"] = time.time()

    allreduce = spec.segment_protocol.topology == ALLREDUCE
    if role == "ps" or (role == "worker" and not allreduce):
        run_server(tf, tf_config, role, task, args.intra_op_threads, args.inter_op_threads)
        return 0

    from syncswitch import usercode
    from syncswitch.asp import run_asp_chief
    from syncswitch.bsp import run_bsp_worker
    from syncswitch.local_sgd import run_local_sgd_worker
    from syncswitch.problems import get_problem

    # The job's user code (on other hosts, the copy shipped through the bucket), before any lookup.
    user_code = usercode.activate(spec, args.work_dir)
    problem = get_problem(spec.problem)
    data_dir = args.data_dir
    if args.stage_data:
        # A BSP worker on a host of its own reads only its shard: it stages no more than that.
        cache = args.data_cache or os.path.join(args.work_dir, "data")
        data_dir = problem.prepare_shard(spec.data_dir, cache, task, spec.num_workers)
    from syncswitch.context import NodeContext

    ctx = NodeContext(
        spec=spec,
        role=role,
        task=task,
        work_dir=args.work_dir,
        data_dir=data_dir,
        layout=RunLayout(spec.run_dir),
        hp=spec.resolved_hparams(),
        timings=timings,
        user_code=user_code,
    )
    loops = {"local": run_local_sgd_worker, "asp": run_asp_chief, "ssp": run_asp_chief}
    result = loops.get(spec.protocol, run_bsp_worker)(ctx, problem)
    if result is not None:
        print(json.dumps(result), flush=True)
    if allreduce and task != 0:
        # This worker's last all-reduce can end before the chief has fetched this worker's share of
        # it (each chunk is pulled from its owner's server): exiting at once would close that fetch's
        # socket and fail the chief at the segment's end ("Collective ops is aborted by: Socket
        # closed"). So a worker stays until the chief, whose server is up until it exits, is gone.
        peers.wait_until_gone(tf_config["cluster"]["worker"][0])
    # Exit from here, while ctx still holds the segment's strategy, iterators and coordinator
    # (ctx.finished_objects): returning would destroy them, and their destructors wait on peers that
    # have exited (MultiWorkerMirroredStrategy's collectives until the coordination service's
    # heartbeat timeout), a wait in the switch gap.
    exit_now(0)


def run_server(
    tf,  # noqa: ANN001 - the tf module
    tf_config: dict,
    role: str,
    task: int,
    intra_op_threads: int,
    inter_op_threads: int,
) -> None:
    """An ASP worker or parameter server: serves the coordinator until the launcher stops it.

    The server sizes its own thread pools from its ConfigProto, not from tf.config.threading. Left at
    0 they follow the CPUs the process may use: one when pinned to a core, and a worker running a
    step function needs at least two inter-op threads (one waits on a transfer the other serves),
    so it gets two, pinned or not: with one, it deadlocks before its first step.
    """
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra_op_threads,
        inter_op_parallelism_threads=max(inter_op_threads, 2),
    )
    server = tf.distribute.Server(
        tf.train.ClusterSpec(tf_config["cluster"]),
        job_name=role,
        task_index=task,
        protocol="grpc",
        config=config,
        start=True,
    )
    print(f"{role} {task} serving at {server.target}", flush=True)
    server.join()


def exit_now(code: int) -> NoReturn:
    """Exit without tearing down TensorFlow (distributed iterators, collectives, servers): the
    segment's results are written by now, and that teardown takes seconds or hangs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
