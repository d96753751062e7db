"""The two distributions as a user gets them: wheels built with ``uv build``, installed into a fresh
virtualenv with the lock's versions of everything they need (``uv export`` as constraints).

The packages test installs them into Airflow-less and Airflow virtualenvs; the Celery deployment runs
every component from such a virtualenv. With uv's cache filled by the lock's sync, a virtualenv takes
seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from syncswitch_airflow.backends.node_install import GPU_PREFIX

RUNTIME, PROVIDER = "syncswitch", "airflow-provider-syncswitch"
PROJECT_DIR = Path(__file__).resolve().parent.parent  # the workspace's root
LOCK_EXPORT = ["export", "--frozen", "--all-packages", "--no-dev", "--no-emit-workspace", "--no-hashes"]
REQUIREMENTS_FILE = PROJECT_DIR / "training" / "syncswitch" / "requirements.txt"
_PLAIN = ["--no-emit-workspace", "--no-hashes", "--no-header", "--no-annotate", "--quiet"]
# The runtime's pins, and those of the gpu group: TensorFlow's CUDA build at the same versions.
EXPORT_RUNTIME = ["export", "--frozen", "--package", RUNTIME, "--no-dev", *_PLAIN]
EXPORT_GPU = ["export", "--frozen", "--only-group", "gpu", *_PLAIN]


def uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        raise RuntimeError("uv is not on PATH (scripts/_uv.sh installs it)")
    return found


def run_uv(*args: str | Path, cwd: Path = PROJECT_DIR) -> str:
    done = subprocess.run([uv(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"uv {' '.join(map(str, args))} failed:\n{(done.stderr or done.stdout)[-3000:]}")
    return done.stdout


def runtime_requirements() -> str:
    """``training/syncswitch/requirements.txt`` as the lock makes it: the runtime's pins, then as
    ``#gpu:`` lines the pins a GPU node installs in tensorflow-cpu's place (node_install.py)."""
    runtime = run_uv(*EXPORT_RUNTIME)
    cpu = set(runtime.splitlines())
    gpu = [line for line in run_uv(*EXPORT_GPU).splitlines() if line and line not in cpu]
    header = "# A GPU node installs these in place of tensorflow-cpu (node_install.py):\n"
    return runtime + header + "".join(f"{GPU_PREFIX}{line}\n" for line in gpu)


def build_wheels(out: Path) -> dict[str, Path]:
    """The runtime's and the provider's wheels (not the test infrastructure's), by distribution name.

    Built as ``uv build`` and ``python -m build`` build by default: an sdist, then the wheel from it (as
    an installer given the sdist does), so that a file the sdist lacks is missing from the wheel too."""
    for package in (RUNTIME, PROVIDER):
        run_uv("build", "--quiet", "--package", package, "--out-dir", out)
    return {path.name.split("-")[0].replace("_", "-"): path for path in Path(out).glob("*.whl")}


def lock_constraints(path: Path) -> Path:
    """The lock's versions of every package of the workspace's distributions, as pip constraints."""
    run_uv(*LOCK_EXPORT, "--quiet", "-o", path)
    return path


def fresh_venv(folder: Path, constraints: Path, *requirements: str | Path) -> Path:
    """A new virtualenv with ``requirements`` (wheels, extras, names) at the lock's versions; its bin/."""
    run_uv("venv", "--quiet", "--python", sys.executable, folder)
    python = Path(folder) / "bin" / "python"
    run_uv(
        "pip", "install", "--quiet", "--python", python, "-c", constraints, *requirements, cwd=Path(folder)
    )
    return Path(folder) / "bin"


if __name__ == "__main__":  # python -m wheels: the requirements file again, after `uv lock`
    REQUIREMENTS_FILE.write_text(runtime_requirements())
    print(f"wrote {REQUIREMENTS_FILE}")
