"""Compute Engine clusters: the ``gce`` job param and the VMs a run asks for.

The ``gce`` backend (``syncswitch_airflow.backends.gce``) creates these VMs, then uses them as the hosts
of a ``hosts`` cluster. This module says *which* VMs, and checks the request against the price
catalog (``syncswitch.costs``) before anything is created; it has no cloud client.

The ``gce`` param (a dict, or ``key=value`` text separated by ``;``)::

    project           the Google Cloud project (required)
    zones             one zone for every worker, or one per worker ("zone array"); the chief VM is worker
                      0's, the parameter servers run in the first zone
    machine_types     one machine type, or one per worker (default n1-standard-8)
    gpus              one GPU spec, or one per worker: "t4", "v100:2", "none" ("gpu array"); a type
                      Compute Engine has retired (the price table's retired_gpus: k80) is refused
    ps_machine_type   the parameter servers' machine type (default n1-standard-4), no GPU
    spot              roles on spot VMs: "worker" (default), "ps", or "none"; never "chief"
    network, subnetwork   the VPC (default "default"); VMs get internal addresses only
    image             boot image (default projects/debian-cloud/global/images/family/debian-12, whose
                      Python is the lock's; on an image with another Python, a Deep Learning VM image
                      with NVIDIA drivers for GPUs, the startup script installs uv first)
    python            <venv>/bin/python on the VMs: the virtualenv the startup script makes with the
                      runtime (backends/gce-startup.sh, node_install.py)
    ssh_user          the login the backend's per-run key is installed for (default syncswitch)
    max_run_seconds   the VMs' server-side time limit (maxRunDuration): a run whose teardown never
                      comes still ends (default 86400)
    on_revocation     replace: a revoked worker is replaced by a new VM; shrink: the next attempt runs
                      on the survivors, batch and LR recomputed from the active worker count
    disk_gb           boot disk size (default 50)

Placement. Worker 0 runs on the **chief VM**: the ASP coordinator and BSP worker 0, the only
checkpointer, so it is always on-demand (ICAC'19: never make the only checkpointer revocable). Workers
1..N-1 run on their own VMs, spot by default; parameter servers on on-demand VMs unless ``spot``
says ps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from syncswitch.costs import Catalog
from syncswitch.errors import SpecError

FIELD = "gce"
REVOCATION_POLICIES = ("replace", "shrink")
SPOT_ROLES = ("worker", "ps")
DEFAULT_IMAGE = "projects/debian-cloud/global/images/family/debian-12"
DEFAULT_PYTHON = "/opt/syncswitch/.venv/bin/python"
MAX_RUN_SECONDS = (600, 120 * 24 * 3600)  # what Compute Engine accepts, within reason
LABEL_JOB, LABEL_RUN, LABEL_ROLE, LABEL_EXPIRES = (
    "syncswitch-job",
    "syncswitch-run",
    "syncswitch-role",
    "syncswitch-expires",
)
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+\d+-[a-z]$")
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_RESOURCE_RE = re.compile(r"^[a-z0-9][-a-z0-9_./]*$")


@dataclass(frozen=True)
class GpuSpec:
    type: str = ""  # canonical accelerator type, "" = none
    count: int = 0

    def to_text(self) -> str:
        return f"{self.type}:{self.count}" if self.type else "none"


@dataclass(frozen=True)
class GceSpec:
    """The ``gce`` param, validated: see the module docstring."""

    project: str
    zones: tuple[str, ...]
    machine_types: tuple[str, ...] = ("n1-standard-8",)
    gpus: tuple[GpuSpec, ...] = (GpuSpec(),)
    ps_machine_type: str = "n1-standard-4"
    spot: tuple[str, ...] = ("worker",)
    network: str = "default"
    subnetwork: str = ""
    image: str = DEFAULT_IMAGE
    python: str = DEFAULT_PYTHON
    ssh_user: str = "syncswitch"
    max_run_seconds: int = 86400
    on_revocation: str = "replace"
    disk_gb: int = 50

    @classmethod
    def parse(cls, value: Any, num_workers: int, catalog: Catalog | None = None) -> GceSpec | None:
        """The ``gce`` param (dict, ``k=v;k=v`` text or a JSON object as text); None when empty."""
        pairs = _pairs(value)
        if not pairs:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(pairs) - known)
        if unknown:
            raise SpecError(f"{FIELD}.{unknown[0]}", f"unknown key; accepted: {', '.join(sorted(known))}")
        if not pairs.get("project"):
            raise SpecError(f"{FIELD}.project", "the Google Cloud project is required")
        if not pairs.get("zones"):
            raise SpecError(f"{FIELD}.zones", "at least one zone is required, e.g. us-central1-a")
        catalog = catalog or Catalog.load()
        defaults = {
            f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        }
        defaults["gpus"] = "none"
        get = lambda name: pairs.get(name) if pairs.get(name) not in (None, "", []) else defaults.get(name)  # noqa: E731
        spec = cls(
            project=str(pairs["project"]),
            zones=_per_worker("zones", get("zones"), num_workers),
            machine_types=_per_worker("machine_types", get("machine_types"), num_workers),
            gpus=tuple(
                _gpu(catalog, i, text) for i, text in enumerate(_per_worker("gpus", get("gpus"), num_workers))
            ),
            ps_machine_type=str(get("ps_machine_type")),
            spot=tuple(w for w in _words(get("spot")) if w != "none"),  # "none": all on-demand
            network=str(get("network")),
            subnetwork=str(get("subnetwork") or ""),
            image=str(get("image")),
            python=str(get("python")),
            ssh_user=str(get("ssh_user")),
            max_run_seconds=_int("max_run_seconds", get("max_run_seconds")),
            on_revocation=str(get("on_revocation")),
            disk_gb=_int("disk_gb", get("disk_gb")),
        )
        spec.validate(num_workers, catalog)
        return spec

    def validate(self, num_workers: int, catalog: Catalog) -> None:
        if not _PROJECT_RE.match(self.project):
            raise SpecError(f"{FIELD}.project", f"{self.project!r} is not a project id (6-30 of a-z 0-9 -)")
        for zone in self.zones:
            if not _ZONE_RE.match(zone):
                raise SpecError(f"{FIELD}.zones", f"{zone!r} is not a zone, e.g. us-central1-a")
        for i in range(num_workers):
            machine, zone, gpu = self.worker_machine(i), self.worker_zone(i), self.worker_gpu(i)
            try:
                catalog.check_vm(f"{FIELD}.machine_types", machine, zone)
                catalog.check_vm(f"{FIELD}.gpus", machine, zone, gpu.type, gpu.count)
            except SpecError as exc:
                raise SpecError(exc.field, f"worker {i}: {str(exc).split(': ', 1)[1]}") from None
        catalog.check_vm(f"{FIELD}.ps_machine_type", self.ps_machine_type, self.zones[0])
        for role in self.spot:
            if role == "chief":
                raise SpecError(
                    f"{FIELD}.spot",
                    "the chief is the only checkpointer and must not be revocable; accepted: worker, ps",
                )
            if role not in SPOT_ROLES:
                raise SpecError(f"{FIELD}.spot", f"{role!r} is not one of: {', '.join(SPOT_ROLES)}")
        for name in ("network", "subnetwork", "image"):
            value = getattr(self, name)
            if value and not _RESOURCE_RE.match(value):
                raise SpecError(f"{FIELD}.{name}", f"{value!r} is not a resource name or path")
        if not self.python.startswith("/") or any(c in self.python for c in " '\"$`\\\n"):
            raise SpecError(f"{FIELD}.python", "must be an absolute path without quotes or spaces")
        # The VMs' startup script makes (and may replace) the virtualenv this interpreter is in.
        venv, _, name = self.python.rpartition("/bin/")
        if name not in ("python", "python3") or venv.count("/") < 2:
            raise SpecError(
                f"{FIELD}.python",
                f"{self.python!r} must be a virtualenv's interpreter, /<folder>/<venv>/bin/python, "
                "which the VMs' startup script makes",
            )
        if not re.match(r"^[a-z_][a-z0-9_-]{0,31}$", self.ssh_user):
            raise SpecError(f"{FIELD}.ssh_user", f"{self.ssh_user!r} is not a valid user name")
        low, high = MAX_RUN_SECONDS
        if not low <= self.max_run_seconds <= high:
            raise SpecError(
                f"{FIELD}.max_run_seconds", f"must be in {low}..{high}, got {self.max_run_seconds}"
            )
        if self.on_revocation not in REVOCATION_POLICIES:
            raise SpecError(
                f"{FIELD}.on_revocation",
                f"{self.on_revocation!r} is not one of: {', '.join(REVOCATION_POLICIES)}",
            )
        if not 10 <= self.disk_gb <= 65536:
            raise SpecError(f"{FIELD}.disk_gb", f"must be in 10..65536, got {self.disk_gb}")

    def worker_zone(self, i: int) -> str:
        return self.zones[i] if len(self.zones) > 1 else self.zones[0]

    def worker_machine(self, i: int) -> str:
        return self.machine_types[i] if len(self.machine_types) > 1 else self.machine_types[0]

    def worker_gpu(self, i: int) -> GpuSpec:
        return self.gpus[i] if len(self.gpus) > 1 else self.gpus[0]

    def to_params(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gpus"] = [g.to_text() for g in self.gpus]
        for key in ("zones", "machine_types", "spot"):
            data[key] = list(data[key])
        data["spot"] = data["spot"] or ["none"]  # empty would read back as the default
        return data


# ---- the VMs of a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VmPlan:
    """One VM of a run's cluster, before it exists."""

    name: str
    role: str  # chief | worker | ps
    task: int  # worker i, ps j (the chief VM is worker 0)
    host_role: str  # the role its host plays in the hosts backend's placement (syncswitch.hosts)
    zone: str
    machine_type: str
    gpu: GpuSpec
    spot: bool

    def to_dict(self) -> dict[str, Any]:
        """The VM's record as state.json's ``vms`` and the gce handle's ``plan`` keep it (syncswitch.state):
        flat, its GPU as ``gpu_type`` and ``gpu_count``; ``host_role`` is left out, as ``role`` decides it."""
        record = dataclasses.asdict(self)
        gpu = record.pop("gpu")
        del record["host_role"]
        return record | {"gpu_type": gpu["type"], "gpu_count": gpu["count"]}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> VmPlan:
        """The VM a record describes (:meth:`to_dict`'s; what state.json adds to it, its state and
        times, is not the plan's and is ignored)."""
        flat = {f.name: record[f.name] for f in dataclasses.fields(cls) if f.name not in ("gpu", "host_role")}
        gpu = GpuSpec(record.get("gpu_type", ""), int(record.get("gpu_count", 0)))
        return cls(**flat | {"spot": bool(record["spot"])}, host_role=host_role(record["role"]), gpu=gpu)

    def replacement(self, attempt: int) -> VmPlan:
        """The VM that replaces this one after its ``attempt``-th revocation (a new name: the revoked
        one may still be shutting down, and the ledger keeps both)."""
        base = re.sub(r"-r\d+$", "", self.name)
        return dataclasses.replace(self, name=f"{base}-r{attempt}")


