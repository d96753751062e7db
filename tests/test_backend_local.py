"""The local cluster backend with real processes: launch detached, status, stop, teardown."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proc_utils import assert_no_processes, find_processes, wait_for
from syncswitch import forkserver, forkserver_client, procs, supervise
from syncswitch.errors import SpecError
from syncswitch.layout import RunLayout
from syncswitch.procs import processes_with_env
from syncswitch.registry import Registry
from syncswitch.spec import JobSpec
from syncswitch_airflow.backends import ClusterError, SegmentAlreadyRunning, get_backend
from syncswitch_airflow.backends.base import CLUSTER_ENV, EXITED, RUNNING, UNKNOWN
from syncswitch_airflow.backends.local import IDLE_CLUSTER_GONE_S, LocalBackend, StandbyForkServer

# A child that stays in the launcher's process group, and one that escapes it with setsid(): teardown
# must find both. Each writes nothing; the parent writes READY once both exist.
FAMILY = """
import subprocess, sys, time
tag, ready = sys.argv[1], sys.argv[2]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)", tag]
subprocess.Popen(sleeper)
subprocess.Popen(sleeper, start_new_session=True)
open(ready, "w").close()
time.sleep(600)
"""

GRACEFUL = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write("stopped by signal %d" % signum)
    sys.exit(7)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[2], "w").close()
time.sleep(600)
"""


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(work_root=str(tmp_path / "work"))


@pytest.fixture
def handle(backend: LocalBackend, tmp_path: Path) -> dict:
    layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", "manual__2026-01-01T00:00:00+00:00")
    handle = backend.provision(JobSpec(job_name="demo"), layout)
    yield handle
    backend.teardown(handle)


def test_get_backend_names_the_known_backends() -> None:
    assert isinstance(get_backend("local"), LocalBackend)
    assert get_backend("gce").name == "gce" and get_backend("hosts").name == "hosts"
    accepted = "accepted: gce, hosts, local"
    with pytest.raises(ClusterError, match=f"^cluster_backend: unknown 'slurm'; {accepted}"):
        get_backend("slurm")
    # The job spec validates against the same registry, before anything is provisioned.
    with pytest.raises(SpecError, match=f"^cluster_backend: unknown 'slurm'; {accepted}"):
        JobSpec.from_params({"job_name": "demo", "cluster_backend": "slurm"})


