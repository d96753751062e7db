"""The training runtime as cluster nodes install it: the ``syncswitch`` package and the lock's pins.

Two things make a node's runtime: the runtime package as the Airflow side has it installed (a tarball
of its folder, so an installed provider ships what it runs, not a checkout) and its dependencies at
the lock's versions (``syncswitch/requirements.txt``). One installer puts them on a node,
``node_install.py``: the gce backend's VMs run it at boot (``gce-startup.sh``, the runtime from the
run's bucket folder); with ``[syncswitch] hosts_runtime = install`` the hosts backend runs it on each
host over SSH, into ``<work_root>/runtime/<id>``: ``id`` is a hash of both, so a host keeps one venv
per version of the runtime, which every later run of that version reuses, and an upgrade gets a new
one beside it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import tarfile
from dataclasses import dataclass
from pathlib import Path

import syncswitch
from syncswitch.requirements import requirements_text

from syncswitch_airflow import settings
from syncswitch_airflow.backends.node_install import MARKER

__all__ = ["MARKER", "NODE_INSTALL_SCRIPT", "RuntimeBundle", "hosts_install_runtime", "runtime_tarball"]

RUNTIME_PACKAGE = Path(syncswitch.__file__).resolve().parent
NODE_INSTALL_SCRIPT = Path(__file__).resolve().with_name("node_install.py")

RUNTIME_SETTING = "hosts_runtime"
INSTALLED, INSTALL = "installed", "install"  # the hosts have it (checked) / the backend installs it


def hosts_install_runtime() -> bool:
    """Whether the hosts backend installs the runtime on its hosts (``[syncswitch] hosts_runtime``)."""
    return settings.get_choice(RUNTIME_SETTING, (INSTALLED, INSTALL)) == INSTALL


def runtime_tarball() -> bytes:
    """The runtime package, byte for byte the same for the same files (no times, owners or caches),
    so that its hash names its content."""

    def normalized(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name:
            return None
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed,
        tarfile.open(fileobj=packed, mode="w") as tar,
    ):
        tar.add(RUNTIME_PACKAGE, arcname="syncswitch", filter=normalized)
    return buffer.getvalue()


@dataclass(frozen=True)
class RuntimeBundle:
    """What a node installs: the runtime's tarball and the lock's requirements."""

    tarball: bytes
    requirements: str

    @classmethod
    def current(cls) -> RuntimeBundle:
        return cls(runtime_tarball(), requirements_text())

    @property
    def id(self) -> str:
        digest = hashlib.sha256(self.requirements.encode() + b"\0" + self.tarball)
        return digest.hexdigest()[:16]

    def venv(self, work_root: str) -> str:
        """Where a host with this ``work_root`` keeps this runtime."""
        return posixpath.join(work_root, "runtime", self.id)
