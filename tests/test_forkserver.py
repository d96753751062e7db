"""The fork server with real forked TensorFlow nodes: a node lives exactly as long as its lease.

Each server imports TensorFlow once (10-30 s on 2 cores), so the scenarios share servers where
they can. The forked node is a real ASP parameter server (`syncswitch.node` with a TF_CONFIG), which
serves until it is stopped: the most long-lived kind of node, and the one most likely to be orphaned.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_utils import assert_no_processes, wait_for
from syncswitch import forkserver, forkserver_client, procs
from syncswitch.forkserver import free_ports
from syncswitch.spec import SegmentSpec

pytestmark = pytest.mark.cluster
READY_TIMEOUT = 300
MARKER = "SYNCSWITCH_CLUSTER_DIR"  # the local backend's marker of a cluster's processes


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def one_step_spec(tmp_path: Path, protocol: str, **names: str) -> SegmentSpec:
    """A one-step segment of a run in ``tmp_path``; ``names``: model, hparam_set, problem (usr_dir)."""
    return SegmentSpec(
        run_id="fs",
        run_dir=str(tmp_path / "run"),
        index=0,
        protocol=protocol,
        until_step=1,
        total_steps=1,
        **names,
    )


def fork_ps(
    server_dir: Path, tmp_path: Path, name: str = "ps-0"
) -> tuple[forkserver_client.ForkedProcess, Path]:
    """Fork a one-process ASP cluster's parameter server; returns it and its log."""
    spec = one_step_spec(tmp_path, "asp", model="cnn", hparam_set="cnn_digits", problem="digits")
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(spec.to_json())
    port = free_ports("127.0.0.1", 1)[0]
    tf_config = {"cluster": {"ps": [f"127.0.0.1:{port}"]}, "task": {"type": "ps", "index": 0}}
    log = tmp_path / f"{name}.log"
    node = forkserver_client.fork_node(
        str(server_dir),
        ["--spec", str(spec_path), "--work-dir", str(tmp_path)],
        env={"TF_CONFIG": json.dumps(tf_config)},
        log=str(log),
        name=f"ss-{name}",
    )
    serving = lambda: log.exists() and "serving at" in log.read_text(errors="replace")  # noqa: E731
    wait_for(serving, timeout=60, what=f"{name} serving")
    return node, log


@pytest.fixture
def server(tmp_path: Path, no_leftover_processes) -> Path:  # noqa: ANN001
    server_dir = tmp_path / "fs"
    no_leftover_processes(re.escape(str(server_dir)))
    process = forkserver_client.start(str(server_dir), die_with_parent=True)
    forkserver_client.wait_ready(str(server_dir), READY_TIMEOUT)
    yield server_dir
    process.terminate()
    process.wait(timeout=30)