def test_the_backend_protocol_imports_no_backend_and_installed_packages_add_backends(tmp_path: Path) -> None:
    code = (
        "import sys, syncswitch_airflow.backends; "
        "print(sorted(m for m in sys.modules if m.startswith('syncswitch_airflow.backends.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['syncswitch_airflow.backends.base']"]
    # A package's entry point names a backend as a built-in is named (a .dist-info folder on sys.path).
    dist_info = tmp_path / "slurmpkg-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: slurmpkg\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[syncswitch.backends]\nslurm = slurmpkg:SlurmBackend\n")
    (tmp_path / "slurmpkg.py").write_text("class SlurmBackend:\n    name = 'slurm'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        registry = Registry()
        assert registry.names("backend") == ["gce", "hosts", "local", "slurm"]
        assert registry.sources()["backend"]["slurm"] == "entry point of slurmpkg 0.1"
        assert registry.entry("backend", "slurm").load()().name == "slurm"
    finally:
        sys.path.remove(str(tmp_path))


def test_provision_creates_the_work_folder_idempotently(backend: LocalBackend, tmp_path: Path) -> None:
    layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", "manual__2026-01-01T00:00:00+00:00")
    handle = backend.provision(JobSpec(job_name="demo"), layout)
    assert handle["backend"] == "local" and handle["run_dir"] == layout.root
    assert Path(handle["work_dir"]).parent == tmp_path / "work"
    assert (Path(handle["work_dir"]) / "cluster.json").exists()
    assert handle["processes"] == 1 + 2 + 1  # chief + 2 workers + 1 PS
    assert backend.provision(JobSpec(job_name="demo"), layout) == handle
    backend.teardown(handle)
    assert not Path(handle["work_dir"]).exists()
    backend.teardown(handle)  # idempotent


def test_provision_refuses_a_cluster_that_does_not_fit_in_memory(tmp_path: Path) -> None:
    greedy = LocalBackend(work_root=str(tmp_path / "work"), gb_per_process=100_000)
    layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", "r1")
    # chief + 2 workers + 1 PS, and the fork server
    with pytest.raises(ClusterError, match=r"needs about .* GB \(5 TensorFlow processes"):
        greedy.provision(JobSpec(job_name="demo"), layout)
    # No cluster folder, and its cluster slot was given back.
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["leases"]
    assert greedy.capacity().holders() == []


def test_status_follows_the_launcher_to_its_exit_code(backend: LocalBackend, handle: dict) -> None:
    assert backend.segment_status(handle, 0).state == UNKNOWN
    record = backend.launch_command(
        handle,
        0,
        [sys.executable, "-c", "import sys, time; print('hello'); time.sleep(1); sys.exit(3)"],
        {"spec.json": "first"},
    )
    assert backend.segment_status(handle, 0).state == RUNNING
    spec_file = Path(backend.segment_dir(handle, 0)) / "spec.json"
    with pytest.raises(ClusterError, match="already running"):
        backend.launch_command(handle, 0, [sys.executable, "-c", "pass"], {"spec.json": "second"})
    assert spec_file.read_text() == "first"  # a refused launch writes nothing
    # Nobody reaps the wrapper here (as under `dags test`): a zombie must count as exited.
    wait_for(lambda: backend.segment_status(handle, 0).state == EXITED, what="exit")
    status = backend.segment_status(handle, 0)
    assert (status.exit_code, status.pid) == (3, record["pid"])
    assert "hello" in backend.segment_log_tail(handle, 0)
    # A relaunch of the same segment (an Airflow retry) starts clean.
    backend.launch_command(handle, 0, [sys.executable, "-c", "pass"])
    wait_for(lambda: backend.segment_status(handle, 0).state == EXITED, what="second exit")
    assert backend.segment_status(handle, 0).exit_code == 0


def test_a_launch_that_needs_listening_servers_starts_only_a_first_launch_while_they_listen(
    tmp_path: Path,
) -> None:
    """What the hosts backend's launches ask of the chief: nothing is written or started unless every
    named address accepts a connection, and never for a relaunch (its caller looks for itself)."""
    seg_dir, marker = str(tmp_path / "seg-00"), "SYNCSWITCH_TEST_SEGMENT"
    env = {**os.environ, marker: seg_dir}
    command = [sys.executable, "-c", "pass"]
    with socket.socket() as server, socket.socket() as closed:
        server.bind(("127.0.0.1", 0))
        server.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        live = f"127.0.0.1:{server.getsockname()[1]}"
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(supervise.NotChecked, match=f"nothing accepts a connection at {gone}"):
            supervise.launch(seg_dir, command, env, marker, {"spec.json": "x"}, listening=(live, gone))
        assert sorted(os.listdir(seg_dir)) == ["launch.lock"]  # nothing written
        supervise.launch(seg_dir, command, env, marker, {"spec.json": "x"}, listening=(live,))
        wait_for(lambda: supervise.status(seg_dir, marker)["state"] == supervise.EXITED, what="exit")
        with pytest.raises(supervise.NotChecked, match="a relaunch"):
            supervise.launch(seg_dir, command, env, marker, listening=(live,))
    supervise.launch(seg_dir, command, env, marker)  # a relaunch its caller has looked at
    wait_for(lambda: supervise.status(seg_dir, marker)["state"] == supervise.EXITED, what="exit")
    assert supervise.status(seg_dir, marker)["exit_code"] == 0


def test_launches_of_one_segment_at_once_start_it_once(
    backend: LocalBackend, handle: dict, tmp_path: Path
) -> None:
    """The trigger of the segment before and the segment's own task (or its retry) may launch it at
    the same moment: one starts it, every other is refused as already running and starts nothing."""
    marker = str(tmp_path / "once")
    command = [sys.executable, "-c", "import time; time.sleep(30)", marker]
    start = threading.Barrier(6)

    def launch() -> str:
        start.wait()
        try:
            return str(backend.launch_command(handle, 2, command)["pid"])
        except SegmentAlreadyRunning:
            return "refused"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(lambda _: launch(), range(6)))
    assert outcomes.count("refused") == 5, outcomes
    # The started wrapper may still be inside its exec, its command line not readable yet.
    wrappers = rf"syncswitch\.supervise wrap .*{re.escape(marker)}"
    wait_for(lambda: find_processes(wrappers), what="the started wrapper")
    assert len(find_processes(wrappers)) == 1
    backend.stop_segment(handle, 2, grace_seconds=1.0)


