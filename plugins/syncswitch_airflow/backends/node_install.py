"""Install the training runtime on a cluster node: run there, by any Python 3, with the standard library.

    python3 node_install.py VENV --requirements requirements.txt --runtime syncswitch-*.whl|gs://...
        [--user-requirements user-requirements.txt]

makes ``VENV`` a virtual environment with the lock's versions of the runtime's dependencies
(``requirements.txt``: exact pins), a user model's own requirements (``--user-requirements``: its
usr_dir's list as the Airflow side resolved it, installed with the lock's pins as constraints, so it
can add packages but never move a pin) and the runtime distribution (its wheel, under any file name;
from a bucket, it is fetched with the venv's own google-cloud-storage once the dependencies are in),
checks it against the lock and the user's list (``python -m syncswitch.requirements --check``), and
prints one JSON line:
``{"python": "VENV/bin/python", "installed": "all", "installer": "uv", "seconds": 4.2}``.

The marker it writes last records digests of the three. A later call with the same ones finds it and
returns at once (``"installed": ""``); with the same requirements and another runtime it reinstalls the
runtime's wheel only (``"installed": "runtime"``: a Compute Engine VM's fixed venv, or an image made
with this script, gets each run's runtime without reinstalling TensorFlow); with other requirements
(the lock's or the user's: a package dropped from the list must go too), or no marker (a call killed
midway), it makes the venv again. The hosts backend names ``VENV`` by all three digests, so there a
finished venv is never changed. Calls for one ``VENV`` at once (runs that share a host, hosts that
share a filesystem) take turns on a lock file.

The installer is ``uv`` where it is on PATH (fast: it links from its cache; ``UV_OFFLINE=1`` for a host
without a route to the registry), else the venv's ``pip``. Both install exactly the pins; neither
resolves anything else. On a GPU node (``nvidia-smi`` on PATH) TensorFlow's CUDA build and its CUDA
libraries take the CPU build's place, at the lock's versions too: ``requirements.txt`` carries them as
comment lines (``#gpu: name==version``), which every other installer skips.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

MARKER = ".syncswitch-runtime"
GPU_PREFIX = "#gpu: "  # a pin a GPU node installs in place of tensorflow-cpu's
PYTHON_VERSION = "3.11"  # the lowest the lock covers, and the one the suite runs: nodes run what was tested


def run(command: list[str]) -> None:
    """Run a step; on failure, exit with its output's tail (the caller shows it, naming the host)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        sys.exit(f"{command[0]} {' '.join(command[1:3])} ... failed (exit {done.returncode}):\n{tail}")


def make_venv(venv: str, uv: str | None) -> str:
    """A venv of the lock's Python: this interpreter's where it is that version; else uv finds (or
    downloads) one; without uv another version is refused, naming both."""
    python = os.path.join(venv, "bin", "python")
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    if uv:
        run(
            [
                uv,
                "venv",
                "--quiet",
                "--python",
                sys.executable if this == PYTHON_VERSION else PYTHON_VERSION,
                venv,
            ]
        )
    elif this != PYTHON_VERSION:
        sys.exit(
            f"{sys.executable} is Python {this}; nodes run the runtime on Python {PYTHON_VERSION}: "
            f"name a Python {PYTHON_VERSION} interpreter (python=), or put uv on PATH"
        )
    else:  # Debian's python3 needs its python3-venv package for this
        run([sys.executable, "-m", "venv", venv])
    return python


def gpu_pins(requirements_text: str) -> str:
    """The pins of a GPU node: tensorflow-cpu's line gives way to the ``#gpu:`` lines (TensorFlow's
    CUDA build, which the runtime's version check accepts in its place, and its CUDA libraries)."""
    lines = requirements_text.splitlines()
    gpu = [line.removeprefix(GPU_PREFIX) for line in lines if line.startswith(GPU_PREFIX)]
    if not gpu:
        sys.exit(f"the requirements have no {GPU_PREFIX.strip()} lines: no locked CUDA build to install")
    kept = [line for line in lines if not line.startswith(("tensorflow-cpu==", GPU_PREFIX))]
    return "\n".join(kept + gpu) + "\n"


def node_pins(requirements: str) -> str:
    """The pins this node installs: the file as it is, or on a GPU node its GPU pins beside it."""
    if not shutil.which("nvidia-smi"):
        return requirements
    with open(requirements) as f:
        pins = gpu_pins(f.read())
    with open(requirements + ".gpu", "w") as f:
        f.write(pins)
    return requirements + ".gpu"


def install(python: str, requirements: str, uv: str | None, constraints: str = "") -> None:
    """``requirements`` into the venv; with ``constraints``, no package moves off its version there."""
    pinned = ["-c", constraints] if constraints else []
    if uv:
        run([uv, "pip", "install", "--quiet", "--python", python, "-r", requirements, *pinned])
    else:
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        run([*pip, "-r", requirements, *pinned])


