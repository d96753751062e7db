"""A user model's requirements.txt (docs/bring-your-own-model.md): read, checked where nothing installs
it, resolved against the runtime's pins where a backend does, and part of the node environment's id.

No cluster here. The resolver runs offline (``UV_OFFLINE``): a list that the runtime's pins refuse is
refused alike on a cold cache and a warm one. The installer's test warms the cache first, as the
testbed's hosts do (conftest ``offline_uv_env``), and installs from it offline.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from conftest import offline_uv_env
from syncswitch import storage, usercode
from syncswitch.errors import SpecError
from syncswitch.requirements import listed, locked_versions, unmet
from syncswitch.spec import JobSpec
from syncswitch_airflow.backends import node_install
from syncswitch_airflow.backends.node_runtime import NODE_INSTALL_SCRIPT, RuntimeBundle
from syncswitch_airflow.backends.user_requirements import check_for_validate, node_requirements

MNIST1D_LIST = (
    Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "mnist1d_example" / "requirements.txt"
)
GCE = "project=sync-proj-1;zones=us-central1-a"


def user_package(root: Path, requirements: str | None) -> Path:
    """A package folder usr_dir, with ``requirements`` as its requirements.txt (None: without one)."""
    package = root / "req_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if requirements is not None:
        (package / "requirements.txt").write_text(requirements)
    return package


def job_on(backend: str, package: Path) -> JobSpec:
    """A job of ``package`` on ``backend`` (validated params; nothing is imported or provisioned)."""
    params: dict[str, Any] = {"job_name": "req", "usr_dir": str(package), "cluster_backend": backend}
    if backend == "gce":
        params.update(bucket_dir="gs://b/runs", gce=GCE)
    if backend == "hosts":
        params.update(bucket_dir="gs://b/runs", hosts=["address=10.0.0.11,key=/keys/id_ed25519"])
    return JobSpec.from_params(params)


def test_only_a_package_folders_requirements_txt_speaks_for_the_user_code(tmp_path: Path) -> None:
    package = user_package(tmp_path, "mnist1d==0.0.2.post1\n")
    assert usercode.requirements_path(str(package)) == str(package / "requirements.txt")
    before = usercode.digest(str(package))
    (package / "requirements.txt").write_text("mnist1d>=0.0.2\n")
    assert usercode.digest(str(package)) != before  # so the run's fingerprint changes with it
    script = tmp_path / "model.py"  # a file usr_dir: the requirements.txt beside it is not its own
    script.write_text("")
    (tmp_path / "requirements.txt").write_text("anything\n")
    assert usercode.requirements_path(str(script)) == ""
    assert usercode.requirements_path("json") == ""  # a module name
    assert usercode.requirements_path(str(user_package(tmp_path / "bare", None))) == ""


def test_a_list_holds_one_requirement_a_line_and_nothing_else() -> None:
    text = "# the generator\n\nmnist1d==0.0.2.post1  # pinned\nrich>=13 ; python_version >= '3.8'\n"
    assert [str(r) for r in listed(text, "req.txt")] == [
        "mnist1d==0.0.2.post1",
        'rich>=13; python_version >= "3.8"',
    ]
    with pytest.raises(SpecError, match=r"^usr_dir: req.txt line 2: '-r other.txt' is a pip option"):
        listed("mnist1d\n-r other.txt\n", "req.txt")
    with pytest.raises(SpecError, match=r"^usr_dir: req.txt line 1: 'mnist1d = 2' is not a requirement"):
        listed("mnist1d = 2\n", "req.txt")


def test_what_an_interpreter_lacks_is_named_with_what_the_list_asks() -> None:
    installed = {"numpy": "2.4.6", "mnist1d": "0.0.2.post1"}

    def version_of(name: str) -> str:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    requirements = listed("mnist1d==0.0.2.post1\nnumpy<2\nabsent-pkg>=1\nwinonly; sys_platform == 'win32'\n")
    assert unmet(requirements, "req.txt", version_of) == [
        "numpy: 2.4.6 installed, req.txt asks numpy<2",
        "absent-pkg: missing (req.txt asks absent-pkg>=1)",
    ]


def test_the_hosts_check_names_what_a_host_lacks() -> None:
    """What provisioning runs on each host that brings its own runtime (hosts_runtime = installed):
    the list on stdin; each unmet requirement named, exit 1."""
    done = subprocess.run(
        [sys.executable, "-m", "syncswitch.requirements", "--check", "--user-requirements", "-"],
        input="numpy\nsyncswitch-absent-package>=1\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "syncswitch-absent-package: missing (the user code's requirements.txt asks" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("1 of the user code's 2 requirements are not met")


def test_the_environment_id_covers_the_user_codes_list() -> None:
    """The runtime's id (a hosts venv's name) hashes the resolved list too: another list, another
    venv; without one, the id of the runtime alone (venvs made before lists keep their names)."""
    runtime = RuntimeBundle.current()
    alone = hashlib.sha256(runtime.requirements.encode() + b"\0" + runtime.wheel.content).hexdigest()[:16]
    assert runtime.id == alone
    first = RuntimeBundle.current("#   mnist1d==0.0.2.post1\nmnist1d==0.0.2.post1\n")
    second = RuntimeBundle.current("#   mnist1d>=0.0.2\nmnist1d==0.0.2.post1\n")
    assert len({runtime.id, first.id, second.id}) == 3
    assert first.venv("/w") == f"/w/runtime/{first.id}" != second.venv("/w")
    # The marker a venv is made to: the user's list in it only where there is one.
    assert set(node_install.wanted_digests(str(MNIST1D_LIST), "")) == {"requirements"}
    assert set(node_install.wanted_digests(str(MNIST1D_LIST), str(MNIST1D_LIST))) == {
        "requirements",
        "user_requirements",
    }


def test_a_list_the_runtimes_pins_refuse_fails_validate_naming_the_file_and_the_requirement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a backend installs the list (gce; hosts with hosts_runtime = install) it is resolved with
    the runtime's pins before anything is provisioned; a requirement they cannot meet is named. Where
    the hosts bring their own runtime it is only read (each host is checked at provisioning); on the
    local backend it must be met in this environment, which trains."""
    monkeypatch.setenv("UV_OFFLINE", "1")
    package = user_package(tmp_path, "# a numpy 1 model\nnumpy<2\n")
    listed_at = str(package / "requirements.txt")
    pinned = {name: version for name, version, _ in locked_versions()}
    for backend, setting in (("gce", ""), ("hosts", "install")):
        monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", setting or "installed")
        with pytest.raises(SpecError) as refused:
            check_for_validate(job_on(backend, package))
        message = str(refused.value)
        assert message.startswith(f"usr_dir: {listed_at}: 'numpy<2' cannot be installed with the runtime's")
        assert f"numpy=={pinned['numpy']}" in message, message  # uv's reason: the pin in the way
    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "installed")
    assert check_for_validate(job_on("hosts", package)).endswith("checked on each host at provisioning")
    assert node_requirements(job_on("hosts", package), install=False) == "# a numpy 1 model\nnumpy<2\n"
    with pytest.raises(
        SpecError, match=r"numpy: \S+ installed, .*asks numpy<2: the local backend trains in this"
    ):
        check_for_validate(job_on("local", package))