def host_role(role: str) -> str:
    """The role a VM's host plays in the hosts backend's placement: parameter servers on their own
    VMs; any other VM takes worker i in both protocols (the chief VM first: worker 0)."""
    return "ps" if role == "ps" else "any"


def run_label(run_key: str) -> str:
    """A label value for a run id: Airflow run ids have ':' and '+', labels take [a-z0-9_-]{0,63}."""
    readable = re.sub(r"[^a-z0-9_-]", "-", run_key.lower()).strip("-")[:50]
    return f"{readable}-{hashlib.sha1(run_key.encode()).hexdigest()[:8]}"


def vm_plan(spec: GceSpec, job_name: str, run_key: str, num_workers: int, num_ps: int) -> list[VmPlan]:
    """The chief VM (worker 0, on-demand), one VM per other worker, one per parameter server."""
    prefix = f"ss-{job_name[:30]}-{hashlib.sha1(run_key.encode()).hexdigest()[:6]}".rstrip("-")
    vms = [
        VmPlan(
            name=f"{prefix}-chief" if i == 0 else f"{prefix}-w{i}",
            role="chief" if i == 0 else "worker",
            task=i,
            host_role=host_role("chief" if i == 0 else "worker"),
            zone=spec.worker_zone(i),
            machine_type=spec.worker_machine(i),
            gpu=spec.worker_gpu(i),
            spot=i > 0 and "worker" in spec.spot,
        )
        for i in range(num_workers)
    ]
    vms += [
        VmPlan(
            name=f"{prefix}-ps{j}",
            role="ps",
            task=j,
            host_role=host_role("ps"),
            zone=spec.zones[0],
            machine_type=spec.ps_machine_type,
            gpu=GpuSpec(),
            spot="ps" in spec.spot,
        )
        for j in range(num_ps)
    ]
    for vm in vms:
        if not _NAME_RE.match(vm.name):
            raise SpecError("job_name", f"makes the VM name {vm.name!r}, which Compute Engine refuses")
    return vms


