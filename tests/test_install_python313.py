"""The provider installs into a stock Airflow on Python 3.13, in a Debian 13 container.

The two wheels built here (pure Python) and the lock's versions as constraints go into
python:3.13-slim-trixie (a stand-in from Debian's packages where no registry is reachable) with
apache-airflow at the lock's version, as docs/install-into-airflow.md installs them; then
`airflow providers list` shows the provider, Airflow parses the packaged DAGs, and `syncswitch check`
runs the built-in model on one batch. Skipped, saying why, only where no Docker engine can run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[1]
IMAGE = "python:3.13-slim-trixie"
AIRFLOW_VERSION = "3.3.2"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

IN_THE_CONTAINER = f"""
set -eu
pip install --quiet --root-user-action=ignore uv
uv pip install --system --quiet -c /dist/constraints.txt "apache-airflow=={AIRFLOW_VERSION}" \\
    /dist/syncswitch-*.whl /dist/airflow_provider_syncswitch-*.whl
export AIRFLOW_HOME=/tmp/airflow AIRFLOW__CORE__LOAD_EXAMPLES=false AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT=300
python -c 'import sys; print("python", sys.version.split()[0])'
airflow providers list | grep syncswitch
airflow db migrate >/dev/null
dags="$(python -c 'import syncswitch_airflow.dags as d; print(*d.__path__)')"
AIRFLOW__CORE__DAGS_FOLDER="$dags" airflow dags list --local
syncswitch check
"""


def build_user_packages(dist: Path) -> None:
    """The two user packages' wheels (each from its sdist) and the lock's constraints, as the install
    doc builds them."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (scripts/test.sh puts it there)")
    for package in ("syncswitch", "airflow-provider-syncswitch"):
        build = [uv, "build", "--quiet", "--package", package, "--out-dir", str(dist)]
        subprocess.run(build, cwd=REPO, check=True)
    export = [uv, "export", "--frozen", "--package", "airflow-provider-syncswitch", "--all-extras"]
    export += ["--no-emit-workspace", "--no-hashes", "-o", str(dist / "constraints.txt")]
    subprocess.run(export, cwd=REPO, check=True, capture_output=True)


def test_the_provider_installs_and_runs_on_python_313_in_debian_13(
    docker_engine,  # noqa: ANN001 - docker_stack.DockerEngine
    tmp_path: Path,
) -> None:
    from docker_stack import build_stand_ins

    build_stand_ins("trixie")
    dist = tmp_path / "dist"
    build_user_packages(dist)
    command = ["docker", "run", "--rm", "-v", f"{dist}:/dist:ro"]
    if CA_BUNDLE.is_file():  # a TLS-inspecting proxy's bundle, for pip and uv in the container
        command += ["-v", f"{CA_BUNDLE}:/etc/ssl/host-ca.pem:ro", "-e", "SSL_CERT_FILE=/etc/ssl/host-ca.pem"]
        command += ["-e", "PIP_CERT=/etc/ssl/host-ca.pem"]
    cache = os.environ.get("SYNCSWITCH_DOCKER_UV_CACHE")  # a warm cache makes a second run quick
    if cache:
        command += ["-v", f"{cache}:/root/.cache/uv"]
    done = subprocess.run(
        [*command, IMAGE, "bash", "-c", IN_THE_CONTAINER], capture_output=True, text=True, timeout=3000
    )
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "python 3.13." in out
    assert "airflow-provider-syncswitch" in out
    assert {"sync_switch", "sync_switch_reaper", "on_new_model"} <= set(out.split())
    assert "Failed to load" not in out + done.stderr
    check = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert check["loss"] > 0, check