def test_the_installer_puts_the_list_in_the_venv_and_makes_it_again_when_the_list_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node_install.py with ``--user-requirements`` (the list as the Airflow side resolved it, offline
    from a warm cache as on a testbed host): the list goes in beside the pins, which it cannot move;
    the same call again finds the venv; another list (or none) makes it again, so nothing of an old
    list stays."""
    env = offline_uv_env(tmp_path, MNIST1D_LIST)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "install")
    job = job_on("hosts", MNIST1D_LIST.parent)
    resolved = tmp_path / "user-requirements.txt"
    resolved.write_text(node_requirements(job, install=True))
    assert "#   mnist1d==0.0.2.post1\n" in resolved.read_text() and "\nmatplotlib==" in resolved.read_text()
    runtime = RuntimeBundle.current()
    (tmp_path / "requirements.txt").write_text(runtime.requirements)
    (tmp_path / runtime.wheel.filename).write_bytes(runtime.wheel.content)
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")

    def install(*user_list: str) -> dict[str, Any]:
        argv = [sys.executable, str(NODE_INSTALL_SCRIPT), str(venv), "--requirements"]
        argv += [str(tmp_path / "requirements.txt"), "--runtime", str(tmp_path / runtime.wheel.filename)]
        done = subprocess.run([*argv, *user_list], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def has_mnist1d() -> bool:
        probe = "import importlib.util as u; print(u.find_spec('mnist1d') is not None)"
        return (
            subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
            == "True"
        )

    assert install("--user-requirements", str(resolved))["installed"] == "all"
    assert has_mnist1d()
    subprocess.run([python, "-m", "syncswitch.requirements", "--check"], check=True, timeout=120)  # pins kept
    marker = json.loads((venv / node_install.MARKER).read_text())
    assert marker["user_requirements"] == hashlib.sha256(resolved.read_bytes()).hexdigest()
    assert install("--user-requirements", str(resolved))["installed"] == ""
    assert install()["installed"] == "all"  # the list dropped: a venv without it
    assert not has_mnist1d()


@pytest.mark.airflow
def test_the_validate_task_refuses_the_list_before_anything_is_provisioned(  # noqa: ANN001
    dag, gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Through the DAG: a hosts job whose backend would install the list (hosts_runtime = install) and
    whose list the runtime's pins refuse fails at validate, naming the file and the requirement; no
    host is contacted, no run folder is made."""
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("SYNCSWITCH_HOSTS_RUNTIME", "install")
    package = user_package(tmp_path, "numpy<2\n")
    key = tmp_path / "id_ed25519"
    key.write_text("not used: nothing logs in\n")
    conf = {
        "job_name": "req-refused",
        "cluster_backend": "hosts",
        "hosts": [f"address=10.254.0.1,key={key}"],  # nowhere: validate must not get that far
        "bucket_dir": f"{gcs_bucket}/runs",
        "usr_dir": str(package),
    }
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "failed"
    out = capfd.readouterr().out
    assert (
        f"invalid job params: usr_dir: {package / 'requirements.txt'}: 'numpy<2' cannot be installed" in out
    )
    assert not storage.list_files(f"{gcs_bucket}/runs/req-refused")  # (its history record is in _history/)
