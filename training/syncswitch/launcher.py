"""Runs one segment on a cluster of processes and supervises it until it ends.

    preflight()      every check that can fail on user input, before any process is spawned
                     (syncswitch.preflight; in a child of the cluster's fork server where it would
                     import user code, and with it TensorFlow, in the launcher)
    cluster_nodes()  where each node runs: free 127.0.0.1 ports on this host
    host_nodes()     or (``--cluster FILE``) the hosts of a ``hosts`` cluster, placed by
                     ``hosts.place_nodes``, on ports their fork servers reserve on the hosts'
                     cluster-internal addresses
    SegmentCluster   forks chief/workers/PS, supervises, tears down
    run_segment()    preflight + cluster + result; what `syncswitch train` calls

Supervision covers what TF does not: a dead PS, or a dead worker of any protocol but ASP, fails the
segment (training resumes from the last checkpoint on rerun; syncswitch.protocols says why); a dead
ASP worker is tolerated; a stalled ASP or SSP worker reported by the coordinator's watchdog is
killed; injected stragglers are duty-cycled with SIGSTOP/SIGCONT.
Nodes are forked from a fork server that has TensorFlow imported already (forkserver.py): the cluster's,
warm since provisioning, or a private one. The server kills a node as soon as its launcher's connection
closes, so even a SIGKILLed launcher leaves no orphan behind.

Longer than the usual module: where the nodes run, how they are forked and how they are supervised
share the Node records and are read together when a segment fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from syncswitch import forkserver, forkserver_client, storage
from syncswitch.errors import SegmentFailed
from syncswitch.events import EventWriter
from syncswitch.hosts import ClusterFile, chief_host, place_nodes
from syncswitch.layout import RunLayout
from syncswitch.nodelogs import NodeLogs
from syncswitch.peers import host_port
from syncswitch.plan import step_text
from syncswitch.preflight import imports_user_code, preflight, warm_preflight
from syncswitch.protocols import ALLREDUCE
from syncswitch.reporting import ProgressFile
from syncswitch.spec import SegmentSpec, StragglerSpec
from syncswitch.stall import StallWatch

POLL_SECONDS = 0.2
PROGRESS_SECONDS = 5.0
BSP_ABORT_GRACE_SECONDS = 30.0
DUTY_CYCLE_SECONDS = 0.2
LINK_RESTORE_SECONDS = 5.0  # for a link delay to put the link back after SIGTERM
KILL_WAIT_SECONDS = 10.0
# How long a failed chief waits for its peers' fate to be known before the failure is reported: a node
# on a lost host is seen gone when its lease's TCP keepalive gives up (forkserver.TCP_KEEPALIVE: ~17 s),
# and gRPC keepalive may abort the chief before that.
PEER_FATE_SECONDS = 25.0
# gRPC keepalive on TensorFlow's channels (read by TF from $TF_GRPC_DEFAULT_OPTIONS) for clusters that
# span hosts: without it an RPC to a host that vanished (no RST, just silence) waits forever, and the
# ASP coordinator never marks that worker failed; with it the RPC fails within ~20 s and the
# coordinator reschedules the closure on the survivors. Pings only while calls are in flight.
GRPC_KEEPALIVE = "grpc.keepalive_time_ms=10000,grpc.keepalive_timeout_ms=10000"
# A node connects to its peers as it starts, often before they listen (on other hosts they are forked
# later): a refused connection is retried after gRPC's initial backoff, so a short one (1 s by
# default) keeps the wait for the last peer short.
GRPC_RECONNECT = "grpc.initial_reconnect_backoff_ms=100"
# A cluster's fork server may still be importing TensorFlow when its first segment starts.
FORKSERVER_WAIT_SECONDS = 300.0


@dataclass
class Node:
    role: str
    task: int
    address: str
    server: forkserver_client.ServerRef
    host: str = ""  # another host's name; "" = the launcher's own host
    host_work_dir: str = ""  # that host's work folder
    process: forkserver_client.ForkedProcess | None = None
    log_path: str = ""
    ended_at: float | None = None  # when the launcher first saw it ended (monotonic)
    stopped_here: bool = False  # the launcher ended it (a stalled worker, the segment's stop)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.task}"

    @property
    def remote(self) -> bool:
        return bool(self.host)

    @property
    def lost(self) -> bool:
        """Its fork server went without a word: the server died, or its host is lost."""
        return bool(self.process is not None and self.process.lost)

    def poll(self) -> int | None:
        """The node's exit code once it has ended (None while it runs), noting when that was seen."""
        code = self.process.poll() if self.process is not None else None
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    def describe(self) -> str:
        """Which node, where, and how it ended: ``worker-2 on host h3 (its host stopped answering)``."""
        where = f" on host {self.host}" if self.host else ""
        code = self.process.poll() if self.process is not None else None
        if self.lost:
            how = "its host or fork server stopped answering"
        elif code is not None and code < 0:
            how = f"killed by signal {-code}"
        else:
            how = f"exited with {code}"
        return f"{self.name}{where} ({how})"


