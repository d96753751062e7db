"""The runtime's locked versions: what every cluster node must run, and a check that it does.

``requirements.txt`` beside this file is ``uv export --package syncswitch`` of the workspace's lock,
then the pins of a GPU node as ``#gpu:`` comment lines (the lock's ``gpu`` group; regenerated with
``cd testing && uv run python -m wheels``, and tests/test_packages.py fails when it drifts). It travels in
the runtime's wheel. The gce backend installs it on its VMs (the startup script); the hosts backend
checks every host against it before it starts a fork server there, because workers that run other
TensorFlow or Keras versions than the chief do not load each other's checkpoints reliably.

A user model's own list (a folder usr_dir's ``requirements.txt``, docs/bring-your-own-model.md) is
checked here too: ``listed`` reads it (one requirement a line, no pip options), ``unmet`` says which
of its requirements this interpreter does not satisfy.

    python -m syncswitch.requirements --check     # exit 1 and one line per mismatch; 0 when all match
    python -m syncswitch.requirements --check --user-requirements FILE   # and FILE's (- for stdin)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata, resources
from typing import TYPE_CHECKING

from syncswitch.errors import SpecError

if TYPE_CHECKING:  # imported where a list is read: the lock's check runs on an interpreter without it
    from packaging.requirements import Requirement

REQUIREMENTS_FILE = "requirements.txt"
USER_FIELD = "usr_dir"  # the job field a user model's list is named by (the file is in that folder)
# Distributions that stand in for a pin at the same version: a GPU node installs TensorFlow's CUDA
# build where the lock has the CPU one (``tensorflow`` and its CUDA libraries: the file's ``#gpu:``
# lines, which node_install.py installs in tensorflow-cpu's place).
STAND_INS = {"tensorflow-cpu": ("tensorflow",)}


def requirements_text() -> str:
    return resources.files("syncswitch").joinpath(REQUIREMENTS_FILE).read_text(encoding="utf-8")


def locked_versions() -> list[tuple[str, str, bool]]:
    """(distribution, version, conditional) per pin; conditional pins carry an environment marker
    (e.g. ``; sys_platform == 'win32'``) and may rightly be absent."""
    pins = []
    for line in requirements_text().splitlines():
        requirement, _, marker = line.partition(";")
        name, sep, version = requirement.strip().partition("==")
        if sep and not name.startswith(("#", "-")):
            pins.append((name.strip(), version.strip(), bool(marker.strip())))
    return pins


def mismatches(version_of: Callable[[str], str] = metadata.version) -> list[str]:
    """One line per pin this interpreter does not satisfy: another version, or missing."""
    found = []
    for name, wanted, conditional in locked_versions():
        installed = _installed(name, version_of)
        if installed is None:
            if not conditional:
                found.append(f"{name}: missing (the lock has {wanted})")
            continue
        if installed != wanted:
            found.append(f"{name}: {installed} installed, the lock has {wanted}")
    return found


def _installed(name: str, version_of: Callable[[str], str]) -> str | None:
    """The installed version of ``name``, or of the first of its stand-ins that is installed."""
    for candidate in (name, *STAND_INS.get(name, ())):
        try:
            return version_of(candidate)
        except metadata.PackageNotFoundError:
            continue
    return None


# ---- a user model's list -------------------------------------------------------------------------


def listed(text: str, source: str = REQUIREMENTS_FILE) -> list[Requirement]:
    """The requirements of a user model's list, one a line (blank lines and ``#`` comments skipped).
    Anything else is a SpecError naming the line: pip options (``-r``, ``--index-url``, ``-e``) too,
    since every node installs from the list alone and the index is the deployment's."""
    from packaging.requirements import InvalidRequirement, Requirement

    found = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number}"
        if line.startswith("-"):
            raise SpecError(USER_FIELD, f"{where}: {line!r} is a pip option; list one requirement a line")
        try:
            found.append(Requirement(line))
        except InvalidRequirement as exc:
            raise SpecError(USER_FIELD, f"{where}: {line!r} is not a requirement ({exc})") from None
    return found


def unmet(
    requirements: list[Requirement],
    source: str = REQUIREMENTS_FILE,
    version_of: Callable[[str], str] = metadata.version,
) -> list[str]:
    """One line per requirement that this interpreter does not satisfy: missing, or a version outside
    its specifier. A requirement whose marker excludes this interpreter is met."""
    found = []
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version_of(requirement.name)
        except metadata.PackageNotFoundError:
            found.append(f"{requirement.name}: missing ({source} asks {requirement})")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            found.append(f"{requirement.name}: {installed} installed, {source} asks {requirement}")
    return found


def _read_list(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncswitch.requirements", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare this interpreter with the lock")
    parser.add_argument(
        "--user-requirements",
        default="",
        metavar="FILE",
        help="with --check, a user model's requirements.txt too (- reads it from stdin)",
    )
    args = parser.parse_args(argv)
    if not args.check:
        print(requirements_text(), end="")
        return 0
    problems = mismatches()
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        # Last, so that a caller who keeps only the tail of the output still reads it.
        print(
            f"{len(problems)} of the lock's {len(locked_versions())} versions differ here; install them "
            "with: python -m syncswitch.requirements > r.txt && pip install -r r.txt",
            file=sys.stderr,
        )
    return 1 if _check_user_list(args.user_requirements) or problems else 0


def _check_user_list(path: str) -> list[str]:
    """The unmet requirements of the user model's list at ``path`` ("" for none), printed."""
    if not path:
        return []
    source = f"the user code's {REQUIREMENTS_FILE}"
    try:
        requirements = listed(_read_list(path), source)
    except (SpecError, ImportError) as err:  # ImportError: no packaging here, a pin the lock's check names
        print(f"{source} cannot be checked: {err}", file=sys.stderr)
        return [str(err)]
    missing = unmet(requirements, source)
    for line in missing:
        print(line, file=sys.stderr)
    if missing:
        print(
            f"{len(missing)} of the user code's {len(requirements)} requirements are not met here: install "
            "them on every host, or have the hosts backend install them ([syncswitch] hosts_runtime = "
            "install)",
            file=sys.stderr,
        )
    return missing


if __name__ == "__main__":
    sys.exit(main())