# ---- field parsers ----------------------------------------------------------------------------------


def _pairs(value: Any) -> dict[str, Any]:
    import json

    if value in (None, "", {}, []):
        return {}
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                return _pairs(json.loads(text))
            except ValueError as exc:
                raise SpecError(FIELD, f"is not a valid JSON object: {exc}") from None
        pairs: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            key, sep, item = part.partition("=")
            if not sep:
                raise SpecError(FIELD, f"malformed item {part!r}; expected key=value;key=value")
            pairs[key.strip()] = item.strip()
        return pairs
    raise SpecError(FIELD, f"must be a dict or 'key=value;...' text, got {value!r}")


def _words(value: Any) -> list[str]:
    if isinstance(value, list | tuple):
        return [str(v).strip() for v in value if str(v).strip()]
    return [w for w in re.split(r"[\s,]+", str(value or "")) if w]


def _per_worker(name: str, value: Any, num_workers: int) -> tuple[str, ...]:
    items = _words(value)
    if len(items) not in (1, num_workers):
        raise SpecError(
            f"{FIELD}.{name}",
            f"has {len(items)} values but num_workers is {num_workers}; give one for all or one per worker",
        )
    return tuple(items)


def _gpu(catalog: Catalog, worker: int, text: str) -> GpuSpec:
    kind, _, count = text.partition(":")
    field = f"{FIELD}.gpus"
    try:
        canonical = catalog.gpu_type(field, kind)
        catalog.check_offered(field, kind)  # a retired type: named, with the current ones
    except SpecError as exc:
        raise SpecError(field, f"worker {worker}: {str(exc).split(': ', 1)[1]}") from None
    if not canonical:
        return GpuSpec()
    try:
        number = int(count or 1)
    except ValueError:
        raise SpecError(field, f"worker {worker}: count in {text!r} must be an integer") from None
    return GpuSpec(canonical, number)


def _int(name: str, value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise SpecError(f"{FIELD}.{name}", f"must be an integer, got {value!r}") from None
