"""Node logs come home: every node's log in the run folder, ``logs/<segment>/<role>-<task>.log``
(``RunLayout.node_log``), however its segment ends and whatever becomes of its host.

A node writes its log on its own host (the fork server points the node's output at it), where a
lost host or a deleted VM takes it away. So three parties bring it home:

- **the launcher** (``NodeLogs``), as its segment runs: it reads the logs of the nodes on its own
  host where they are, and keeps a copy of each other node's, asking that node's fork server for
  what was added every PULL_SECONDS; at the segment's end or failure it uploads them all. A node
  whose host was lost is uploaded as far as the copy goes, and its last lines name it in the
  failure (``failure_report``);
- **the teardown** of every backend (``upload_folder``, ``python -m syncswitch.nodelogs upload``
  on each host, each VM before its deletion): whatever a cluster folder holds that the bucket does
  not (a launcher killed before its upload, a host back after its loss, the launchers' own logs as
  ``launcher-0.log``), compared by size, so a log uploaded whole is not sent again.

A log is uploaded whole each time: the latest copy replaces the one before (a retried segment's
nodes append to the same files, so the latest holds every try on that host).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from syncswitch import forkserver_client, storage
from syncswitch.layout import RunLayout

PULL_SECONDS = 3.0
PULL_TIMEOUT_S = 3.0  # a host that does not answer a pull this fast is skipped until the next
TAIL_LINES = 20
TAIL_BYTES = 64 * 1024  # where the last lines of a log are looked for
UPLOAD_RETRY_S = 10.0
# The logs a segment folder holds: its nodes' and its launcher's (not a link delay's, a fork server's).
LOG_NAME = re.compile(r"(chief|worker|ps)-\d+\.log")
LAUNCHER_LOG = "launcher.log"  # syncswitch.supervise's, in a launch's folder
LAUNCHER_NAME = "launcher-0"
# A folder's segment spec: the launch's (spec.json, beside launcher.log), the launcher's work folder's
# (segment.json, beside the nodes of its host) and another host's (segment.json, beside its nodes).
SPEC_FILES = ("spec.json", "segment.json")


class LoggedNode(Protocol):
    """What NodeLogs needs of a launcher's node (syncswitch.launcher.Node)."""

    name: str
    log_path: str
    server: forkserver_client.ServerRef

    @property
    def remote(self) -> bool: ...


@dataclass
class Copy:
    """The launcher's copy of a node's log on another host, and how far it goes."""

    path: str
    offset: int = 0
    unreachable: bool = False  # its server did not answer the last pull
    lock: threading.Lock = field(default_factory=threading.Lock)


def last_lines(path: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a file (none where it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - TAIL_BYTES, 0))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


class NodeLogs:
    """A segment's node logs as its launcher has them: where each is readable here, copies of those on
    other hosts kept current by a thread, and their upload into the run folder."""

    def __init__(self, work_dir: str, nodes: Sequence[LoggedNode]) -> None:
        self.nodes = list(nodes)
        self.copies = {
            node.name: Copy(os.path.join(work_dir, "node-logs", f"{node.name}.log"))
            for node in self.nodes
            if node.remote
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, node: LoggedNode) -> str:
        """Where ``node``'s log is readable on this host."""
        copy = self.copies.get(node.name)
        return copy.path if copy is not None else node.log_path

    def tail(self, node: LoggedNode, lines: int = TAIL_LINES) -> list[str]:
        return last_lines(self.path(node), lines)

    # -- copies of the logs on other hosts --

    def start(self) -> None:
        """Pull the other hosts' logs every PULL_SECONDS until ``stop``."""
        if self.copies:
            os.makedirs(os.path.dirname(next(iter(self.copies.values())).path), exist_ok=True)
            self._thread = threading.Thread(target=self._pull_loop, name="node-logs", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PULL_TIMEOUT_S * 2)

    def _pull_loop(self) -> None:
        while not self._stop.wait(PULL_SECONDS):
            self.pull_all()

    def pull_all(self, skip: Iterable[str] = ()) -> None:
        """Bring every copy up to date, but those of the nodes named in ``skip`` (lost with their host:
        a pull would only wait out its timeout)."""
        skipped = set(skip)
        for node in self.nodes:
            if node.name in self.copies and node.name not in skipped:
                self.pull(node)

    def pull(self, node: LoggedNode) -> None:
        """Append what ``node``'s log gained since the last pull to its copy."""
        copy = self.copies[node.name]
        with copy.lock:
            try:
                while True:
                    data, offset = forkserver_client.read_log(
                        node.server, node.log_path, copy.offset, timeout=PULL_TIMEOUT_S
                    )
                    if not data:
                        break
                    with open(copy.path, "ab") as f:
                        f.write(data)
                    copy.offset = offset
            except forkserver_client.ForkServerUnavailable:
                copy.unreachable = True
                return
            copy.unreachable = False

    # -- home --

    def upload(self, layout: RunLayout, index: int, protocol: str) -> list[str]:
        """Upload every node's log (as far as this host has it) to the run folder; the URIs written.
        A log that cannot be uploaded is named on stderr, not raised: the segment's outcome stands."""
        written = []
        for node in self.nodes:
            uri = layout.node_log(index, protocol, node.name)
            if upload_if_present(self.path(node), uri):
                written.append(uri)
        return written