def test_status_follows_the_server_from_start_to_exit(tmp_path: Path) -> None:
    server_dir = tmp_path / "fs"
    assert forkserver_client.status(str(server_dir)) == forkserver_client.ABSENT
    with pytest.raises(forkserver_client.ForkServerUnavailable, match="no fork server is running"):
        forkserver_client.wait_ready(str(server_dir), timeout=1)
    process = forkserver_client.start(str(server_dir), die_with_parent=True)
    try:
        assert forkserver_client.status(str(server_dir)) == forkserver_client.STARTING
        # The folder's Unix address is taken before the import, and a second server for the folder
        # exits without serving and leaves the first's records (a duplicate start on a host).
        address = forkserver.address_for(str(server_dir)).replace("\0", "@")
        bound = lambda: address in Path("/proc/net/unix").read_text()  # noqa: E731
        wait_for(bound, timeout=60, what="the first server's address bound")
        second = subprocess.run(
            [sys.executable, "-m", "syncswitch.forkserver", str(server_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0 and "runs or starts already; not serving" in second.stdout, second
        assert json.loads((server_dir / forkserver.PID_FILE).read_text())["pid"] == process.pid
        forkserver_client.wait_ready(str(server_dir), READY_TIMEOUT)
        assert forkserver_client.status(str(server_dir)) == forkserver_client.READY
        ready = json.loads((server_dir / forkserver.READY_FILE).read_text())
        assert ready["pid"] == process.pid and ready["preload_seconds"] > 0
        # It preloaded TensorFlow, and none of Keras's optional imports (forkserver.KERAS_OPTIONAL_IMPORTS).
        libraries = {line.split()[-1] for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines()}
        assert any("/tensorflow/" in path for path in libraries)
        assert not [path for path in libraries if re.search(r"/(sklearn|scipy|pandas|matplotlib)/", path)]
        # Removing its folder (what teardown does) ends the server on its own.
        for path in server_dir.iterdir():
            path.unlink()
        server_dir.rmdir()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert forkserver_client.status(str(server_dir)) == forkserver_client.ABSENT


def test_a_server_whose_folder_goes_while_it_starts_never_serves(tmp_path: Path) -> None:
    """A teardown right after provisioning may not see the server it just started (Popen returns
    before the child's environment shows in /proc). Its folder removed while it imports, the server
    exits by itself and does not make the folder again; ``kill_started`` stops it sooner."""
    late, killed = tmp_path / "late", tmp_path / "killed"
    process = forkserver_client.start(str(late), die_with_parent=True)
    other = forkserver_client.start(str(killed), die_with_parent=True)
    try:
        for path in late.iterdir():
            path.unlink()
        late.rmdir()
        assert process.wait(timeout=READY_TIMEOUT) == 0
        assert not late.exists()
        assert forkserver_client.kill_started(str(killed)) == other.pid
        assert other.wait(timeout=10) == -signal.SIGKILL
        assert forkserver_client.kill_started(str(killed)) is None  # that process is gone: nothing to do
    finally:
        for proc in (process, other):
            if proc.poll() is None:
                proc.kill()


def test_a_node_lives_as_long_as_its_lease(server: Path, tmp_path: Path) -> None:
    node, _ = fork_ps(server, tmp_path)
    assert Path(f"/proc/{node.pid}/comm").read_text().strip() == "ss-ps-0"
    assert node.poll() is None
    # The launcher's side of the connection closes, as when a launcher is SIGKILLed.
    node._conn.close()
    wait_for(lambda: not pid_alive(node.pid), what="the orphaned node to be killed", timeout=30)

    # A node that ends on its own reports its exit code over its lease.
    second, _ = fork_ps(server, tmp_path, name="ps-1")
    second.terminate()
    assert second.wait(timeout=30) == -signal.SIGTERM
    assert not second.lost


def test_a_node_that_fails_reports_its_exit_code(server: Path, tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    node = forkserver_client.fork_node(
        str(server),
        ["--spec", str(tmp_path / "missing.json"), "--work-dir", str(tmp_path)],
        env={"TF_CONFIG": json.dumps({"cluster": {}, "task": {"type": "ps", "index": 0}})},
        log=str(log),
        name="ss-bad",
    )
    assert node.wait(timeout=60) == 1
    assert "missing.json" in log.read_text()
    # Its log, read through the server as a launcher on another host copies it, byte for byte; a file
    # no node of the server logs to is refused.
    ref = forkserver_client.ServerRef(server_dir=str(server))
    data, offset = forkserver_client.read_log(ref, str(log), 0)
    assert data == log.read_bytes() and offset == len(data)
    assert forkserver_client.read_log(ref, str(log), offset) == (b"", offset)
    with pytest.raises(forkserver_client.ForkServerUnavailable, match="not the log of a node forked here"):
        forkserver_client.read_log(ref, str(tmp_path / "missing.json"), 0)
    # A malformed request gets an error back, and the server carries on serving.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(forkserver.address_for(str(server)))
        conn.sendall(b"not json\n")
        assert "error" in json.loads(conn.recv(4096).split(b"\n")[0])
    assert forkserver_client.status(str(server)) == forkserver_client.READY


def test_nodes_die_with_their_server(tmp_path: Path, no_leftover_processes) -> None:  # noqa: ANN001
    server_dir = tmp_path / "fs"
    no_leftover_processes(re.escape(str(server_dir)))
    process = forkserver_client.start(str(server_dir), die_with_parent=True)
    try:
        forkserver_client.wait_ready(str(server_dir), READY_TIMEOUT)
        node, _ = fork_ps(server_dir, tmp_path)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        wait_for(lambda: not pid_alive(node.pid), what="the node to die with its server", timeout=30)
        assert node.wait(timeout=10) == -signal.SIGKILL
        assert node.lost, "a node whose server went without a word counts as lost"
    finally:
        if process.poll() is None:
            process.kill()
    assert_no_processes(re.escape(str(server_dir)), timeout=10)


def test_a_missing_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(forkserver_client.ForkServerUnavailable, match="did not answer"):
        forkserver_client.fork_node(str(tmp_path), [], env={}, log=str(tmp_path / "x.log"), name="x")


def test_a_warm_preflight_imports_user_code_in_a_child_and_names_bad_input(
    server: Path, tmp_path: Path
) -> None:
    """A launcher whose segment names user code runs its preflight in a child of the cluster's fork
    server (TensorFlow imported there already); the outcome comes back, bad input with its field."""
    from syncswitch.preflight import PreflightError, imports_user_code, warm_preflight

    example = Path(__file__).resolve().parents[1] / "examples" / "text_classifier" / "text_example"
    spec = one_step_spec(
        tmp_path,
        "bsp",
        model="text_embedding",
        hparam_set="text_embedding",
        problem="synthetic_text",
        usr_dir=str(example),
    )
    assert imports_user_code(spec)
    assert not imports_user_code(
        spec.replace(usr_dir="", model="cnn", hparam_set="cnn_digits", problem="digits")
    )
    ref = forkserver_client.ServerRef(server_dir=str(server))
    data_dir = warm_preflight(spec, str(tmp_path / "data"), ref, str(tmp_path / "work"))
    assert isinstance(data_dir, str)
    with pytest.raises(PreflightError, match="hparams"):
        warm_preflight(
            spec.replace(hparams="no_such_knob=1"), str(tmp_path / "data"), ref, str(tmp_path / "work")
        )


def test_a_claimed_standby_forks_the_cluster_server_and_stands_by_again(
    tmp_path: Path, no_leftover_processes
) -> None:  # noqa: ANN001
    """A claim forks the cluster's server from the standby: it serves from the cluster's folder, in a
    session of its own, and it and the nodes it forks carry the cluster's marker (written over the
    placeholder), as if the cluster had started it. The standby stands by, unchanged, for the next
    cluster: one import for both. A marker longer than the placeholder, a second claim of one
    folder, or a claim of a cluster's server, is refused."""
    standby_dir, clusters = tmp_path / "standby", [tmp_path / "cluster-a", tmp_path / "cluster-b"]
    no_leftover_processes(re.escape(str(standby_dir)))
    env = {**os.environ, MARKER: procs.ENV_PLACEHOLDER}
    process = forkserver_client.start(str(standby_dir), env=env, die_with_parent=True, standby=True)
    servers: list[int] = []
    try:
        server_dirs = [cluster / "forkserver" for cluster in clusters]
        for cluster in clusters:
            cluster.mkdir()
        assert (
            forkserver_client.claim(
                str(standby_dir), str(server_dirs[0]), {MARKER: "x" * 1025}, timeout=READY_TIMEOUT
            )
            is None
        )
        for cluster, server_dir in zip(clusters, server_dirs, strict=True):
            pid = forkserver_client.claim(
                str(standby_dir), str(server_dir), {MARKER: str(cluster)}, timeout=5
            )
            assert pid is not None and pid not in (process.pid, *servers)
            servers.append(pid)
            assert forkserver_client.status(str(server_dir)) == forkserver_client.READY
            ready = json.loads((server_dir / forkserver.READY_FILE).read_text())
            assert ready["standby"] is False and ready["pid"] == pid
            assert procs.has_env(pid, MARKER, str(cluster))
            assert os.getsid(pid) == pid, "a session of its own: its starter's stop does not reach it"
            server_log = (server_dir / forkserver.LOG_FILE).read_text()
            assert f"forked from the standby server (pid {process.pid})" in server_log
        assert (
            forkserver_client.claim(str(standby_dir), str(server_dirs[0]), {MARKER: "again"}, timeout=5)
            is None
        )
        assert json.loads((standby_dir / forkserver.READY_FILE).read_text())["standby"] is True
        assert forkserver_client.status(str(standby_dir)) == forkserver_client.READY
        assert not procs.has_env(process.pid, MARKER, str(clusters[0]))
        node, _log = fork_ps(server_dirs[1], tmp_path)
        assert procs.has_env(node.pid, MARKER, str(clusters[1])), "a node inherits the claimed marker"
        assert (
            forkserver_client.claim(
                str(server_dirs[1]), str(tmp_path / "other"), {MARKER: "other"}, timeout=5
            )
            is None
        )
        node.kill()
        node.wait(timeout=30)
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        process.terminate()
        process.wait(timeout=30)


def test_a_cluster_server_exits_once_no_node_has_run_for_its_idle_time(
    tmp_path: Path, no_leftover_processes
) -> None:  # noqa: ANN001
    """A run that never tears down (its Airflow gone for good) must not leave its cluster's server
    behind forever. A standby waits however long it takes to be claimed; claimed, its server lives
    while a node runs, and exits on its own once none has for its idle time."""
    standby_dir, cluster = tmp_path / "standby", tmp_path / "cluster"
    no_leftover_processes(re.escape(str(standby_dir)))
    env = {**os.environ, MARKER: procs.ENV_PLACEHOLDER}
    idle_exit = 2.0
    process = forkserver_client.start(
        str(standby_dir), env=env, die_with_parent=True, standby=True, idle_exit=idle_exit
    )
    try:
        forkserver_client.wait_ready(str(standby_dir), READY_TIMEOUT)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=idle_exit * 2)  # a standby has no idle time
        server_dir = cluster / "forkserver"
        cluster.mkdir()
        server = forkserver_client.claim(str(standby_dir), str(server_dir), {MARKER: str(cluster)}, timeout=5)
        assert server is not None
        node, _log = fork_ps(server_dir, tmp_path)
        time.sleep(idle_exit * 2)
        assert procs.is_alive(server), "a node runs on it"
        node.kill()
        assert node.wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: not procs.is_alive(server), timeout=idle_exit + 30, what="the idle server's exit")
        assert forkserver_client.status(str(server_dir)) == forkserver_client.ABSENT
        assert "no node for 2s" in (server_dir / forkserver.LOG_FILE).read_text()
        assert process.poll() is None, "the standby stands by"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
