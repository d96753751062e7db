"""The two distributions as users install them, outside the checkout.

Every workspace package builds with ``uv build``'s defaults: an sdist, then the wheel built from it.
The runtime's and the provider's wheels each go into a fresh virtualenv with the lock's versions of
what it declares (``uv pip install`` with ``uv export`` as constraints; uv links the files from its
cache, so this takes seconds). Then:

- the runtime (``syncswitch``) imports no Airflow and trains one segment;
- the provider (``airflow-provider-syncswitch``) is listed by ``airflow providers list`` and its
  packaged ``sync_switch`` DAG runs under ``dag.test()`` from site-packages.

Nothing here may come from the checkout: the commands run in a temporary folder, without PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from syncswitch_airflow.backends.node_install import GPU_PREFIX
from wheels import (
    PROVIDER,
    REQUIREMENTS_FILE,
    RUNTIME,
    fresh_venv,
    lock_constraints,
    run_uv,
    runtime_requirements,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.packages


def _run(argv: list[str | Path], *, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:  # noqa: ANN003
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{argv}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that points into the checkout or its venv."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "AIRFLOW_HOME", "AIRFLOW_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AIRFLOW__")}
    return {**env, **extra}


def _dists(folder: Path, suffix: str) -> dict[str, Path]:
    """The files of ``folder`` ending in ``suffix``, by distribution name."""
    return {p.name.split("-")[0].replace("_", "-"): p for p in folder.glob(f"*{suffix}")}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every workspace package built with ``uv build``'s defaults: its sdist, then a wheel built from
    that sdist (as ``python -m build`` does, and an installer given the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    run_uv("build", "--quiet", "--all-packages", "--out-dir", out)
    return out


@pytest.fixture(scope="module")
def wheels(built: Path) -> dict[str, Path]:
    """The runtime's and the provider's wheels, by distribution name."""
    return {name: path for name, path in _dists(built, ".whl").items() if name in (RUNTIME, PROVIDER)}


@pytest.fixture(scope="module")
def constraints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lock_constraints(tmp_path_factory.mktemp("lock") / "constraints.txt")


def test_the_runtimes_requirements_are_the_lock() -> None:
    shipped = REQUIREMENTS_FILE.read_text()
    assert shipped == runtime_requirements(), (
        f"{REQUIREMENTS_FILE} is out of date: cd testing && uv run python -m wheels"
    )
    assert GPU_PREFIX + "tensorflow==" in shipped  # the CUDA build's pins travel in the same file


def test_every_package_builds_with_uv_builds_defaults(built: Path) -> None:
    """Each package's wheel is built from its sdist, so the sdist must hold every file of the wheel:
    the provider's, the DAG files, which live in the repository's dags/ (linked from the package)."""
    sdists, wheels = _dists(built, ".tar.gz"), _dists(built, ".whl")
    assert set(sdists) == set(wheels) == {RUNTIME, PROVIDER, "syncswitch-testing"}, sorted(built.iterdir())
    dag_files = sorted(p.name for p in (REPO / "dags").glob("*.py"))
    assert "sync_switch.py" in dag_files
    packaged = zipfile.ZipFile(wheels[PROVIDER]).namelist()
    assert sorted(n for n in packaged if n.startswith("syncswitch_airflow/dags/")) == [
        f"syncswitch_airflow/dags/{name}" for name in dag_files
    ]
    with tarfile.open(sdists[PROVIDER]) as sdist:
        members = [m for m in sdist.getmembers() if "/syncswitch_airflow/dags/" in m.name]
    assert sorted(Path(m.name).name for m in members) == dag_files
    assert all(m.isfile() for m in members), "the sdist holds the DAG files themselves, not links"


def test_the_wheels_carry_their_parts(wheels: dict[str, Path]) -> None:
    runtime = zipfile.ZipFile(wheels[RUNTIME]).namelist()
    provider = zipfile.ZipFile(wheels[PROVIDER]).namelist()
    assert "syncswitch/cli.py" in runtime and not any(n.startswith("syncswitch_airflow/") for n in runtime)
    assert "syncswitch/requirements.txt" in runtime  # the lock's versions, which nodes install
    assert not any(n.startswith("syncswitch/") for n in provider)
    dags = sorted(n for n in provider if n.startswith("syncswitch_airflow/dags/"))
    assert dags == sorted(f"syncswitch_airflow/dags/{p.name}" for p in (REPO / "dags").glob("*.py"))
    entry_points = next(n for n in provider if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheels[PROVIDER]).read(entry_points).decode()
    assert "[apache_airflow_provider]" in text and "get_provider_info" in text


def test_the_runtime_wheel_trains_a_segment_without_airflow(
    wheels: dict[str, Path], constraints: Path, tmp_path: Path
) -> None:
    bin_dir = fresh_venv(tmp_path / "venv", constraints, wheels[RUNTIME])
    env = _clean_env()
    probe = (
        "import importlib.util as u, syncswitch; print(u.find_spec('airflow') is None, syncswitch.__file__)"
    )
    no_airflow, location = _run([bin_dir / "python", "-c", probe], cwd=tmp_path, env=env).stdout.split()
    assert no_airflow == "True" and location.startswith(str(tmp_path / "venv")), location
    # Installed with the lock as constraints, it has exactly the versions its requirements.txt pins.
    _run([bin_dir / "python", "-m", "syncswitch.requirements", "--check"], cwd=tmp_path, env=env)
    run_dir = tmp_path / "run"
    argv = [bin_dir / "syncswitch", "train", "--quiet", "--workers", "1", "--until-step", "30"]
    _run([*argv, "--ckpt-frequency", "0", "--run-dir", run_dir, "--eval"], cwd=tmp_path, env=env)
    results = list(run_dir.glob("metrics/seg-00-bsp/result.json"))
    assert results, sorted(str(p) for p in run_dir.rglob("*"))
    result = json.loads(results[0].read_text())
    assert result["end_step"] == 30 and result["test_accuracy"] > 0
    # The pipeline's commands name the missing provider instead of failing on an import.
    done = subprocess.run(
        [bin_dir / "syncswitch", "run"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and "needs the Airflow provider" in done.stderr


# Runs the packaged demo DAG in the fresh environment and prints one JSON line about it.
DAG_TEST_SCRIPT = """
import json, pathlib, sys
import syncswitch, syncswitch_airflow
from airflow.dag_processing.dagbag import DagBag

