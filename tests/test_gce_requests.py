"""The gce backend's requests and the gce param, up to the Compute Engine API (no VM is created).

Requests are compute_v1 objects: a wrong field name fails where the object is built, and the JSON the
REST client sends is checked field by field (spot, GPUs, labels, network, time limit)."""

from __future__ import annotations

import datetime
import importlib.metadata
import io
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.cloud import compute_v1
from google.protobuf import json_format
from syncswitch.errors import SpecError
from syncswitch.gce import LABEL_EXPIRES, LABEL_JOB, LABEL_ROLE, LABEL_RUN, VmPlan, vm_plan
from syncswitch.spec import JobSpec
from syncswitch_airflow.backends.gce_requests import firewall_body, instance_body

RUN = "manual__2026-11-23T15:04:05+00:00"
GCE = "project=sync-proj-1;zones=us-central1-a us-central1-b us-west1-b us-east1-c;gpus=t4 t4 p100 v100:2"


def job(**overrides: object) -> JobSpec:
    params = {"cluster_backend": "gce", "bucket_dir": "gs://b/runs", "num_workers": 4, "gce": GCE}
    return JobSpec.from_params({**params, **overrides})


def as_json(message: object) -> dict:
    """The JSON the REST transport sends (json_format, fields at their defaults left out)."""
    return json_format.MessageToDict(type(message).pb(message))


def test_the_plan_puts_the_checkpointer_on_demand_and_the_other_workers_on_spot() -> None:
    spec = job()
    vms = vm_plan(spec.gce, spec.job_name, RUN, spec.num_workers, spec.num_ps)
    assert [(v.role, v.task, v.spot) for v in vms] == [
        ("chief", 0, False),
        ("worker", 1, True),
        ("worker", 2, True),
        ("worker", 3, True),
        ("ps", 0, False),
    ]
    assert [v.zone for v in vms] == [
        "us-central1-a",
        "us-central1-b",
        "us-west1-b",
        "us-east1-c",
        "us-central1-a",
    ]
    assert [(v.gpu.type, v.gpu.count) for v in vms[:4]] == [
        ("nvidia-tesla-t4", 1),
        ("nvidia-tesla-t4", 1),
        ("nvidia-tesla-p100", 1),
        ("nvidia-tesla-v100", 2),
    ]
    assert len({v.name for v in vms}) == len(vms) and all(len(v.name) <= 63 for v in vms)
    assert vms[1].replacement(1).name == f"{vms[1].name}-r1" and vms[1].replacement(2).name.endswith("-w1-r2")


def test_a_planned_vms_record_is_flat_and_gives_the_same_vm_back() -> None:
    spec = job()
    vms = vm_plan(spec.gce, spec.job_name, RUN, spec.num_workers, 1)
    record = vms[3].to_dict()
    assert record == {
        "name": vms[3].name,
        "role": "worker",
        "task": 3,
        "zone": "us-east1-c",
        "machine_type": "n1-standard-8",
        "gpu_type": "nvidia-tesla-v100",
        "gpu_count": 2,
        "spot": True,
    }
    assert [VmPlan.from_dict(vm.to_dict()) for vm in vms] == vms
    # A record as state.json keeps it: the plan's fields and the VM's life beside them.
    assert VmPlan.from_dict({**record, "state": "revoked", "requested_at": 1.0}) == vms[3]