def upload_if_present(path: str, uri: str) -> bool:
    """Upload the file ``path`` to ``uri``; False where it is missing or the bucket does not take it
    within UPLOAD_RETRY_S (the teardown tries again: a segment's end must not wait out an outage)."""
    if not os.path.isfile(path):
        return False
    try:
        storage.upload_file(path, uri, retry_seconds=UPLOAD_RETRY_S)
    except (OSError, storage.BucketUnavailable) as exc:
        print(f"nodelogs: {path} not uploaded to {uri}: {exc}", file=sys.stderr, flush=True)
        return False
    return True


# ---- teardown: what a cluster folder holds ---------------------------------------------------------


def folder_logs(work_dir: str) -> list[tuple[str, str]]:
    """(local path, run folder URI) of every node and launcher log in the cluster folder ``work_dir``:
    each folder under ``segments/`` with a segment spec names the segment its logs belong to."""
    found = []
    segments = os.path.join(work_dir, "segments")
    for root, _dirs, files in os.walk(segments):
        spec = _segment_of(root, files)
        if spec is None:
            continue
        layout = RunLayout(spec["run_dir"])
        for name in sorted(files):
            if name != LAUNCHER_LOG and not LOG_NAME.fullmatch(name):
                continue
            node = LAUNCHER_NAME if name == LAUNCHER_LOG else name.removesuffix(".log")
            found.append((os.path.join(root, name), layout.node_log(spec["index"], spec["protocol"], node)))
    return found


def _segment_of(folder: str, files: list[str]) -> dict[str, Any] | None:
    for name in SPEC_FILES:
        if name in files:
            spec = storage.read_json(os.path.join(folder, name), default=None)
            if isinstance(spec, dict) and {"run_dir", "index", "protocol"} <= spec.keys():
                return spec
    return None


def upload_folder(work_dir: str) -> list[str]:
    """Upload each log of the cluster folder ``work_dir`` whose copy in the run folder is missing or
    of another size (what its launcher could not upload); the URIs written."""
    logs = folder_logs(work_dir)
    sizes: dict[str, int] = {}
    for folder in {uri.rsplit("/", 1)[0] for _, uri in logs}:
        sizes.update(_sizes(folder))
    return [uri for path, uri in logs if sizes.get(uri) != _size(path) and upload_if_present(path, uri)]


def _sizes(folder: str) -> dict[str, int]:
    try:
        return storage.file_sizes(folder, suffix=".log")
    except (OSError, storage.BucketUnavailable):
        return {}


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncswitch.nodelogs")
    verbs = parser.add_subparsers(dest="verb", required=True)
    upload = verbs.add_parser("upload", help="upload the logs of a cluster folder the run folder lacks")
    upload.add_argument("work_dir")
    args = parser.parse_args(argv)
    print(json.dumps({"uploaded": upload_folder(args.work_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