def install_runtime(python: str, wheel: str, uv: str | None) -> None:
    """The runtime's wheel into the venv without its dependencies (the pins are in), replacing the
    one there even at the same version (another build of it)."""
    # No cache: another build of the runtime has the same file name.
    if uv:
        options = ["--no-deps", "--reinstall", "--no-cache"]
        run([uv, "pip", "install", "--quiet", "--python", python, *options, wheel])
    else:
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        run([*pip, "--no-deps", "--force-reinstall", "--no-cache-dir", wheel])


def wheel_named(path: str, into: str) -> str:
    """``path`` under its wheel's own file name (installers require ``name-version-tags.whl``; the
    bucket keeps it under a fixed one), read from the ``.dist-info`` folder inside it."""
    try:
        with zipfile.ZipFile(path) as wheel:
            infos = {
                n.split("/", 1)[0] for n in wheel.namelist() if n.split("/", 1)[0].endswith(".dist-info")
            }
    except (OSError, zipfile.BadZipFile) as exc:
        sys.exit(f"{path}: not a wheel ({exc})")
    if len(infos) != 1:
        sys.exit(f"{path}: not a wheel (no single .dist-info folder: {sorted(infos)})")
    name = infos.pop().removesuffix(".dist-info") + "-py3-none-any.whl"
    if os.path.basename(path) == name:
        return path
    named = os.path.join(into, name)
    shutil.copyfile(path, named)
    return named


def fetch_runtime(python: str, uri: str, into: str) -> str:
    """A ``gs://`` runtime as a local file, through the venv's google-cloud-storage (the node's
    credentials); a local path as it is."""
    if not uri.startswith("gs://"):
        return uri
    path = os.path.join(into, "syncswitch-runtime.whl")
    download = (
        "import sys; from google.cloud import storage; "
        "bucket, _, key = sys.argv[1].removeprefix('gs://').partition('/'); "
        "storage.Client().bucket(bucket).blob(key).download_to_filename(sys.argv[2])"
    )
    run([python, "-c", download, uri, path])
    return path


def refuse_to_replace(venv: str) -> None:
    """Only a virtualenv (or nothing, or an empty folder) is ever replaced: a misnamed ``VENV``
    (a system prefix such as /usr) must fail, not be deleted."""
    if not os.path.lexists(venv) or (os.path.isdir(venv) and not os.listdir(venv)):
        return
    if not os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        sys.exit(f"{venv} exists and is not a virtualenv: refusing to replace it")


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def wanted_digests(requirements: str, user_requirements: str) -> dict[str, str]:
    """What the marker must hold for the venv's dependencies to be these: the lock's pins, and the
    user's list where there is one (absent without one, so a venv made without a list still fits)."""
    wanted = {"requirements": digest(requirements)}
    if user_requirements:
        wanted["user_requirements"] = digest(user_requirements)
    return wanted


def read_marker(venv: str) -> dict[str, str]:
    try:
        with open(os.path.join(venv, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("venv")
    parser.add_argument("--requirements", required=True)
    parser.add_argument(
        "--runtime", required=True, help="the syncswitch wheel (any file name), or its gs:// URI"
    )
    parser.add_argument(
        "--user-requirements", default="", help="a user model's requirements, installed beside the pins"
    )
    args = parser.parse_args(argv)
    venv = os.path.abspath(args.venv)
    python = os.path.join(venv, "bin", "python")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    started, uv = time.monotonic(), shutil.which("uv")
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = read_marker(venv)
        wanted = wanted_digests(args.requirements, args.user_requirements)
        installed = "runtime"
        if {key: value for key, value in marker.items() if key != "runtime"} != wanted:
            installed = "all"
            refuse_to_replace(venv)
            shutil.rmtree(venv, ignore_errors=True)  # another version's, or a half-made one
            make_venv(venv, uv)
            pins = node_pins(args.requirements)
            install(python, pins, uv)
            if args.user_requirements:
                install(python, args.user_requirements, uv, constraints=pins)
        staging = os.path.dirname(os.path.abspath(args.requirements))
        wheel = fetch_runtime(python, args.runtime, staging)
        wanted["runtime"] = digest(wheel)
        if marker == wanted:
            print(json.dumps({"python": python, "installed": ""}))
            return 0
        install_runtime(python, wheel_named(wheel, staging), uv)
        check = [python, "-m", "syncswitch.requirements", "--check"]
        run(check + (["--user-requirements", args.user_requirements] if args.user_requirements else []))
        with open(os.path.join(venv, MARKER), "w") as f:
            json.dump(wanted, f)
    seconds = round(time.monotonic() - started, 1)
    installer = "uv" if uv else "pip"
    print(json.dumps({"python": python, "installed": installed, "installer": installer, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
