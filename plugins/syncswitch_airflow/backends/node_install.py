"""Install the training runtime on a cluster node: run there, by any Python 3, with the standard library.

    python3 node_install.py VENV --requirements requirements.txt --runtime syncswitch.tar.gz

makes ``VENV`` a virtual environment with the lock's versions of the runtime's dependencies
(``requirements.txt``: exact pins) and the runtime package (a tarball of ``syncswitch/``), checks it
against the lock (``python -m syncswitch.requirements --check``), and prints one JSON line:
``{"python": "VENV/bin/python", "installed": true, "installer": "uv", "seconds": 4.2}``.

``VENV`` is named by the content (the hosts backend names it by a hash of both files), so a finished
one is never changed: a second call finds its marker and returns at once (``"installed": false``).
Calls for the same ``VENV`` at once (runs that share a host, hosts that share a filesystem) take turns
on a lock file; a half-made one (a call killed midway) is removed and made again.

The installer is ``uv`` where it is on PATH (fast: it links from its cache; ``UV_OFFLINE=1`` for a host
without a route to the registry), else the venv's ``pip``. Both install exactly the pins; neither
resolves anything else.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

MARKER = ".syncswitch-runtime"


def run(command: list[str]) -> None:
    """Run a step; on failure, exit with its output's tail (the caller shows it, naming the host)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        sys.exit(f"{command[0]} {' '.join(command[1:3])} ... failed (exit {done.returncode}):\n{tail}")


def make_venv(venv: str, uv: str | None) -> str:
    python = os.path.join(venv, "bin", "python")
    if uv:
        run([uv, "venv", "--quiet", "--python", sys.executable, venv])
    else:  # Debian's python3 needs its python3-venv package for this
        run([sys.executable, "-m", "venv", venv])
    return python


def install(python: str, requirements: str, uv: str | None) -> None:
    if shutil.which("nvidia-smi"):
        # A GPU host: TensorFlow's CUDA build at the lock's version in place of the CPU one (the
        # runtime's version check accepts it: syncswitch.requirements.STAND_INS).
        with open(requirements) as f:
            pins = f.read().replace("tensorflow-cpu==", "tensorflow[and-cuda]==")
        requirements = requirements + ".gpu"
        with open(requirements, "w") as f:
            f.write(pins)
    if uv:
        run([uv, "pip", "install", "--quiet", "--python", python, "-r", requirements])
    else:
        run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", requirements])


def unpack_runtime(python: str, tarball: str) -> None:
    """The runtime package into the venv's site-packages (pure Python: no build step)."""
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(site, filter="data")
        else:  # Python before 3.11.4 (Debian 12's 3.11.2): the same refusals, by hand
            for member in tar.getmembers():
                parts = member.name.split("/")
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    sys.exit(f"{tarball}: refusing member {member.name!r}")
            tar.extractall(site)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("venv")
    parser.add_argument("--requirements", required=True)
    parser.add_argument("--runtime", required=True, help="tarball of the syncswitch package")
    args = parser.parse_args(argv)
    venv = os.path.abspath(args.venv)
    python = os.path.join(venv, "bin", "python")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    started = time.monotonic()
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(venv, MARKER)):
            print(json.dumps({"python": python, "installed": False}))
            return 0
        shutil.rmtree(venv, ignore_errors=True)  # a half-made one
        uv = shutil.which("uv")
        make_venv(venv, uv)
        install(python, args.requirements, uv)
        unpack_runtime(python, args.runtime)
        run([python, "-m", "syncswitch.requirements", "--check"])
        with open(os.path.join(venv, MARKER), "w") as marker:
            marker.write(f"installed at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    seconds = round(time.monotonic() - started, 1)
    installer = "uv" if uv else "pip"
    print(json.dumps({"python": python, "installed": True, "installer": installer, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