def test_a_launcher_killed_hard_has_no_exit_code(backend: LocalBackend, handle: dict, tmp_path: Path) -> None:
    record = backend.launch_command(
        handle, 1, [sys.executable, "-c", "import time; time.sleep(600)", str(tmp_path)]
    )
    os.killpg(record["pgid"], signal.SIGKILL)
    wait_for(lambda: backend.segment_status(handle, 1).state == EXITED, what="exit")
    assert backend.segment_status(handle, 1).exit_code is None


def test_an_orphaned_launcher_still_counts_as_running(backend: LocalBackend, handle: dict) -> None:
    record = backend.launch_command(handle, 3, [sys.executable, "-c", "import time; time.sleep(2)"])
    wait_for(lambda: len(find_processes(r"import time; time.sleep\(2\)")) >= 2, what="launcher start")
    os.kill(record["pid"], signal.SIGKILL)  # the wrapper only: the launcher goes on, orphaned
    wait_for(lambda: backend.segment_status(handle, 3).pid != record["pid"], what="wrapper death")
    assert backend.segment_status(handle, 3).state == RUNNING
    wait_for(lambda: backend.segment_status(handle, 3).state == EXITED, what="orphan exit")
    assert backend.segment_status(handle, 3).exit_code is None


def test_stop_segment_lets_the_launcher_stop_gracefully(
    backend: LocalBackend, handle: dict, tmp_path: Path
) -> None:
    stopped, ready = tmp_path / "stopped", tmp_path / "ready"
    backend.launch_command(handle, 2, [sys.executable, "-c", GRACEFUL, str(stopped), str(ready)])
    wait_for(ready.exists, what="launcher start")
    backend.stop_segment(handle, 2, grace_seconds=10)
    assert stopped.read_text() == f"stopped by signal {signal.SIGTERM.value}"
    assert backend.segment_status(handle, 2).exit_code == 7
    assert_no_processes(re.escape(str(stopped)), timeout=0)


