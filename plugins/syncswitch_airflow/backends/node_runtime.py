"""The training runtime as cluster nodes install it: the ``syncswitch`` wheel and the lock's pins.

Two things make a node's runtime: the runtime distribution as the Airflow side has it installed (a
wheel made from its installed files and metadata, so an installed provider ships what it runs, and
a checkout its working tree) and its dependencies at the lock's versions
(``syncswitch/requirements.txt``); a job whose user code lists its own requirements adds a third,
that list as resolved against the pins (``user_requirements.py``). One installer puts them on a node,
``node_install.py``: the gce backend's VMs run it at boot (``gce-startup.sh``, the wheel from the
run's bucket folder); with ``[syncswitch] hosts_runtime = install`` the hosts backend runs it on each
host over SSH, into ``<work_root>/runtime/<id>``: ``id`` is a hash of all three, so a host keeps one
venv per version of the runtime and of the user's list, which every later run of the same reuses,
and an upgrade or a changed list gets a new one beside it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import posixpath
import zipfile
from dataclasses import dataclass
from pathlib import Path

import syncswitch
from syncswitch.requirements import requirements_text

from syncswitch_airflow import settings
from syncswitch_airflow.backends.node_install import MARKER

__all__ = [
    "MARKER",
    "NODE_INSTALL_SCRIPT",
    "RuntimeBundle",
    "RuntimeWheel",
    "hosts_install_runtime",
    "runtime_wheel",
]

RUNTIME_PACKAGE = Path(syncswitch.__file__).resolve().parent
RUNTIME_DISTRIBUTION = "syncswitch"
# Zip entries carry a time: a fixed one, so that the same files make the same bytes (and id).
_WHEEL_ENTRY_TIME = (1980, 1, 1, 0, 0, 0)
_WHEEL_FILE = (
    "Wheel-Version: 1.0\nGenerator: syncswitch-node-runtime\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
)
NODE_INSTALL_SCRIPT = Path(__file__).resolve().with_name("node_install.py")

RUNTIME_SETTING = "hosts_runtime"
INSTALLED, INSTALL = "installed", "install"  # the hosts have it (checked) / the backend installs it


def hosts_install_runtime() -> bool:
    """Whether the hosts backend installs the runtime on its hosts (``[syncswitch] hosts_runtime``)."""
    return settings.get_choice(RUNTIME_SETTING, (INSTALLED, INSTALL)) == INSTALL


@dataclass(frozen=True)
class RuntimeWheel:
    """The runtime as a wheel file: its name (what an installer requires) and its bytes."""

    filename: str
    content: bytes


def runtime_wheel() -> RuntimeWheel:
    """The installed runtime as a py3-none-any wheel: its package's files (no caches), its installed
    metadata and entry points, a RECORD of their hashes. The same files give the same bytes, so that
    their hash names the content."""
    dist = importlib.metadata.distribution(RUNTIME_DISTRIBUTION)
    info = f"{RUNTIME_DISTRIBUTION}-{dist.version}.dist-info"
    files = {
        f"{RUNTIME_PACKAGE.name}/{path.relative_to(RUNTIME_PACKAGE).as_posix()}": path.read_bytes()
        for path in sorted(RUNTIME_PACKAGE.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }
    files[f"{info}/METADATA"] = (dist.read_text("METADATA") or "").encode()
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points.encode()
    files[f"{info}/WHEEL"] = _WHEEL_FILE.encode()
    files[f"{info}/RECORD"] = (
        "".join(f"{name},sha256={_record_hash(data)},{len(data)}\n" for name, data in files.items())
        + f"{info}/RECORD,,\n"
    ).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=_WHEEL_ENTRY_TIME)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(entry, data)
    return RuntimeWheel(f"{RUNTIME_DISTRIBUTION}-{dist.version}-py3-none-any.whl", buffer.getvalue())


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class RuntimeBundle:
    """What a node installs: the runtime's wheel, the lock's requirements and a user model's resolved
    requirements ("" for none)."""

    wheel: RuntimeWheel
    requirements: str
    user_requirements: str = ""

    @classmethod
    def current(cls, user_requirements: str = "") -> RuntimeBundle:
        return cls(runtime_wheel(), requirements_text(), user_requirements)

    @property
    def id(self) -> str:
        parts = [self.requirements.encode()]
        if self.user_requirements:  # without one, the id of the runtime alone: its venvs stay valid
            parts.append(self.user_requirements.encode())
        digest = hashlib.sha256(b"\0".join([*parts, self.wheel.content]))
        return digest.hexdigest()[:16]

    def venv(self, work_root: str) -> str:
        """Where a host with this ``work_root`` keeps this runtime."""
        return posixpath.join(work_root, "runtime", self.id)