def first_failed(nodes: list[Node], tolerated: set[str] | frozenset[str] = frozenset()) -> Node | None:
    """The node whose failure came first, as far as the launcher can tell: a node lost with its host
    or server, then one killed by a signal, then one that exited with an error, each kind in the
    order the launcher saw them end. A peer's death makes the others fail in turn (BSP's collectives
    abort; an aborted chief exits with an error), often before the lost one's lease times out, so
    the kind of end counts before its time. Nodes the launcher stopped itself do not count, nor
    ``tolerated`` ones (ASP workers the segment went on without) while another node failed."""
    ended = [n for n in nodes if not n.stopped_here and n.poll() not in (None, 0)]
    failed = [n for n in ended if n.name not in tolerated] or ended

    def order(node: Node) -> tuple[int, float]:
        kind = 0 if node.lost else 1 if (node.poll() or 0) < 0 else 2
        return kind, node.ended_at or 0.0

    return min(failed, key=order, default=None)


# ---- where the nodes run ----------------------------------------------------------------------------


def cluster_nodes(spec: SegmentSpec, forkserver_dir: str) -> list[Node]:
    """BSP: N workers (worker 0 is chief). ASP: one chief (coordinator), N workers, P parameter servers.
    All on this host, on free 127.0.0.1 ports, forked by the server in ``forkserver_dir``."""
    placed = place_nodes(["any"], spec.protocol, spec.num_workers, spec.num_ps)
    ports = forkserver.free_ports("127.0.0.1", len(placed))
    server = forkserver_client.ServerRef(server_dir=forkserver_dir)
    return [
        Node(role, task, f"127.0.0.1:{port}", server)
        for (role, task, _), port in zip(placed, ports, strict=True)
    ]


def host_nodes(spec: SegmentSpec, cluster: ClusterFile) -> list[Node]:
    """The same nodes on the hosts of ``cluster`` (``hosts.place_nodes``), on ports each host's fork
    server reserves on its cluster-internal address. The launcher runs on the chief host."""
    roles = [h.role for h in cluster.hosts]
    placed = place_nodes(roles, spec.protocol, spec.num_workers, spec.num_ps)
    token, here = cluster.read_token(), chief_host(roles)
    servers = [forkserver_client.ServerRef(tcp=h.forkserver, token=token) for h in cluster.hosts]
    ports: dict[int, list[int]] = {}
    for index in sorted({host for _, _, host in placed}):
        count = sum(1 for _, _, host in placed if host == index)
        ports[index] = forkserver_client.reserve_ports(servers[index], count)
    nodes = []
    for role, task, index in placed:
        host = cluster.hosts[index]
        nodes.append(
            Node(
                role,
                task,
                f"{host.address}:{ports[index].pop(0)}",
                servers[index],
                host="" if index == here else host.name,
                host_work_dir=host.work_dir,
            )
        )
    return nodes


# ---- the cluster ----------------------------------------------------------------------------------