folder = pathlib.Path(syncswitch_airflow.__file__).parent / "dags"
bag = DagBag(dag_folder=str(folder))
if "sync_switch" not in bag.dags:
    sys.exit(f"sync_switch not parsed; import errors: {bag.import_errors}")
run = bag.dags["sync_switch"].test(run_conf=json.loads(sys.argv[1]))
print(json.dumps({
    "errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": sorted(bag.dags),
    "state": str(run.state), "packages": [syncswitch.__file__, syncswitch_airflow.__file__],
}))
"""


def test_the_provider_wheel_installs_into_airflow_and_runs_its_packaged_dag(
    wheels: dict[str, Path], constraints: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    bin_dir = fresh_venv(venv, constraints, wheels[RUNTIME], wheels[PROVIDER])
    env = _clean_env(
        AIRFLOW_HOME=str(tmp_path / "airflow-home"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        # The parse imports the provider and Airflow from source (this venv has no bytecode): past
        # the default 30 s on a slow machine while the other test worker trains.
        AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="300",
        AIRFLOW__SYNCSWITCH__BUCKET_DIR=str(tmp_path / "default-runs"),
        AIRFLOW__SYNCSWITCH__WORK_DIR=str(tmp_path / "work"),
    )
    listed = _run([bin_dir / "airflow", "providers", "list", "--output", "json"], cwd=tmp_path, env=env)
    providers = {p["package_name"]: p for p in json.loads(listed.stdout)}
    assert PROVIDER in providers, sorted(providers)
    # The deployment's DAGs folder is the package's (docs/install-into-airflow.md).
    where = "import pathlib, syncswitch_airflow as p; print(pathlib.Path(p.__file__).parent / 'dags')"
    env["AIRFLOW__CORE__DAGS_FOLDER"] = _run([bin_dir / "python", "-c", where], env=env).stdout.strip()
    # dag.test() parses and serializes the packaged DAGs itself (`airflow dags reserialize` took 16 s).
    _run([bin_dir / "airflow", "db", "migrate"], cwd=tmp_path, env=env)
    runs = tmp_path / "runs"
    conf = {"job_name": "from-wheel", "total_steps": 60, "ckpt_frequency": [30], "bucket_dir": str(runs)}
    done = _run([bin_dir / "python", "-c", DAG_TEST_SCRIPT, json.dumps(conf)], cwd=tmp_path, env=env)
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["errors"] == {}
    assert {"sync_switch", "sync_switch_reaper"} <= set(outcome["dags"])
    assert all(path.startswith(str(venv)) for path in outcome["packages"]), outcome["packages"]
    assert outcome["state"] == "success", done.stdout[-3000:] + done.stderr[-3000:]
    (run_folder,) = (runs / "from-wheel").iterdir()
    state = json.loads((run_folder / "state.json").read_text())
    assert state["status"] == "success" and state["final"]["global_step"] == 60
