"""The checks of a segment that can fail on user input, run before any of its processes is forked.

    preflight(spec, cache_dir)         every check, in this process; returns the staged data folder
    imports_user_code(spec)            whether that imports code beyond the runtime's own
    warm_preflight(spec, ...)          the same in a child of the cluster's fork server, which has
                                       TensorFlow imported already; main() is that child's program

Errors name the field (ValueError subclasses), so that a launcher reports bad input in one line.
"""

from __future__ import annotations

import os

from syncswitch import checkpoints, forkserver_client, registry, storage
from syncswitch.errors import SegmentFailed
from syncswitch.layout import RunLayout
from syncswitch.spec import SegmentSpec


def preflight(spec: SegmentSpec, cache_dir: str) -> str:
    """Validate everything user-supplied and stage the data; returns the local data folder.

    Raises ValueError subclasses whose message names the field (HParamsError, ProblemError,
    SpecError, CheckpointMismatchError).
    """
    from syncswitch import usercode
    from syncswitch.hooks import load_hooks
    from syncswitch.problems import get_problem

    usercode.activate(spec, cache_dir)
    load_hooks(spec.hooks)  # each registered and a hook: SpecError naming the field, before any fork
    hp = spec.resolved_hparams()
    problem = get_problem(spec.problem)
    local_data = problem.prepare(spec.data_dir, cache_dir)
    checkpoints.check_compatible(
        checkpoints.latest(RunLayout(spec.run_dir)), checkpoints.signature(hp, problem)
    )
    return local_data


def imports_user_code(spec: SegmentSpec) -> bool:
    """Whether the preflight imports code beyond the runtime's own (a usr_dir, or an installed
    package's entry point). That code imports TensorFlow, which a launcher should not pay for at every
    segment where a fork server has it imported already (warm_preflight)."""
    builtin = registry.BUILTIN_ENTRIES
    return bool(spec.usr_dir or spec.hooks) or not (
        spec.model in builtin["model"]
        and spec.problem in builtin["problem"]
        and spec.hparam_set in builtin["hparams"]
    )


def warm_preflight(
    spec: SegmentSpec, cache_dir: str, server: forkserver_client.ServerRef, work_dir: str
) -> str:
    """The preflight in a child of the cluster's fork server on this host, where TensorFlow is
    imported already; its outcome comes back through a file. Raises what preflight raises (as a
    PreflightError with the same message), SegmentFailed if the child died without an answer."""
    request_dir = os.path.join(work_dir, "preflight")
    spec_path, result_path = os.path.join(request_dir, "spec.json"), os.path.join(request_dir, "result.json")
    log_path = os.path.join(request_dir, "preflight.log")
    storage.delete(result_path)
    child = forkserver_client.fork_node(
        server,
        [spec_path, cache_dir, result_path],
        env=dict(os.environ),  # as the local nodes get it: the launcher's whole environment
        log=log_path,
        name="preflight",
        files={spec_path: spec.to_json()},
        program="preflight",
    )
    code = child.wait()
    outcome = storage.read_json(result_path, default=None)
    if outcome is None:
        raise SegmentFailed(f"the preflight exited with {code} without an answer; see {log_path}")
    if "error" in outcome:
        raise PreflightError(outcome["error"])
    return str(outcome["data_dir"])


class PreflightError(ValueError):
    """Bad input found by a preflight in another process: its message names the field."""


def main(argv: list[str]) -> int:
    """``program: preflight`` of the fork server: ``[spec.json, cache_dir, result.json]``. Writes
    ``{"data_dir"}``, or ``{"error"}`` for bad input (anything else is a crash, in the log)."""
    spec_path, cache_dir, result_path = argv
    spec = SegmentSpec.from_dict(storage.read_json(spec_path))
    try:
        data_dir = preflight(spec, cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        storage.write_json(result_path, {"error": str(exc)})
        return 1
    storage.write_json(result_path, {"data_dir": data_dir})
    return 0
