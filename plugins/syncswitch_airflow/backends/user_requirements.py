"""A user model's ``requirements.txt`` on the Airflow side: checked before anything is provisioned,
and the exact versions every node then installs.

The list is a package folder usr_dir's ``requirements.txt`` (``syncswitch.usercode.requirements_path``).
What becomes of it depends on who makes the nodes' environment:

    cluster_backend     validate                                    the nodes
    local               each requirement met in this environment    this environment (the worker's)
    hosts, install      resolved against the runtime's pins         the resolved list in the runtime's
                                                                    venv (its id covers the list)
    hosts, installed    its lines read                              each host checked at provisioning,
                                                                    what it lacks named
    gce                 resolved against the runtime's pins         the resolved list, installed by the
                                                                    VMs' startup script

Resolving is ``uv pip compile`` (the provider's own uv) of the list with the runtime's pins as
constraints, for the nodes' Python and platform. It reads uv's settings from the environment
(``UV_INDEX_URL``, ``UV_OFFLINE``, ``UV_CACHE_DIR``), so a deployment without a route to an index
resolves against its warm cache. Its output pins every package, and that is what the nodes install:
every node gets the same versions, whenever it installs. It starts with the list as written, in
comments, so that a changed list is another environment (its id) even where it resolves alike.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

from syncswitch import usercode
from syncswitch.errors import SpecError
from syncswitch.requirements import USER_FIELD, listed, requirements_text, unmet

from syncswitch_airflow.backends.node_install import PYTHON_VERSION
from syncswitch_airflow.backends.node_runtime import hosts_install_runtime

# The nodes' interpreter and platform: the lock's Python on x86-64 Linux (TensorFlow's CPU wheels).
NODE_PLATFORM = "x86_64-manylinux_2_28"
RESOLVE_TIMEOUT_S = 300.0  # an index far away, and sdists whose metadata must be built
INSTALLING_BACKENDS = ("gce",)  # besides hosts with [syncswitch] hosts_runtime = install


def installs_on_nodes(cluster_backend: str) -> bool:
    """Whether the backend installs the job's environment on its nodes (then the list is resolved)."""
    if cluster_backend == "hosts":
        return hosts_install_runtime()
    return cluster_backend in INSTALLING_BACKENDS


def check_for_validate(job: Any) -> str:  # noqa: ANN401 - a syncswitch.spec.JobSpec
    """The validate task's check of the job's list (the module's table); SpecError naming the file and
    the requirement when it fails. Returns a line for the task's log ("" without a list)."""
    path = usercode.requirements_path(job.usr_dir)
    text = usercode.requirements_text(job.usr_dir)
    requirements = listed(text, path)
    if not requirements:
        return ""
    if job.cluster_backend == "local":
        missing = unmet(requirements, path)
        if missing:
            raise SpecError(
                USER_FIELD,
                f"{'; '.join(missing)}: the local backend trains in this environment, install them here",
            )
        return f"{path}: {len(requirements)} requirement(s), met here"
    counted = f"{path}: {len(requirements)} requirement(s)"
    if job.cluster_backend == "hosts" and not installs_on_nodes("hosts"):
        return f"{counted}, checked on each host at provisioning"
    if not installs_on_nodes(job.cluster_backend):
        return f"{counted}; backend {job.cluster_backend!r} installs nothing: its nodes must have them"
    pins = [line for line in resolve(text, path).splitlines() if line and not line.startswith("#")]
    return f"{counted}, resolved to {len(pins)} pins"


def node_requirements(job: Any, install: bool) -> str:  # noqa: ANN401 - a syncswitch.spec.JobSpec
    """What the cluster carries for its nodes: the list resolved when the backend installs it
    (``install``), else the list as written, which each host is checked against ("" for none)."""
    path = usercode.requirements_path(job.usr_dir)
    text = usercode.requirements_text(job.usr_dir)
    if not listed(text, path):
        return ""
    return resolve(text, path) if install else text


def resolve(text: str, source: str) -> str:
    """The list with every package it brings pinned, resolved with the runtime's pins as constraints.
    A list that cannot be resolved is a SpecError naming ``source`` and the requirements that fail
    alone (or, where none does, the list as a whole), with the resolver's reason."""
    requirements = listed(text, source)
    done = _compile([str(r) for r in requirements])
    if done.returncode == 0:
        heading = f"# {os.path.basename(source)} as listed, resolved with the runtime's pins:\n"
        return heading + "".join(f"#   {r}\n" for r in requirements) + done.stdout
    failing = [str(r) for r in requirements if _compile([str(r)]).returncode != 0]
    what = ", ".join(repr(r) for r in failing) if failing else "its requirements, taken together,"
    raise SpecError(
        USER_FIELD,
        f"{source}: {what} cannot be installed with the runtime's pinned versions: {_reason(done.stderr)}",
    )


def _compile(requirements: list[str]) -> subprocess.CompletedProcess[str]:
    """``uv pip compile`` of ``requirements`` against the runtime's pins, for the nodes."""
    from uv import find_uv_bin

    with tempfile.TemporaryDirectory(prefix="syncswitch-requirements-") as folder:
        listed_file, pins_file = os.path.join(folder, "user.txt"), os.path.join(folder, "pins.txt")
        with open(listed_file, "w", encoding="utf-8") as f:
            f.write("".join(f"{line}\n" for line in requirements))
        with open(pins_file, "w", encoding="utf-8") as f:
            f.write(requirements_text())
        command = [
            find_uv_bin(),
            "pip",
            "compile",
            "--quiet",
            "--no-header",
            "--no-annotate",
            "--python-version",
            PYTHON_VERSION,
            "--python-platform",
            NODE_PLATFORM,
            "--constraints",
            pins_file,
            listed_file,
        ]
        try:
            return subprocess.run(
                command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S, cwd=folder, check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"resolving a user model's requirements took over {RESOLVE_TIMEOUT_S:.0f} s: is the "
                "package index reachable from this Airflow worker (UV_INDEX_URL, UV_OFFLINE)?"
            ) from None


def _reason(stderr: str) -> str:
    """uv's explanation on one line: its cause and hints, without its own headings."""
    lines = [line.strip().lstrip("×╰─▶│ ") for line in stderr.splitlines() if line.strip()]
    kept = [line.removeprefix("cause:").strip() for line in lines if not line.startswith("error:")]
    return " ".join(kept or lines)[-1200:]