class SegmentCluster:
    def __init__(
        self,
        spec: SegmentSpec,
        work_dir: str,
        data_dir: str,
        *,
        nodes: list[Node],
        launched_at: float | None = None,
        show_progress: bool = True,
    ) -> None:
        self.spec = spec
        # A hang (a frozen PS, a stuck collective, a coordinator waiting on a worker that never
        # finished its first step) fails the segment, so that a retry resumes from the last checkpoint.
        self.stall = StallWatch(spec.stall_seconds)
        self.work_dir = work_dir
        self.progress = ProgressFile(work_dir)  # the chief writes it
        self.data_dir = data_dir
        self.show_progress = show_progress
        self.layout = RunLayout(spec.run_dir)
        self.nodes = nodes
        self.launched_at = launched_at or time.time()
        self._stop_injection = threading.Event()
        self._injectors: list[threading.Thread] = []
        self._lost_workers: set[int] = set()  # ASP workers the survivors went on without
        self._reported_lost: set[str] = set()  # nodes with a node_lost event, each named once
        self._events: EventWriter | None = None
        self._events_lock = threading.Lock()
        self.logs = NodeLogs(work_dir, nodes)

    @property
    def chief(self) -> Node:
        return self.nodes[0]

    def cluster_spec(self) -> dict[str, list[str]]:
        spec: dict[str, list[str]] = {}
        for node in self.nodes:
            spec.setdefault(node.role, []).append(node.address)
        return spec

    # -- lifecycle --

    def start(self) -> None:
        """Fork every node from its host's fork server; each reads its role from TF_CONFIG."""
        self._check_stragglers()
        # A retry reuses the folder: the killed try's progress must not read as this one's.
        self.progress.clear()
        spec_path = os.path.join(self.work_dir, "segment.json")
        storage.write_text(spec_path, self.spec.to_json())
        cores = os.cpu_count() or 1
        spans_hosts = any(node.remote for node in self.nodes)
        grpc_options = f"{GRPC_KEEPALIVE},{GRPC_RECONNECT}" if spans_hosts else GRPC_RECONNECT
        for i, node in enumerate(self.nodes):
            tf_config = {"cluster": self.cluster_spec(), "task": {"type": node.role, "index": node.task}}
            env = {
                "TF_CONFIG": json.dumps(tf_config),
                "SYNCSWITCH_LAUNCH_TIME": str(self.launched_at),
                "TF_GRPC_DEFAULT_OPTIONS": grpc_options,
            }
            if node.remote:
                # Another host: the spec travels with the request, the node stages its own data.
                work_dir = os.path.join(node.host_work_dir, "segments", f"seg-{self.spec.index:02d}")
                node_spec = os.path.join(work_dir, "segment.json")
                cache = os.path.join(node.host_work_dir, "data")  # the host's, for every segment
                argv = ["--spec", node_spec, "--work-dir", work_dir, "--stage-data", "--data-cache", cache]
                files = {node_spec: self.spec.to_json()}
            else:
                # The launcher's whole environment, as a spawned child would have it, plus the node's own.
                env = {**os.environ, **env}
                work_dir, files = self.work_dir, {}
                argv = ["--spec", spec_path, "--work-dir", self.work_dir, "--data-dir", self.data_dir]
            node.log_path = os.path.join(work_dir, f"{node.name}.log")
            node.process = forkserver_client.fork_node(
                node.server,
                argv,
                env=env,
                log=node.log_path,
                name=f"ss-{node.name}",
                cpu=i % cores if self.spec.pin_cores and not node.remote else None,
                files=files,
            )
        self._write_process_table()
        self.logs.start()
        self._log(
            f"started {len(self.nodes)} processes in {time.time() - self.launched_at:.1f}s: "
            + ", ".join(f"{n.name}@{n.address} pid {n.process.pid}" for n in self.nodes)
        )
        self._start_injectors()

    def _write_process_table(self) -> None:
        """nodes.json: which pid is which node (forked nodes all show the fork server's command line)."""
        table = {
            n.name: {"pid": n.process.pid, "address": n.address, "log": n.log_path, "host": n.host}
            for n in self.nodes
        }
        storage.write_text(os.path.join(self.work_dir, "nodes.json"), json.dumps(table, indent=2))

    def wait(self) -> int:
        """Supervise until the chief exits; returns the chief's exit code (raises SegmentFailed)."""
        last_progress = 0.0
        bsp_abort_since: float | None = None
        protocol = self.spec.segment_protocol
        allreduce = protocol.topology == ALLREDUCE
        while True:
            chief_rc = self.chief.poll()
            if chief_rc is not None:
                if chief_rc != 0:
                    self._report_peers_of_failed_chief(chief_rc)
                return chief_rc
            self._act_on_kill_requests()
            for node in self.nodes[1:]:
                rc = node.poll()
                if rc is None or (rc == 0 and allreduce):
                    continue  # an all-reduce worker exits 0 once training is done and the chief is gone
                if node.role == "ps":
                    self._node_lost(node, rc, "the segment fails")
                    raise SegmentFailed(f"parameter server {node.task} exited with {rc}; see {node.log_path}")
                if protocol.family.survives_worker_loss:
                    self._lost_workers.add(node.task)
                    self._node_lost(node, rc, "ASP continues with the survivors")
                elif not allreduce:  # SSP: the others' clocks would stop within s steps of its own
                    self._node_lost(node, rc, "the segment fails")
                    raise SegmentFailed(
                        f"worker {node.task} exited with {rc}; {protocol.label} holds every worker within "
                        f"{protocol.staleness} step(s) of it, so the segment fails; see {node.log_path}"
                    )
                if allreduce and bsp_abort_since is None:
                    # MWMS aborts every worker when one dies; give the chief time to exit on its own.
                    bsp_abort_since = time.monotonic()
                    self._node_lost(node, rc, f"{protocol.family.title} cannot continue without it")
            if bsp_abort_since is not None and time.monotonic() - bsp_abort_since > BSP_ABORT_GRACE_SECONDS:
                raise SegmentFailed("a BSP worker died and the chief did not exit; stopping the segment")
            if len(self._lost_workers) >= self.spec.num_workers:
                raise SegmentFailed("every ASP worker is gone")
            self._check_stall()
            if self.show_progress and time.monotonic() - last_progress >= PROGRESS_SECONDS:
                self._print_progress()
                last_progress = time.monotonic()
            time.sleep(POLL_SECONDS)

    def _report_peers_of_failed_chief(self, rc: int) -> None:
        """Name the nodes that ended with the chief: in BSP a peer's death aborts the chief's
        collectives, so the chief's own error says little about which host or process was lost."""
        deadline = time.monotonic() + PEER_FATE_SECONDS
        peers = self.nodes[1:]
        while time.monotonic() < deadline and any(n.poll() is None for n in peers):
            time.sleep(POLL_SECONDS)
        failed = [n for n in peers if n.poll() not in (None, 0)]
        if failed:
            self._log(
                f"the chief exited with {rc}; with it: "
                + ", ".join(
                    f"{n.name}{f' on host {n.host}' if n.host else ''} exited with {n.process.poll()}"
                    for n in failed
                )
            )
        else:
            self._log(f"the chief exited with {rc}; every other node was running or done")
        for node in failed:
            self._node_lost(node, node.process.poll(), "the segment fails", log=False)

    def _node_lost(self, node: Node, exit_code: int | None, outcome: str, *, log: bool = True) -> None:
        """Say that a node ended before its segment did: in the launcher's log, and as a
        ``node_lost`` event, which the report lists (which host went, at which step, what followed)."""
        if node.name in self._reported_lost:
            return  # an all-reduce worker first named as lost is named again among the chief's peers
        self._reported_lost.add(node.name)
        if log:
            self._log(f"{node.role} {node.task} exited with {exit_code}; {outcome}")
        progress = self.progress.read() or {}
        self._emit(
            "node_lost",
            node=node.name,
            host=node.host or None,
            exit_code=exit_code,
            global_step=progress.get("global_step"),
            outcome=outcome,
        )

    def stop(self) -> None:
        """Kill every process that is still running.

        SIGKILL rather than SIGTERM: whatever a node had to keep is written by now (checkpoints are
        complete only once their manifest exists), a MultiWorkerMirroredStrategy worker takes SIGTERM
        as a preemption notice and carries on for seconds, and a SIGSTOPped straggler would sit on a
        pending SIGTERM. CONT first all the same, so a stopped process is not left behind as stopped.
        """
        self._stop_injection.set()
        self.logs.stop()
        for thread in self._injectors:
            thread.join(timeout=LINK_RESTORE_SECONDS + 1)
        alive = [n for n in self.nodes if n.process is not None and n.poll() is None]
        for node in alive:
            node.stopped_here = True
            node.process.send_signal(signal.SIGCONT)
            node.process.kill()
        for node in alive:
            try:
                node.process.wait(timeout=KILL_WAIT_SECONDS)
            except subprocess.TimeoutExpired:  # the fork server did not report it: say so, go on
                self._log(f"{node.name} (pid {node.process.pid}) still reported alive after SIGKILL")
        with self._events_lock:
            if self._events is not None:
                self._events.close()
                self._events = None

    # -- supervision helpers --

    def _check_stall(self) -> None:
        progress = self.progress.read()
        self.stall.observe(progress.get("global_step") if progress else None)
        reason = self.stall.stalled()
        if reason:
            raise SegmentFailed(
                f"{reason}; stopping the segment so that a rerun resumes from the last checkpoint"
            )

    def _act_on_kill_requests(self) -> None:
        for node in self.nodes:
            request = os.path.join(self.work_dir, f"kill-worker-{node.task}")
            if node.role != "worker" or not os.path.exists(request) or node.process.poll() is not None:
                continue
            with open(request, encoding="utf-8") as f:
                reason = f.read().strip()
            self._log(f"watchdog: killing stalled worker {node.task} (pid {node.process.pid}): {reason}")
            node.stopped_here = True
            node.process.send_signal(signal.SIGCONT)
            node.process.kill()
            os.unlink(request)

    def _worker(self, task: int) -> Node | None:
        return next((n for n in self.nodes if n.role == "worker" and n.task == task), None)

    def _check_stragglers(self) -> None:
        for straggler in self.spec.stragglers:
            node = self._worker(straggler.worker)
            if straggler.kind == "network" and node is not None and node.address.startswith("127."):
                raise ValueError(
                    f"straggler {straggler.to_text()!r}: a network straggler delays its worker's host link, "
                    "and this cluster's nodes all share 127.0.0.1; run it on a cluster of hosts"
                )

    def _start_injectors(self) -> None:
        reference = self.spec.straggler_reference_time or self.launched_at
        for straggler in self.spec.stragglers:
            node = self._worker(straggler.worker)
            if node is None:
                continue
            thread = threading.Thread(
                target=self._inject,
                args=(node, straggler, reference),
                name=f"straggler-{straggler.worker}",
                daemon=True,
            )
            thread.start()
            self._injectors.append(thread)

    def _inject(self, node: Node, straggler: StragglerSpec, reference: float) -> None:
        """Slow the worker down for each of the straggler's episodes that has not ended yet."""
        for start, end in straggler.episodes(reference):
            if time.time() >= end:
                continue
            if self._stop_injection.wait(max(start - time.time(), 0)) or node.process.poll() is not None:
                return
            self._log(
                f"straggler: worker {straggler.worker} {straggler.describe()} ({straggler.kind}) until "
                f"{end - time.time():.0f}s from now"
            )
            self._emit(
                "straggler",
                worker=straggler.worker,
                kind=straggler.kind,
                slowdown=straggler.slowdown,
                delay_ms=straggler.delay_ms,
                start=start,
                end=end,
            )
            if straggler.kind == "network":
                self._delay_link(node, straggler, end)
            else:
                self._duty_cycle(node, straggler, end)
            if self._stop_injection.is_set():
                return
            self._log(f"straggler: worker {straggler.worker} back to full speed")

    def _duty_cycle(self, node: Node, straggler: StragglerSpec, end: float) -> None:
        """Run the worker 1/slowdown of the time: stopped for (1 - 1/s) of every 0.2 s cycle."""
        run_for = DUTY_CYCLE_SECONDS / straggler.slowdown
        stop_for = DUTY_CYCLE_SECONDS - run_for
        while time.time() < end and node.process.poll() is None:
            node.process.send_signal(signal.SIGSTOP)  # over the node's lease: works on any host
            stopped = self._stop_injection.wait(stop_for)
            node.process.send_signal(signal.SIGCONT)
            if stopped or self._stop_injection.wait(run_for):
                break

    def _delay_link(self, node: Node, straggler: StragglerSpec, end: float) -> None:
        """Delay the worker's host link until ``end``: syncswitch.linkdelay, forked on that host by its
        fork server, restores the link when its time is up, on SIGTERM, or when its lease is lost."""
        address = host_port(node.address)[0]
        argv = ["--address", address, "--delay-ms", f"{straggler.delay_ms:g}"]
        try:
            shaper = forkserver_client.fork_node(
                node.server,
                [*argv, "--duration", f"{end - time.time():.3f}"],
                env={},
                log=os.path.join(os.path.dirname(node.log_path), f"linkdelay-{straggler.worker}.log"),
                name=f"ss-linkdelay-{straggler.worker}",
                program="linkdelay",
            )
        except forkserver_client.ForkServerUnavailable as exc:
            self._log(f"straggler: could not delay worker {straggler.worker}'s link: {exc}")
            return
        while shaper.poll() is None:
            if self._stop_injection.wait(0.5):
                shaper.terminate()
                break
        try:
            code = shaper.wait(timeout=LINK_RESTORE_SECONDS)
        except subprocess.TimeoutExpired:
            shaper.kill()
            code = None
        if code != 0 and not self._stop_injection.is_set():
            self._log(f"straggler: worker {straggler.worker}'s link delay ended with {code}; see its log")

    def _emit(self, event: str, **fields: Any) -> None:
        """One event of the launcher's own stream (stragglers, lost nodes): opened on first use, from
        the supervision loop or an injector thread, and closed by stop()."""
        with self._events_lock:
            if self._events is None:
                self._events = EventWriter(
                    self.layout.segment_events(self.spec.index, self.spec.protocol, "launcher", 0),
                    run_id=self.spec.run_id,
                    segment=self.spec.index,
                    protocol=self.spec.protocol,
                    role="launcher",
                    task=0,
                )
            self._events.emit(event, **fields)

    def _print_progress(self) -> None:
        progress = self.progress.read()
        if progress is None:
            self._log(f"starting: {time.time() - self.launched_at:.0f}s since launch")
            return
        self._log(
            f"step {step_text(progress['global_step'])}/{step_text(progress['until_step'])} "
            f"loss {progress['loss']:.4f} "
            f"{progress['examples_per_sec']:.0f} examples/s"
        )

    def _log(self, message: str) -> None:
        print(
            f"[{self.spec.run_id}] seg {self.spec.index} {self.spec.protocol}: {message}",
            file=sys.stderr,
            flush=True,
        )

    def tail_logs(self, lines: int = 15) -> str:
        """Every node's last lines (another host's as far as the launcher's copy goes)."""
        out = []
        for node in self.nodes:
            where = f" on host {node.host}" if node.remote else ""
            tail = self.logs.tail(node, lines)
            out.append(f"--- {node.name}{where} ({node.log_path}) ---\n" + "\n".join(tail))
        return "\n".join(out)

    # -- failure and the logs' way home --

    def failure_report(self, reason: str) -> str:
        """What the segment's failure message adds to ``reason``: the node that failed first, with its
        last lines, or every node's last lines where none failed (a stall); and where every log goes.
        Also the launcher's ``segment_failed`` event, which the segment task's log shows."""
        self.logs.pull_all(skip=[n.name for n in self.nodes if n.lost])
        node = first_failed(self.nodes, {f"worker-{task}" for task in self._lost_workers})
        logs = self.layout.segment_logs(self.spec.index, self.spec.protocol)
        progress = self.progress.read() or {}
        self._emit(
            "segment_failed",
            reason=reason,
            node=node.name if node else None,
            host=(node.host or None) if node else None,
            exit_code=node.poll() if node else None,
            lost=node.lost if node else False,
            global_step=progress.get("global_step"),
            last_lines=self.logs.tail(node) if node else [],
            log=self.layout.node_log(self.spec.index, self.spec.protocol, node.name) if node else None,
            logs=logs,
        )
        if node is None:
            return f"no node failed; every node's last lines:\n{self.tail_logs()}\nevery node's log: {logs}/"
        tail = "\n".join(f"  {line}" for line in self.logs.tail(node))
        return (
            f"the node that failed first: {node.describe()}; its last lines:\n{tail}\n"
            f"every node's log: {logs}/"
        )

    def ship_logs(self) -> None:
        """Every node's log into the run folder (after ``stop``: the nodes have ended, each log is
        whole), another host's as far as the launcher's copy goes."""
        self.logs.pull_all(skip=[n.name for n in self.nodes if n.lost])
        written = self.logs.upload(self.layout, self.spec.index, self.spec.protocol)
        where = self.layout.segment_logs(self.spec.index, self.spec.protocol)
        self._log(f"{len(written)} node log(s) uploaded to {where}/")