def test_a_spot_gpu_worker_request_has_every_field_compute_engine_needs() -> None:
    spec = job()
    vm = vm_plan(spec.gce, spec.job_name, RUN, 4, 1)[3]
    labels = {LABEL_JOB: "digits-demo", LABEL_RUN: "r-1", LABEL_EXPIRES: "1800000000"}
    body = as_json(
        instance_body(vm, spec.gce, labels, "ss-net", {"ssh-keys": "syncswitch:ssh-ed25519 AAAA k"})
    )
    assert body["machineType"] == "zones/us-east1-c/machineTypes/n1-standard-8"
    assert body["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "DELETE",
        "maxRunDuration": {"seconds": "86400"},
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": False,
    }
    assert body["guestAccelerators"] == [
        {
            "acceleratorType": "projects/sync-proj-1/zones/us-east1-c/acceleratorTypes/nvidia-tesla-v100",
            "acceleratorCount": 2,
        }
    ]
    assert body["labels"] == {**labels, LABEL_ROLE: "worker"}
    assert body["tags"] == {"items": ["ss-net"]}
    (interface,) = body["networkInterfaces"]
    assert interface == {"network": "projects/sync-proj-1/global/networks/default"}  # no accessConfigs
    (disk,) = body["disks"]
    assert disk["boot"] and disk["autoDelete"]
    assert disk["initializeParams"]["sourceImage"] == "projects/debian-cloud/global/images/family/debian-12"
    assert {i["key"] for i in body["metadata"]["items"]} == {"ssh-keys"}


def test_a_retired_gpu_is_refused_before_anything_is_created_with_the_tables_age() -> None:
    """The gce param asks for VMs now: a GPU type Compute Engine has retired is refused at validate,
    naming it, the current types and how old the price table that says so is."""
    from syncswitch.costs import Catalog

    as_of = datetime.date.fromisoformat(Catalog.load().as_of)
    with pytest.raises(SpecError) as caught:
        job(gce="project=sync-proj-1;zones=us-central1-a;gpus=k80")
    assert str(caught.value).startswith(
        f"gce.gpus: worker 0: 'k80' is retired on Compute Engine since 2024-05-01 (price table of {as_of}, "
        f"{(datetime.date.today() - as_of).days} days old); current types: p100, v100, t4, p4 (on n1 "
        "machine types); a100 (machine type a2-highgpu-1g, with gpus none); l4 (machine type g2-standard-8"
    )