def test_teardown_kills_every_process_of_the_run_and_nothing_else(
    backend: LocalBackend, handle: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCSWITCH_LOCAL_CLUSTERS", "2")  # two runs' clusters side by side
    tag = str(tmp_path / "family")
    other_tag = str(tmp_path / "other-run")
    other_layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", "another-run")
    other = backend.provision(JobSpec(job_name="demo"), other_layout)
    try:
        for index in (0, 1):
            ready = tmp_path / f"ready-{index}"
            backend.launch_command(handle, index, [sys.executable, "-c", FAMILY, tag, str(ready)])
            wait_for(ready.exists, what=f"segment {index} family")
        other_ready = tmp_path / "ready-other"
        backend.launch_command(other, 0, [sys.executable, "-c", FAMILY, other_tag, str(other_ready)])
        wait_for(other_ready.exists, what="the other run's family")
        # Per segment: wrapper, launcher, grouped child, setsid child; the last in its own session.
        family = find_processes(re.escape(tag))
        assert len(family) == 2 * 4
        assert len({os.getsid(p.pid) for p in family}) == 2 * 2

        # The cluster's fork server done importing: while it imports TensorFlow, a short-lived child
        # of it (a library lookup) may carry the cluster's marker too, and teardown stops that as well.
        forkserver_client.wait_ready(handle["forkserver_dir"], timeout=300)

        released = backend.teardown(handle)

        assert_no_processes(re.escape(tag), timeout=0)
        assert len(released["stopped_pids"]) == 2 * 4 + 1  # and the cluster's fork server
        assert not Path(handle["work_dir"]).exists()
        assert len(find_processes(re.escape(other_tag))) == 4, "teardown touched another run"
        assert backend.teardown(handle)["stopped_pids"] == []
    finally:
        backend.teardown(other)
    assert_no_processes(re.escape(other_tag), timeout=0)


# A process that changes the marker it was found by, as an exiting one seems to: once its memory is
# released, /proc/<pid>/environ reads empty while the process has not yet ended.
MARKER_CHANGER = """
import os, sys, time
from syncswitch import procs
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
procs.rewrite_initial_env("SYNCSWITCH_TEST_MARK", "changed")
time.sleep(600)
"""


def test_a_stopped_scope_waits_for_each_process_it_found_to_end(tmp_path: Path) -> None:
    """Teardown's "nothing left" holds until every process it found has ended, not only until none
    shows the marker any more: the standby server a cluster claimed is reaped by its starter then."""
    go = tmp_path / "go"
    env = {**os.environ, "SYNCSWITCH_TEST_MARK": procs.ENV_PLACEHOLDER}
    child = subprocess.Popen([sys.executable, "-c", MARKER_CHANGER, str(go)], env=env)
    try:
        scope = supervise.ProcessScope([], "SYNCSWITCH_TEST_MARK", procs.ENV_PLACEHOLDER)
        wait_for(lambda: [p.pid for p in scope.live()] == [child.pid], what="the marked process")
        go.touch()
        wait_for(lambda: procs.has_env(child.pid, "SYNCSWITCH_TEST_MARK", "changed"), what="its new marker")
        assert supervise.ProcessScope([], "SYNCSWITCH_TEST_MARK", procs.ENV_PLACEHOLDER).live() == []
        assert [p.pid for p in scope.live()] == [child.pid], "found once, followed until it ends"
        assert scope.stop(grace_seconds=5) == {"stopped": [child.pid], "leftovers": []}
        assert child.poll() == -signal.SIGTERM, "ended (a zombie to reap) when stop returned"
    finally:
        child.kill()
        child.wait()


# ---- cluster capacity ------------------------------------------------------------------------------


def test_provisioning_a_second_local_cluster_waits_for_the_first(tmp_path: Path) -> None:
    from syncswitch.layout import RunLayout
    from syncswitch.spec import JobSpec
    from syncswitch_airflow.backends import ClusterBusy
    from syncswitch_airflow.backends.local import LocalBackend

    backend = LocalBackend(str(tmp_path / "work"))
    job = JobSpec(job_name="cap")
    first = backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r1")))
    try:
        with pytest.raises(ClusterBusy, match="taken \\(by r1\\)"):
            backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r2")))
    finally:
        backend.teardown(first)
    second = backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r2")))
    backend.teardown(second)
    assert backend.capacity().holders() == []


def test_a_cluster_whose_processes_all_died_frees_its_slot_though_its_folder_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run abandoned with its Airflow (or a machine restarted with /tmp kept) never tears down: its
    folder stays, and without a liveness check every later run would wait for the slot forever."""
    import json
    import time

    from syncswitch import forkserver
    from syncswitch.procs import is_alive
    from syncswitch_airflow.backends import ClusterBusy, ClusterCapacity

    backend = LocalBackend(str(tmp_path / "work"))
    job = JobSpec(job_name="cap")
    abandoned = backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r1")))
    second = None
    monkeypatch.setattr(ClusterCapacity, "STALE_SECONDS", 0.0)
    try:
        with pytest.raises(ClusterBusy):  # its fork server lives: the slot is held however old
            backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r2")))
        pid = json.loads(Path(abandoned["forkserver_dir"], forkserver.PID_FILE).read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not is_alive(pid), timeout=10, what="the fork server to die")
        with pytest.raises(ClusterBusy):  # no process, but written to lately: maybe between segments
            backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r2")))
        idle_since = time.time() - IDLE_CLUSTER_GONE_S - 60
        for root, dirs, files in os.walk(abandoned["work_dir"]):
            for path in [root, *(os.path.join(root, name) for name in (*dirs, *files))]:
                os.utime(path, (idle_since, idle_since))
        second = backend.provision(job, RunLayout(str(tmp_path / "runs" / "cap" / "r2")))
        assert backend.capacity().holders() == ["r2"]
        backend.teardown(abandoned)  # the abandoned run's late teardown leaves r2's slot alone
        assert backend.capacity().holders() == ["r2"]
    finally:
        backend.teardown(abandoned)
        if second is not None:
            backend.teardown(second)
    assert backend.capacity().holders() == []
    assert_no_processes(re.escape(str(tmp_path / "work")), timeout=10)


# ---- the standby fork server --------------------------------------------------------------------------


def test_clusters_claim_servers_forked_from_one_standby_and_their_teardowns_stop_them(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """The keeper starts a standby server (TensorFlow imported before any run asks); provisioning
    claims it, so the cluster's server is forked from it and carries the cluster's marker as a server
    the cluster started would, and the teardown stops it. The standby stands by for the next cluster:
    two runs, one import. Without a standby, none is started while a cluster trains."""
    keeper = StandbyForkServer(backend)
    standby = keeper.keep()
    try:
        assert standby is not None and keeper.keep() is None  # one at a time
        forkserver_client.wait_ready(backend.standby_dir, timeout=300)
        for run in ("first", "second"):
            layout = RunLayout.for_run(str(tmp_path / "runs"), "demo", run)
            handle = backend.provision(JobSpec(job_name="demo"), layout)
            try:
                assert forkserver_client.status(handle["forkserver_dir"]) == forkserver_client.READY
                ready = Path(handle["forkserver_dir"]) / forkserver.READY_FILE
                server = json.loads(ready.read_text())["pid"]
                assert server not in (None, standby)
                assert [p.pid for p in processes_with_env(CLUSTER_ENV, handle["work_dir"])] == [server]
                # Not in its starter's process group, which an Airflow instance's stop ends.
                assert os.getsid(server) not in (os.getsid(0), os.getsid(standby))
            finally:
                released = backend.teardown(handle)
            assert released["stopped_pids"] == [server]
            assert forkserver_client.status(backend.standby_dir) == forkserver_client.READY
            assert keeper.keep() is None and [p.pid for p in keeper.started] == [standby]
        log = (Path(backend.standby_dir) / forkserver.LOG_FILE).read_text()
        assert log.count("ready in") == 1 and log.count("standing by again") == 2, log
        # Without a standby, none is started while a cluster trains (its import would take the
        # cores the cluster trains on); after the teardown, one is.
        keeper.stop()
        handle = backend.provision(
            JobSpec(job_name="demo"), RunLayout.for_run(str(tmp_path / "runs"), "demo", "own")
        )
        try:
            assert keeper.keep() is None
        finally:
            backend.teardown(handle)
        assert keeper.keep() not in (None, standby)
    finally:
        keeper.stop()
    assert forkserver_client.status(backend.standby_dir) == forkserver_client.ABSENT
    assert not keeper.started


def test_teardown_brings_home_the_logs_the_run_folder_lacks(backend: LocalBackend, handle: dict) -> None:
    """Before the cluster folder goes, each node's and launcher's log that the run folder lacks, or
    holds shorter (a launcher killed before its upload, a copy that stopped with a lost host), is
    uploaded to logs/<segment>/; one already there whole is not sent again, a link delay's never."""
    layout = RunLayout(handle["run_dir"])
    launch = Path(handle["work_dir"], "segments", "seg-01")
    scratch = launch / "scratch"
    scratch.mkdir(parents=True)
    spec = json.dumps({"run_dir": layout.root, "index": 1, "protocol": "asp"})
    (launch / "spec.json").write_text(spec)
    (scratch / "segment.json").write_text(spec)
    (launch / "launcher.log").write_text("launcher: started\nlauncher: done\n")
    for name in ("chief-0", "worker-0", "worker-1", "ps-0", "linkdelay-1"):
        (scratch / f"{name}.log").write_text(f"{name}: line 1\n{name}: line 2\n")
    home = Path(layout.segment_logs(1, "asp"))
    home.mkdir(parents=True)
    (home / "worker-0.log").write_text("worker-0: line 1\nworker-0: line 2\n")  # whole: kept as it is
    os.utime(home / "worker-0.log", (1, 1))
    (home / "worker-1.log").write_text("worker-1: line 1\n")  # a copy that stopped short

    backend.teardown(handle)

    assert sorted(p.name for p in home.iterdir()) == [
        "chief-0.log",
        "launcher-0.log",
        "ps-0.log",
        "worker-0.log",
        "worker-1.log",
    ]
    assert (home / "worker-1.log").read_text() == "worker-1: line 1\nworker-1: line 2\n"
    assert (home / "launcher-0.log").read_text() == "launcher: started\nlauncher: done\n"
    assert (home / "worker-0.log").stat().st_mtime == 1, "a log already home was sent again"
    assert not Path(handle["work_dir"]).exists()