# ---- entry point ----------------------------------------------------------------------------------


def run_segment(
    spec: SegmentSpec,
    work_dir: str | None = None,
    *,
    forkserver_dir: str | None = None,
    cluster_file: str | None = None,
    data_cache: str | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Run one segment to its end and return its SegmentResult (result.json).

    Nodes are forked from the fork server in ``forkserver_dir`` (the cluster's, warm since it was
    provisioned); without one, or if it is gone, the launcher starts a private one for this segment.
    With ``cluster_file`` (a ``hosts.ClusterFile``) they are forked on the cluster's hosts instead.
    Data from a bucket is staged into ``data_cache`` (the cluster's, so the next segments reuse it;
    default: in the work folder).
    """
    launched_at = time.time()
    own_work_dir = work_dir is None
    work_dir = work_dir or tempfile.mkdtemp(prefix=f"syncswitch-seg{spec.index}-")
    os.makedirs(work_dir, exist_ok=True)
    result_uri = RunLayout(spec.run_dir).segment_result(spec.index, spec.protocol)
    cluster: SegmentCluster | None = None
    private_server: subprocess.Popen | None = None
    try:
        cache_dir = data_cache or os.path.join(work_dir, "data")
        if cluster_file:
            data_dir = preflight(spec, cache_dir)
            nodes = host_nodes(spec, ClusterFile.from_dict(storage.read_json(cluster_file)))
        elif forkserver_dir and imports_user_code(spec):
            # User code imports TensorFlow: import it where that is done already. (On hosts the
            # launcher still imports it itself.)
            server_dir, private_server = _ready_forkserver(spec, forkserver_dir, work_dir)
            server = forkserver_client.ServerRef(server_dir=server_dir)
            data_dir = warm_preflight(spec, cache_dir, server, work_dir)
            nodes = cluster_nodes(spec, server_dir)
        else:
            # Before any fork server: a lone segment's bad input fails without importing TensorFlow.
            data_dir = preflight(spec, cache_dir)
            server_dir, private_server = _ready_forkserver(spec, forkserver_dir, work_dir)
            nodes = cluster_nodes(spec, server_dir)
        storage.delete(result_uri)  # a stale result from an earlier attempt must not count
        cluster = SegmentCluster(
            spec, work_dir, data_dir, nodes=nodes, launched_at=launched_at, show_progress=show_progress
        )
        cluster.start()
        return _supervise(cluster, result_uri)
    finally:
        if cluster is not None:
            cluster.stop()
            cluster.ship_logs()
        if private_server is not None:
            _stop_process(private_server)
        if own_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def _supervise(cluster: SegmentCluster, result_uri: str) -> dict[str, Any]:
    """Wait for the segment's end: its result, or SegmentFailed naming the node that failed first."""
    try:
        rc = cluster.wait()
        if rc != 0:
            raise SegmentFailed(f"the chief exited with {rc}")
        result = storage.read_json(result_uri, default=None)
        if result is None:
            raise SegmentFailed(f"the chief exited without writing {result_uri}")
        return result
    except SegmentFailed as exc:
        try:
            report = cluster.failure_report(str(exc))
        except Exception as error:  # noqa: BLE001 - the failure stands, named or not
            report = f"(the node that failed first could not be named: {type(error).__name__}: {error})"
        raise SegmentFailed(f"{exc}\n{report}") from None


def _ready_forkserver(
    spec: SegmentSpec, forkserver_dir: str | None, work_dir: str
) -> tuple[str, subprocess.Popen | None]:
    """The fork server to use, and a private one this launcher started (to stop it afterwards)."""
    if forkserver_dir:
        try:
            forkserver_client.wait_ready(forkserver_dir, FORKSERVER_WAIT_SECONDS)
            return forkserver_dir, None
        except forkserver_client.ForkServerUnavailable as exc:
            message = f"[{spec.run_id}] seg {spec.index}: {exc}; starting a private one"
            print(message, file=sys.stderr, flush=True)
    private_dir = os.path.join(work_dir, "forkserver")
    server = forkserver_client.start(private_dir, die_with_parent=True)
    try:
        forkserver_client.wait_ready(private_dir, FORKSERVER_WAIT_SECONDS)
    except forkserver_client.ForkServerUnavailable as exc:
        _stop_process(server)
        log = os.path.join(private_dir, forkserver.LOG_FILE)
        raise SegmentFailed(f"{exc}; see {log}") from exc
    return private_dir, server


def _stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so run_segment's finally stops the cluster."""

    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise)