def test_the_readmes_gce_example_asks_for_what_compute_engine_offers() -> None:
    """The README's example (every doc that shows a gce param shows current types): it validates, and
    its image is one whose VMs the startup script can install (uv brings the lock's Python)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ((workers, example),) = re.findall(r"--num-worker (\d+)[^\n]*\n\s*--gce '([^']+)'", readme)
    spec = job(gce=example, num_workers=int(workers))
    assert [g.type for g in spec.gce.gpus] == ["nvidia-tesla-t4", "nvidia-tesla-t4", "", ""]
    assert spec.gce.machine_types[2:] == ("g2-standard-8", "a2-highgpu-1g")
    assert spec.gce.image.startswith("projects/deeplearning-platform-release/global/images/family/")


def test_spot_none_puts_every_vm_on_demand() -> None:
    spec = job(gce=GCE + ";spot=none")
    assert spec.gce.spot == () and not any(v.spot for v in vm_plan(spec.gce, spec.job_name, RUN, 4, 1))
    assert JobSpec.from_params(spec.to_params()) == spec


def test_the_chief_and_the_parameter_server_are_on_demand_and_keep_a_time_limit() -> None:
    spec = job(gce=GCE + ";subnetwork=train-sub;max_run_seconds=7200")
    chief, *_, ps = vm_plan(spec.gce, spec.job_name, RUN, 4, 1)
    for vm, maintenance in ((chief, "TERMINATE"), (ps, "MIGRATE")):  # the chief has a GPU
        body = as_json(instance_body(vm, spec.gce, {}, "t", {}))
        assert body["scheduling"]["provisioningModel"] == "STANDARD"
        assert body["scheduling"]["maxRunDuration"] == {"seconds": "7200"}
        assert body["scheduling"]["onHostMaintenance"] == maintenance
        assert body["networkInterfaces"][0]["subnetwork"] == (
            f"projects/sync-proj-1/regions/{vm.zone.rsplit('-', 1)[0]}/subnetworks/train-sub"
        )
    assert "guestAccelerators" not in as_json(instance_body(ps, spec.gce, {}, "t", {}))


def test_the_firewall_opens_the_training_ports_to_the_runs_own_vms_only() -> None:
    body = as_json(firewall_body("ss-x-train", job().gce, "ss-x-net"))
    assert body["sourceTags"] == ["ss-x-net"] and body["targetTags"] == ["ss-x-net"]
    assert "sourceRanges" not in body
    assert body["allowed"] == [{"IPProtocol": "tcp"}] and body["direction"] == "INGRESS"
    assert isinstance(firewall_body("a", job().gce, "t"), compute_v1.Firewall)


@pytest.mark.parametrize(
    ("gce", "field", "words"),
    [
        (
            "project=sync-proj-1;zones=us-central1-a us-central1-b",
            "gce.zones",
            ["2 values", "num_workers is 4"],
        ),
        ("project=sync-proj-1;zones=us-central1-a;gpus=h100", "gce.gpus", ["h100", "t4", "v100"]),
        (
            "project=sync-proj-1;zones=us-central1-a;gpus=t4 t4 k80 v100",
            "gce.gpus",
            ["worker 2: 'k80' is retired on Compute Engine", "days old", "current types: p100, v100, t4"],
        ),
        (
            "project=sync-proj-1;zones=us-central1-a;machine_types=e2-standard-4;gpus=t4",
            "gce.gpus",
            ["e2-standard-4"],
        ),
        ("project=sync-proj-1;zones=us-west1-a;gpus=p4", "gce.gpus", ["us-west1", "europe-west4"]),
        ("project=sync-proj-1;zones=us-central1-a;gpus=t4:3", "gce.gpus", ["1, 2, 4 (at most 4"]),
        ("project=sync-proj-1;zones=us-central1-a;spot=chief worker", "gce.spot", ["checkpointer"]),
        (
            "project=sync-proj-1;zones=us-central1-a;on_revocation=pray",
            "gce.on_revocation",
            ["replace", "shrink"],
        ),
        ("project=sync-proj-1;zones=us-central1-a;max_run_seconds=10", "gce.max_run_seconds", ["600"]),
        ("project=sync-proj-1;zones=mars-1a", "gce.zones", ["us-central1-a"]),
        ("zones=us-central1-a", "gce.project", ["required"]),
        ("project=sync-proj-1;zones=us-central1-a;python=/usr/bin/python", "gce.python", ["virtualenv"]),
        ("project=sync-proj-1;zones=us-central1-a;python=/opt/env/python", "gce.python", ["/bin/python"]),
        ("project=sync-proj-1;zones=us-central1-a;colour=blue", "gce.colour", ["accepted", "zones"]),
    ],
)
def test_bad_gce_params_are_refused_naming_the_field(gce: str, field: str, words: list[str]) -> None:
    with pytest.raises(SpecError) as caught:
        job(gce=gce)
    assert caught.value.field == field, caught.value
    assert all(w in str(caught.value) for w in words), caught.value


def test_the_gce_param_belongs_to_the_gce_backend_and_needs_a_bucket() -> None:
    with pytest.raises(SpecError, match="^gce: only for cluster_backend 'gce'"):
        job(cluster_backend="local", bucket_dir="runs")
    with pytest.raises(SpecError, match="^bucket_dir: cluster_backend 'gce' needs a gs:// bucket"):
        job(bucket_dir="runs")
    with pytest.raises(SpecError, match="^gce: cluster_backend 'gce' needs the gce param"):
        job(gce="")


def test_the_gce_param_round_trips_through_the_job_params() -> None:
    spec = job(
        gce={"project": "sync-proj-1", "zones": ["us-central1-a"], "gpus": ["t4"], "spot": ["worker", "ps"]}
    )
    assert JobSpec.from_params(json.loads(json.dumps(spec.to_params()))) == spec


def test_shrinking_keeps_the_global_batch_so_steps_and_the_learning_rate_stay() -> None:
    spec = job(num_workers=4, gce="project=sync-proj-1;zones=us-central1-a")
    segment = spec.segment_spec(spec.plan_entries()[0], "r", "gs://b/runs/x")
    total = segment.global_batch()
    for active, expected in ((3, 2), (2, 2), (1, 1)):  # 3 does not divide 4 x batch: 2 workers
        shrunk = segment.on_workers(active)
        assert shrunk.num_workers == expected and shrunk.global_batch() == total
        assert shrunk.resolved_hparams().learning_rate == segment.resolved_hparams().learning_rate
    assert segment.on_workers(4) is segment


def test_the_vms_install_the_runtimes_locked_versions() -> None:
    """The metadata carries the runtime's requirements.txt (the lock's pins) and the installer that
    the hosts backend runs on its hosts (node_install.py), and the startup script runs that installer
    on them, never pip on a bare package name."""
    from syncswitch.layout import RunLayout
    from syncswitch.requirements import locked_versions, requirements_text
    from syncswitch_airflow.backends.gce_requests import STARTUP_SCRIPT, vm_metadata
    from syncswitch_airflow.backends.node_runtime import NODE_INSTALL_SCRIPT

    spec = job()
    metadata = vm_metadata(spec.gce, RunLayout("gs://b/runs/digits-demo/r-1"), "ssh-ed25519 AAAA k")
    assert metadata["syncswitch-requirements"] == requirements_text()
    assert metadata["syncswitch-install"] == NODE_INSTALL_SCRIPT.read_text()
    assert ("tensorflow-cpu", "2.21.0", False) in locked_versions()
    assert max(len(value.encode()) for value in metadata.values()) < 256 * 1024  # a value's limit
    assert sum(len(value.encode()) for value in metadata.values()) < 512 * 1024  # all of them
    script = STARTUP_SCRIPT.read_text()
    # pip installs one thing: the Airflow side's uv, pinned, where an image's python3 is not the lock's.
    pips = [
        i for i, line in enumerate(script.splitlines()) if "pip install" in line or "pip3 install" in line
    ]
    assert len(pips) == 1 and script.splitlines()[pips[0] + 1].strip() == '"$(attribute syncswitch-uv)"'
    assert metadata["syncswitch-uv"] == f"uv=={importlib.metadata.version('uv')}"
    assert 'attribute syncswitch-install > "$STAGE/node_install.py"' in script
    assert 'attribute syncswitch-requirements > "$STAGE/requirements.txt"' in script
    assert '--requirements "$STAGE/requirements.txt" --runtime "$(attribute syncswitch-runtime)"' in script
    # The user code's list where it has one (resolved by the backend), installed beside the pins.
    assert "syncswitch-user-requirements" not in metadata
    listed = "#   mnist1d==0.0.2.post1\nmnist1d==0.0.2.post1\n"
    with_list = vm_metadata(spec.gce, RunLayout("gs://b/runs/digits-demo/r-1"), "ssh-ed25519 AAAA k", listed)
    assert with_list["syncswitch-user-requirements"] == listed
    assert 'if attribute syncswitch-user-requirements > "$STAGE/user-requirements.txt"; then' in script
    assert '"${USER_REQUIREMENTS[@]}"' in script


def test_the_installer_replaces_only_the_runtime_of_a_venv_whose_requirements_are_in(
    gcs_bucket: str, tmp_path: Path
) -> None:
    """node_install.py on a fixed venv path (a VM's ``python``, an image), with the runtime's wheel
    from the bucket as the VMs fetch it: the first call makes the venv and installs the runtime as a
    distribution; a call with another build of it (same version) reinstalls only the runtime
    (TensorFlow's files untouched); the same call again does nothing."""
    from syncswitch import storage
    from syncswitch_airflow.backends.node_runtime import NODE_INSTALL_SCRIPT, RuntimeBundle

    bundle = RuntimeBundle.current()
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(bundle.requirements)
    venv = tmp_path / "opt" / "venv"

    def install(wheel: bytes) -> dict[str, Any]:
        uri = f"{gcs_bucket}/runs/job/r-{len(wheel)}/cluster/syncswitch-runtime.whl"  # the run layout's name
        storage.write_bytes(uri, wheel)
        argv = [sys.executable, str(NODE_INSTALL_SCRIPT), str(venv), "--requirements", str(requirements)]
        done = subprocess.run([*argv, "--runtime", uri], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert install(bundle.wheel.content)["installed"] == "all"
    site = next(venv.glob("lib/python3*/site-packages"))
    tensorflow = (site / "tensorflow" / "__init__.py").stat()
    assert not (site / "syncswitch" / "marker.txt").exists()
    python = str(venv / "bin" / "python")
    probe = "import importlib.metadata as m; print(m.version('syncswitch'), len(m.files('syncswitch')))"
    version, files = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    # An installed distribution (its metadata and RECORD), not loose files in site-packages.
    assert version == importlib.metadata.version("syncswitch") and int(files) > 10
    assert (venv / "bin" / "syncswitch").is_file()  # with its console script

    changed = io.BytesIO()  # this runtime with one file more: another build of the same version
    with zipfile.ZipFile(io.BytesIO(bundle.wheel.content)) as old, zipfile.ZipFile(changed, "w") as new:
        for entry in old.infolist():
            data = old.read(entry)
            if entry.filename.endswith(".dist-info/RECORD"):
                data += b"syncswitch/marker.txt,,\n"
            new.writestr(entry, data)
        new.writestr("syncswitch/marker.txt", b"another runtime\n")
    assert install(changed.getvalue())["installed"] == "runtime"
    assert (site / "syncswitch" / "marker.txt").read_bytes() == b"another runtime\n"
    assert (site / "tensorflow" / "__init__.py").stat().st_ino == tensorflow.st_ino
    assert install(changed.getvalue())["installed"] == ""

    # A folder that is not a virtualenv is never replaced (a VM's python= mistyped as a system one).
    system = tmp_path / "usr"
    (system / "bin").mkdir(parents=True)
    argv = [sys.executable, str(NODE_INSTALL_SCRIPT), str(system), "--requirements", str(requirements)]
    refused = subprocess.run([*argv, "--runtime", str(tmp_path / "none.whl")], capture_output=True, text=True)
    assert refused.returncode != 0 and "is not a virtualenv: refusing to replace it" in refused.stderr
    assert (system / "bin").is_dir()


def test_without_uv_the_runtime_wheel_is_installed_by_the_venvs_pip(tmp_path: Path) -> None:
    """An image without uv: the runtime's wheel goes in with the venv's own pip, under the file name
    pip requires (the bucket's is fixed); installed again at the same version, it is reinstalled.
    (The dependencies' pip install needs the registry and ~600 MB of TensorFlow: not run here.)"""
    from syncswitch_airflow.backends import node_install
    from syncswitch_airflow.backends.node_runtime import runtime_wheel

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    fetched = tmp_path / "syncswitch-runtime.whl"  # as fetch_runtime saves it from the bucket
    fetched.write_bytes(runtime_wheel().content)
    for attempt in (1, 2):
        node_install.install_runtime(python, node_install.wheel_named(str(fetched), str(tmp_path)), uv=None)
        listed = subprocess.run(
            [python, "-m", "pip", "show", "--files", "syncswitch"], capture_output=True, text=True, check=True
        ).stdout
        assert f"Version: {importlib.metadata.version('syncswitch')}" in listed, (attempt, listed)
        assert "syncswitch/forkserver.py" in listed
    assert (tmp_path / f"syncswitch-{importlib.metadata.version('syncswitch')}-py3-none-any.whl").is_file()


def test_the_runtime_wheel_is_reproducible_and_installable_as_a_distribution(tmp_path: Path) -> None:
    """The wheel the backends ship: the same files give the same bytes (its hash names the venv), every
    file of the installed package is in it with its RECORD hash, and its name is the installers'."""
    import base64
    import hashlib

    from syncswitch_airflow.backends.node_runtime import RUNTIME_PACKAGE, runtime_wheel

    wheel = runtime_wheel()
    assert runtime_wheel() == wheel
    version = importlib.metadata.version("syncswitch")
    assert wheel.filename == f"syncswitch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(wheel.content)) as archive:
        names = archive.namelist()
        info = f"syncswitch-{version}.dist-info"
        record = archive.read(f"{info}/RECORD").decode().splitlines()
        for line in record:
            name, hashed, size = line.rsplit(",", 2)
            if name == f"{info}/RECORD":
                continue
            data = archive.read(name)
            assert (
                hashed
                == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            )
            assert int(size) == len(data)
        assert "syncswitch = syncswitch.cli:main" in archive.read(f"{info}/entry_points.txt").decode()
        assert "Name: syncswitch" in archive.read(f"{info}/METADATA").decode()
    package = {
        f"syncswitch/{p.relative_to(RUNTIME_PACKAGE).as_posix()}"
        for p in RUNTIME_PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert package and package == {n for n in names if n.startswith("syncswitch/")}
    assert len(record) == len(names)


def test_the_installers_python_is_the_locks() -> None:
    """node_install.py makes venvs of the lock's lowest Python, which the suite runs on."""
    import tomllib

    from syncswitch_airflow.backends import node_install

    workspace = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert workspace["project"]["requires-python"].startswith(f">={node_install.PYTHON_VERSION},")


def test_a_gpu_nodes_cuda_tensorflow_at_the_locks_version_satisfies_the_cpu_pin() -> None:
    """GPU VMs (and GPU hosts that the hosts backend installs) take ``tensorflow[and-cuda]`` where the
    lock has ``tensorflow-cpu``: the version check accepts it at the same version, and only then."""
    from importlib import metadata

    from syncswitch.requirements import locked_versions, mismatches

    pins = {name: version for name, version, _ in locked_versions()}

    def gpu_node(version: str) -> Callable[[str], str]:
        def version_of(name: str) -> str:
            if name == "tensorflow-cpu":
                raise metadata.PackageNotFoundError(name)
            return version if name == "tensorflow" else pins.get(name, "0")

        return version_of

    assert not [m for m in mismatches(gpu_node(pins["tensorflow-cpu"])) if "tensorflow" in m]
    assert mismatches(gpu_node("2.20.0")) == [
        f"tensorflow-cpu: 2.20.0 installed, the lock has {pins['tensorflow-cpu']}"
    ]


def test_a_gpu_node_installs_the_cuda_build_and_its_libraries_at_the_locks_versions() -> None:
    """A GPU node's pins are the shipped requirements with tensorflow-cpu's line replaced by the
    ``#gpu:`` lines: every CUDA library pinned, nothing left to the installer's resolution."""
    from syncswitch.requirements import locked_versions, requirements_text
    from syncswitch_airflow.backends import node_install

    pins = node_install.gpu_pins(requirements_text()).splitlines()
    cpu = {name: version for name, version, _ in locked_versions()}
    assert f"tensorflow=={cpu['tensorflow-cpu']}" in pins
    assert not [line for line in pins if line.startswith(("tensorflow-cpu", node_install.GPU_PREFIX))]
    cuda = [line for line in pins if line.startswith("nvidia-")]
    assert cuda and all("==" in line for line in cuda), cuda
    shipped = [
        line for line in requirements_text().splitlines() if not line.startswith(("#", "tensorflow-cpu"))
    ]
    assert set(shipped) <= set(pins)  # every other pin as it is, markers too
    with pytest.raises(SystemExit, match="no #gpu: lines"):
        node_install.gpu_pins("tensorflow-cpu==2.21.0\nnumpy==2.0\n")
