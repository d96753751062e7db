"""The runtime's locked versions: what every cluster node must run, and a check that it does.

``requirements.txt`` beside this file is ``uv export --package syncswitch`` of the workspace's lock,
then the pins of a GPU node as ``#gpu:`` comment lines (the lock's ``gpu`` group; regenerated with
``cd testing && uv run python -m wheels``, and tests/test_packages.py fails when it drifts). It travels in
the runtime's wheel. The gce backend installs it on its VMs (the startup script); the hosts backend
checks every host against it before it starts a fork server there, because workers that run other
TensorFlow or Keras versions than the chief do not load each other's checkpoints reliably.

    python -m syncswitch.requirements --check     # exit 1 and one line per mismatch; 0 when all match
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata, resources

REQUIREMENTS_FILE = "requirements.txt"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncswitch.requirements", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare this interpreter with the lock")
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
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
