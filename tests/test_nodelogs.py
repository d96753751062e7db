"""Node logs' rules without a cluster: which node failed first, a log's last lines, and where each log
of a cluster folder goes in the run folder (syncswitch.nodelogs, syncswitch.launcher.first_failed).
The real thing: test_runtime_cluster (a killed BSP worker), test_hosts_backend (a lost host),
test_backend_local and test_gce_backend (teardown)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from syncswitch import forkserver_client
from syncswitch.launcher import Node, first_failed
from syncswitch.layout import RunLayout
from syncswitch.nodelogs import folder_logs, last_lines


@dataclass
class Ended:
    """A node process that has ended with ``code`` (``lost``: its server went without a word)."""

    code: int | None
    lost: bool = False

    def poll(self) -> int | None:
        return self.code


def node(name: str, code: int | None, ended_at: float, *, lost: bool = False) -> Node:
    role, task = name.rsplit("-", 1)
    made = Node(role, int(task), "127.0.0.1:1", forkserver_client.ServerRef(server_dir="/nowhere"))
    made.process = Ended(code, lost)  # type: ignore[assignment] - poll() and lost are all it needs
    made.ended_at = ended_at
    return made


def test_the_node_that_failed_first_is_the_lost_one_then_a_killed_one_then_by_time() -> None:
    chief, worker_1 = node("worker-0", 1, 1.0), node("worker-1", 1, 2.0)
    lost = node("worker-2", -9, 3.0, lost=True)
    # The chief's collectives aborted first, a peer with it; the lost host's lease timed out last.
    assert first_failed([chief, worker_1, lost]) is lost
    killed = node("worker-2", -9, 3.0)
    assert first_failed([chief, worker_1, killed]) is killed  # a signal before an error exit
    assert first_failed([node("worker-0", 1, 2.0), node("worker-1", 1, 1.0)]).name == "worker-1"
    assert first_failed([node("worker-0", None, 0.0), node("worker-1", 0, 1.0)]) is None
    stopped = node("worker-1", -9, 0.5)
    stopped.stopped_here = True  # the launcher's own stop (a stalled worker, the segment's end)
    assert first_failed([chief, stopped]) is chief


def test_an_asp_worker_the_segment_went_on_without_is_not_why_it_failed() -> None:
    gone_worker, ps = node("worker-1", -9, 1.0), node("ps-0", -9, 5.0)
    assert first_failed([gone_worker, ps], tolerated={"worker-1"}) is ps
    assert first_failed([gone_worker], tolerated={"worker-1"}) is gone_worker  # every worker gone


def test_last_lines_read_only_the_end_of_a_long_log(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert last_lines(str(log), 3) == ["line 99997", "line 99998", "line 99999"]
    assert last_lines(str(tmp_path / "missing.log")) == []


def test_a_cluster_folders_logs_go_to_their_segments_folder(tmp_path: Path) -> None:
    """A launch's folder (spec.json, launcher.log), its launcher's work folder (segment.json and the
    nodes of its host) and another host's segment folder (segment.json and its nodes) each name the
    segment their logs belong to; a link delay's log, the launcher's copies and a folder without a
    spec are left out."""
    run = RunLayout(str(tmp_path / "run"))
    work = tmp_path / "work"
    spec = {"run_dir": run.root, "index": 2, "protocol": "bsp"}
    chief_seg, other_seg = work / "segments" / "seg-02", work / "segments" / "seg-03"
    for folder, name in ((chief_seg, "spec.json"), (chief_seg / "scratch", "segment.json")):
        folder.mkdir(parents=True)
        (folder / name).write_text(json.dumps(spec))
    other_seg.mkdir()
    (other_seg / "segment.json").write_text(json.dumps({**spec, "index": 3, "protocol": "asp"}))
    (chief_seg / "launcher.log").write_text("x")
    (chief_seg / "scratch" / "node-logs").mkdir()
    for path in (
        chief_seg / "scratch" / "worker-0.log",
        chief_seg / "scratch" / "linkdelay-1.log",
        chief_seg / "scratch" / "node-logs" / "worker-1.log",
        other_seg / "worker-1.log",
        other_seg / "ps-0.log",
        work / "segments" / "worker-9.log",
    ):
        path.write_text("x")
    assert sorted(uri for _, uri in folder_logs(str(work))) == sorted(
        [
            run.node_log(2, "bsp", "launcher-0"),
            run.node_log(2, "bsp", "worker-0"),
            run.node_log(3, "asp", "ps-0"),
            run.node_log(3, "asp", "worker-1"),
        ]
    )
    assert run.node_log(2, "bsp", "worker-0") == f"{run.root}/logs/seg-02-bsp/worker-0.log"
