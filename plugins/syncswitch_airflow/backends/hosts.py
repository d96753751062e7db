"""The hosts cluster backend: a run's training processes on separate hosts, reached over SSH (paramiko).

A cluster is the job's ``hosts`` (``syncswitch.hosts.HostSpec``: address, SSH user and key, optional
role). The bucket (``gs://``) is the only thing the hosts share. On each host, in
``<work_root>/<job>-<run>@<host>/``::

    token                         the cluster's fork-server token (0600; never in a log, XCom or state;
                                  its source is the run's bucket folder: RunLayout.cluster_secrets)
    forkserver/                   the host's fork server, listening on the host's address only
                                  (starting.pid from its start, forkserver.json once it listens;
                                  forkserver.lock, flock(1)'s, for the look-and-start step)
    segments/seg-<ii>/            on the chief host: spec.json, cluster.json, process.json,
                                  launcher.log, exitcode (``syncswitch.supervise``); on the others:
                                  the nodes' logs and staged data

and, with ``[syncswitch] hosts_runtime = install``, ``<work_root>/runtime/<id>/``: the runtime's venv
(node_runtime), with the user code's own requirements where it lists some (user_requirements), shared
by the runs of that version and list and kept after teardown.

Nothing of a cluster stays on the Airflow worker that provisioned it, so any worker of a distributed
Airflow can run the run's next task: the handle is in state.json, the token in the run's bucket
folder, the capacity lease (with the hosts it holds) in the deployment's ledger (``leases_dir``).

**provision** takes the lease (no host is in two clusters; with ``hosts_per_cluster`` the job's
hosts are a pool, and the lease takes that many free ones), logs into every host (in parallel),
writes the token and checks the host's runtime, and only then starts each host's fork server
(TensorFlow imported once per host) and waits until each listens. An unreachable host, a failed
login or a runtime of other versions fails provisioning before any server starts, naming the host
and the reason. **launch_segment** starts ``syncswitch
train --cluster`` on the chief host, detached under ``syncswitch.supervise`` (an Airflow worker
restart does not touch it); the launcher forks every node through its host's fork server, whose
lease kills the node if the launcher goes. **segment_status**, **stop_segment** and **teardown** run
``python -m syncswitch.supervise`` on the hosts: the same code the local backend calls in-process.
Teardown stops every process marked with the host's work folder, verifies none is left, and removes
the folder, on every host; a host that cannot be reached is reported, not waited for.

Deployment settings (``[syncswitch]`` of the Airflow worker's config, syncswitch_airflow.settings):
    ssh_known_hosts   known_hosts file; when set, unknown host keys are refused (a host whose spec
                      pins its ``host_key`` is checked against that instead)
    hosts_env         K=V;K=V for every process on the hosts (e.g. the GCS emulator as the hosts
                      reach it); STORAGE_EMULATOR_HOST, GOOGLE_CLOUD_PROJECT and
                      SYNCSWITCH_BUCKET_RETRY_SECONDS are forwarded unless set there
    hosts_runtime     "installed" (the hosts have the runtime at their python=; checked against the
                      lock and the user code's requirements.txt) or "install" (node_runtime: installed
                      over SSH once per version of the runtime and of the user's list)
    hosts_clusters    how many hosts clusters may exist at once (default 1)
    leases_dir        where the capacity ledger is: a gs:// folder on a distributed Airflow
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import posixpath
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

from syncswitch import storage
from syncswitch.errors import SpecError
from syncswitch.hosts import ClusterFile, ClusterHost, HostSpec, chief_host
from syncswitch.layout import RunLayout, join
from syncswitch.spec import JobSpec, SegmentSpec

from syncswitch_airflow import settings
from syncswitch_airflow.backends.base import (
    CLUSTER_ENV,
    SEGMENT_ENV,
    UNKNOWN,
    ClusterCapacity,
    ClusterError,
    Handle,
    SegmentAlreadyRunning,
    SegmentStatus,
    run_cluster_gone,
)
from syncswitch_airflow.backends.host_commands import (
    STARTING,
    python_command,
    ready_address,
    ready_command,
    start_command,
    started_alive,
    wait_for_ready_command,
)
from syncswitch_airflow.backends.node_runtime import (
    MARKER,
    NODE_INSTALL_SCRIPT,
    RuntimeBundle,
    hosts_install_runtime,
)
from syncswitch_airflow.backends.user_requirements import node_requirements
from syncswitch_airflow.hooks.ssh import COMMAND_TIMEOUT_S, SshSession, all_or_raise, on_hosts, resolve_hosts

CAPACITY_SETTING = "hosts_clusters"
FORWARDED_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", storage.RETRY_SECONDS_ENV)
FORKSERVER_READY_S = 300.0
# Longest one command on a host waits for its fork server's ready file (then the server is looked at
# again from here: alive, listening).
READY_WAIT_CHUNK_S = 30.0
INSTALL_TIMEOUT_S = 1800.0  # pip downloading TensorFlow on a slow link
TEARDOWN_GRACE_S = 15.0
LOG_UPLOAD_TIMEOUT_S = 120.0  # one host's logs into the bucket (each upload gives up after 10 s)

log = logging.getLogger(__name__)


def host_record(host: HostSpec, work_dir: str, runtime: RuntimeBundle | None = None) -> dict[str, Any]:
    """A host as the handle carries it (no secret: the key is a path or a bucket object, or the name
    of the Airflow connection that holds it). With ``runtime``, the host runs that runtime's venv,
    which ``install_from`` (the host's own interpreter) makes where it is missing."""
    python = host.python or sys.executable
    if runtime is not None:
        python = posixpath.join(runtime.venv(host.work_root), "bin", "python")
    return {
        "name": host.label,
        "address": host.address,
        "port": host.port,
        "user": host.user,
        "key": host.key,
        "conn": host.conn,
        "host_key": host.host_key,
        "role": host.role,
        "python": python,
        "install_from": (host.python or "python3") if runtime is not None else "",
        "work_dir": work_dir,
        "forkserver": "",
    }


def host_work_dir(host: HostSpec, job_name: str, run: str) -> str:
    """``<work_root>/<job>-<run>@<host>``: named by the host too, so that hosts sharing a filesystem
    (the testbed's namespaces, an NFS home) never share a folder."""
    folder = re.sub(r"[^A-Za-z0-9._@-]", "_", f"{job_name}-{run}@{host.label}")
    return posixpath.join(host.work_root, folder)


def cluster_token(layout: RunLayout) -> str:
    """The cluster's fork-server token: made by the first task that asks, the same for every worker."""
    uri = join(layout.cluster_secrets, "token")
    return storage.create_private(uri, secrets.token_hex(32).encode()).decode().strip()


def hosts_environment() -> dict[str, str]:
    """What every process on the hosts gets: the forwarded variables, then ``[syncswitch] hosts_env``."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
    for item in (settings.get("hosts_env") or "").split(";"):
        key, sep, value = item.strip().partition("=")
        if sep and key:
            env[key] = value
    return env


@dataclass(frozen=True)
class CheckedHost:
    """A host ready for its fork server, logged in: ``server`` is the server's TCP address where one
    listens already, STARTING where one is starting, "" where none runs."""

    host: dict[str, Any]
    ssh: SshSession
    server: str


class HostsBackend:
    """Processes on the job's hosts, reached over SSH; holds no state between calls."""

    name = "hosts"
    status_poll_seconds = 3.0  # each status is an SSH login to the chief host

    def capacity(self) -> ClusterCapacity:
        return ClusterCapacity.from_setting(self.name, CAPACITY_SETTING, run_cluster_gone)

    # ---- cluster ---------------------------------------------------------------------------------

    def provision(self, job: JobSpec, layout: RunLayout) -> Handle:
        """Take a capacity slot and the job's hosts in the deployment's ledger (ClusterBusy while
        another cluster holds one of them), then the cluster. Idempotent for the same run."""
        run = posixpath.basename(layout.root)
        try:  # what the hosts' SSH connections give (validate checked them; they may have changed)
            hosts = resolve_hosts(job.hosts)
        except SpecError as exc:
            raise ClusterError(str(exc)) from None
        install = hosts_install_runtime()  # a bad setting: named
        user_requirements = node_requirements(job, install)
        runtime = RuntimeBundle.current(user_requirements) if install else None
        capacity = self.capacity()
        need = job.hosts_per_cluster or None  # a number: the hosts are a pool shared with other runs
        if need is not None and need > len(hosts):  # (a DNS name's addresses are counted only now)
            listed = ", ".join(h.label for h in hosts)
            raise ClusterError(f"hosts_per_cluster {need} is more than the {len(hosts)} host(s): {listed}")
        held = capacity.claim(run, hosts=tuple(h.address for h in hosts), need=need, run_dir=layout.root)
        try:
            hosts = _by_address(hosts, held)
            return self.start_cluster(job, hosts, layout, runtime, user_requirements=user_requirements)
        except BaseException:
            capacity.release(run)
            raise

    def start_cluster(
        self,
        job: JobSpec,
        hosts: tuple[HostSpec, ...],
        layout: RunLayout,
        runtime: RuntimeBundle | None = None,
        user_requirements: str = "",
    ) -> Handle:
        """A fork server on every one of ``hosts`` (with ``runtime``, installed there first where it is
        missing); the handle of the cluster they make, which carries ``user_requirements`` (the user
        code's list, which every host is checked against). On failure nothing is left on the hosts
        but an installed runtime. (The gce backend calls this on its VMs.) Nothing of the cluster
        stays on this Airflow worker: its token is in the run's bucket folder, where any worker that
        runs a later task of the run finds the same one."""
        run = posixpath.basename(layout.root)
        handle: Handle = {
            "backend": self.name,
            "run": run,
            "run_dir": layout.root,
            "hosts": [host_record(h, host_work_dir(h, job.job_name, run), runtime) for h in hosts],
            "chief": chief_host([h.role for h in hosts]),
            "env": hosts_environment(),
            "processes": 1 + job.num_workers + job.num_ps,
            "user_requirements": user_requirements,
        }
        try:
            self._start_servers(handle, cluster_token(layout), runtime)
        except BaseException:
            self._teardown_hosts(handle)
            raise
        log.info(
            "run %s: provisioned hosts cluster: %s",
            run,
            ", ".join(f"{h['name']} (fork server {h['forkserver']})" for h in handle["hosts"]),
        )
        return handle

    def _start_servers(self, handle: Handle, token: str, runtime: RuntimeBundle | None = None) -> None:
        """Every host's fork server up (started where it is not), its address in the handle; a
        ClusterError names each host that failed and why.

        Every host is checked (login, folders, runtime) before any server starts: a host that cannot
        take part fails provisioning in seconds, not after the other hosts' TensorFlow imports."""
        if runtime is None and any(host.get("install_from") for host in handle["hosts"]):
            # A host lost and back may need it again.
            runtime = RuntimeBundle.current(handle.get("user_requirements", ""))
        with contextlib.ExitStack() as sessions:
            check = functools.partial(self._check_host, sessions, handle, token=token, runtime=runtime)
            checked = all_or_raise(on_hosts(handle["hosts"], check))
            addresses = all_or_raise(on_hosts(checked, functools.partial(self._start_host, handle)))
        for host, address in zip(handle["hosts"], addresses, strict=True):
            host["forkserver"] = address

    def _check_host(
        self,
        sessions: contextlib.ExitStack,
        handle: Handle,
        host: dict[str, Any],
        *,
        token: str,
        runtime: RuntimeBundle | None,
    ) -> CheckedHost:
        """Log into the host (the session closed with ``sessions``) and ready it for its fork server:
        its folders made, and unless a server listens or starts there already (every launch after
        provisioning; the retry of a provisioning task lost midway), the token written and the
        runtime checked (installed first where the deployment says so)."""
        ssh = sessions.enter_context(SshSession(host))
        work, server_dir = host["work_dir"], posixpath.join(host["work_dir"], "forkserver")
        folders = f"umask 077 && mkdir -p {shlex.quote(server_dir)} {shlex.quote(work)}/segments"
        ready = ready_address(ssh.check(f"{folders} && {ready_command(server_dir)}", "mkdir"))
        if ready:
            return CheckedHost(host, ssh, ready)
        ssh.write_file(posixpath.join(work, "token"), token, mode=0o600)
        if self._server_starting(ssh, server_dir):
            return CheckedHost(host, ssh, STARTING)
        if runtime is not None and host.get("install_from"):
            self._install_runtime(ssh, handle, host, runtime)
        # Workers on other TensorFlow or Keras versions than the chief's would not load each
        # other's checkpoints reliably: every host runs the lock's versions (syncswitch.requirements),
        # and has what the user code lists.
        listed = handle.get("user_requirements", "")
        check = ["--check", "--user-requirements", "-"] if listed else ["--check"]
        what = "the runtime's version check"
        ssh.check(python_command(host, "syncswitch.requirements", *check), what, stdin=listed)
        return CheckedHost(host, ssh, "")

    def _start_host(self, handle: Handle, checked: CheckedHost) -> str:
        """The host's fork server's TCP address, once it listens: started here unless one listened or
        started already."""
        host, ssh = checked.host, checked.ssh
        if checked.server not in ("", STARTING):
            return checked.server
        server_dir = posixpath.join(host["work_dir"], "forkserver")
        if not checked.server:
            self._launch_server(ssh, handle, host, server_dir)
        deadline = time.monotonic() + FORKSERVER_READY_S
        failure = f"did not listen within {FORKSERVER_READY_S:.0f}s"
        while not (ready := self._server_ready(ssh, server_dir)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not self._server_starting(ssh, server_dir):  # it died: its log says why, at once
                ready = self._server_ready(ssh, server_dir)  # (unless it was ready just now)
                failure = "exited before it listened"
                break
            self._wait_for_ready_file(ssh, server_dir, min(left, READY_WAIT_CHUNK_S))
        if ready:
            log.info("run %s: fork server on %s listens at %s", handle["run"], host["name"], ready)
            return ready
        tail = ssh.run(f"tail -n 20 {shlex.quote(posixpath.join(server_dir, 'forkserver.log'))}")[1]
        raise ClusterError(f"{ssh.where}: its fork server {failure}; log:\n{tail}")

    @staticmethod
    def _launch_server(ssh: SshSession, handle: Handle, host: dict[str, Any], server_dir: str) -> None:
        """The host's fork server started detached, unless one listens or starts there already (one
        step under the folder's lock: ``host_commands.start_command``)."""
        work = host["work_dir"]
        env = {**handle["env"], CLUSTER_ENV: work, "TF_CPP_MIN_LOG_LEVEL": "2"}
        token_file = posixpath.join(work, "token")
        command = python_command(
            host, "syncswitch.forkserver", server_dir, "--listen", host["address"], "--token-file", token_file
        )
        out = ssh.check(start_command(server_dir, command, env), "starting the fork server")
        found = "a fork server started by an earlier try runs" if out.strip() == STARTING else ""
        log.info("run %s: %s on %s", handle["run"], found or "fork server starting", host["name"])

    @staticmethod
    def _wait_for_ready_file(ssh: SshSession, server_dir: str, seconds: float) -> None:
        """Until the starting fork server has written its ready file or has died, for at most
        ``seconds``, waited for on the host itself (``host_commands.wait_for_ready_command``)."""
        ssh.run(wait_for_ready_command(server_dir, seconds), timeout=seconds + COMMAND_TIMEOUT_S)

    @staticmethod
    def _server_starting(ssh: SshSession, server_dir: str) -> bool:
        """Whether a fork server started for this folder is still alive (not listening yet)."""
        return ssh.run(started_alive(posixpath.join(server_dir, "starting.pid")))[0] == 0

    @staticmethod
    def _install_runtime(
        ssh: SshSession, handle: Handle, host: dict[str, Any], runtime: RuntimeBundle
    ) -> None:
        """The host's runtime venv (``host["python"]``'s), installed unless it is there: the runtime
        and the lock's pins, through node_install.py run by the host's own interpreter."""
        venv = _runtime_venv(host)
        if ssh.run(f"test -f {shlex.quote(posixpath.join(venv, MARKER))}")[0] == 0:
            return
        if runtime.venv(posixpath.dirname(host["work_dir"])) != venv:
            raise ClusterError(
                f"{ssh.where}: the runtime was upgraded since this cluster was provisioned, and {venv} "
                "is not on the host: provision a new cluster (retry the run)"
            )
        staging = posixpath.join(host["work_dir"], "runtime-install")
        ssh.check(f"mkdir -p {shlex.quote(staging)}", "mkdir")
        files = {
            "node_install.py": NODE_INSTALL_SCRIPT.read_text(),
            "requirements.txt": runtime.requirements,
            runtime.wheel.filename: runtime.wheel.content,
        }
        user_list: list[str] = []
        if runtime.user_requirements:
            files["user-requirements.txt"] = runtime.user_requirements
            user_list = ["--user-requirements", posixpath.join(staging, "user-requirements.txt")]
        for name, content in files.items():
            ssh.write_file(posixpath.join(staging, name), content)
        log.info("run %s: installing the runtime %s on %s", handle["run"], runtime.id, host["name"])
        command = shlex.join(
            [
                "env",
                *(f"{k}={v}" for k, v in handle["env"].items()),
                host["install_from"],
                posixpath.join(staging, "node_install.py"),
                venv,
                "--requirements",
                posixpath.join(staging, "requirements.txt"),
                "--runtime",
                posixpath.join(staging, runtime.wheel.filename),
                *user_list,
            ]
        )
        done = ssh.json(f"cd / && {command}", "installing the runtime", timeout=INSTALL_TIMEOUT_S)
        if not done["installed"]:  # another install made it meanwhile (a host on the same disk)
            log.info("run %s: runtime %s found made on %s", handle["run"], runtime.id, host["name"])
            return
        log.info(
            "run %s: runtime %s installed on %s with %s in %.1fs",
            handle["run"],
            runtime.id,
            host["name"],
            done["installer"],
            done["seconds"],
        )

    @staticmethod
    def _server_ready(ssh: SshSession, server_dir: str) -> str:
        """The fork server's TCP address if it is up and alive, else ""."""
        return ready_address(ssh.run(ready_command(server_dir))[1])

    def teardown(self, handle: Handle) -> dict[str, Any]:
        """Stop every process of the run on every host, verify, remove the hosts' work folders."""
        results = self._teardown_hosts(handle)
        leftovers = {name: r["leftovers"] for name, r in results.items() if r.get("leftovers")}
        if leftovers:
            raise ClusterError(f"run {handle.get('run')}: processes survived SIGKILL: {leftovers}")
        storage.delete_prefix(RunLayout(handle["run_dir"]).cluster_secrets)
        self.capacity().release(handle.get("run", ""))
        stopped = sum(len(r.get("stopped", [])) for r in results.values())
        unreachable = {name: r["unreachable"] for name, r in results.items() if "unreachable" in r}
        log.info(
            "run %s: teardown stopped %d process(es) on %d host(s)%s",
            handle.get("run"),
            stopped,
            len(results) - len(unreachable),
            f"; not reached: {unreachable}" if unreachable else "",
        )
        return {"hosts": results, "stopped": stopped, "unreachable": unreachable}

    def _teardown_hosts(self, handle: Handle) -> dict[str, dict[str, Any]]:
        def stop(host: dict[str, Any]) -> dict[str, Any]:
            work = host["work_dir"]
            stop_processes = python_command(
                host,
                "syncswitch.supervise",
                "stop",
                "--marker",
                f"{CLUSTER_ENV}={work}",
                "--records",
                posixpath.join(work, "segments"),
                "--grace",
                str(TEARDOWN_GRACE_S),
                "--remove",
                work,
            )
            command = stop_processes
            if host.get("install_from"):
                # A runtime that failed to install ran nothing, and cannot run the stop either.
                marker = posixpath.join(_runtime_venv(host), MARKER)
                nothing = json.dumps({"stopped": [], "leftovers": []})
                command = (
                    f"if [ -f {shlex.quote(marker)} ]; then {stop_processes}; "
                    f"else rm -rf {shlex.quote(work)} && echo {shlex.quote(nothing)}; fi"
                )
            with SshSession(host) as ssh:
                self._upload_logs_with(ssh, handle, host)
                return ssh.json(command, "teardown")

        results = on_hosts(handle["hosts"], stop)
        by_host: dict[str, dict[str, Any]] = {}
        for host, result in zip(handle["hosts"], results, strict=True):
            if isinstance(result, ClusterError):
                # A lost host took its processes with it; one that is only unreachable now is
                # reported to the operator rather than waited for.
                run = handle.get("run")
                log.warning("run %s: teardown could not reach %s: %s", run, host["name"], result)
                by_host[host["name"]] = {"unreachable": str(result)}
            else:
                by_host[host["name"]] = result
        return by_host

    def upload_logs(self, handle: Handle) -> dict[str, list[str]]:
        """Every host's logs that the run folder lacks, uploaded from the host (in parallel): what a
        launcher could not upload (killed first, its host lost and back) and the launchers' own. The
        gce backend calls it before it deletes the VMs; the teardown here does it host by host."""

        def upload(host: dict[str, Any]) -> list[str]:
            with SshSession(host) as ssh:
                return self._upload_logs_with(ssh, handle, host)

        results = on_hosts(handle["hosts"], upload)
        return {h["name"]: r for h, r in zip(handle["hosts"], results, strict=True) if isinstance(r, list)}

    @staticmethod
    def _upload_logs_with(ssh: SshSession, handle: Handle, host: dict[str, Any]) -> list[str]:
        """One command on the host (``python -m syncswitch.nodelogs upload``, with the hosts' bucket
        settings); the URIs written. A failure is logged, not raised: logs never hold up a teardown."""
        upload = python_command(host, "syncswitch.nodelogs", "upload", host["work_dir"])
        env = shlex.join(["env", *(f"{k}={v}" for k, v in handle["env"].items())])
        command = f"cd / && {env} {upload}"
        if host.get("install_from"):  # a runtime that failed to install has nothing to upload with
            marker = posixpath.join(_runtime_venv(host), MARKER)
            command = f"if [ -f {shlex.quote(marker)} ]; then {command}; else echo '{{\"uploaded\": []}}'; fi"
        code, out, err = ssh.run(command, timeout=LOG_UPLOAD_TIMEOUT_S)
        try:
            uploaded = list(json.loads(out.strip().splitlines()[-1])["uploaded"]) if code == 0 else None
        except (ValueError, IndexError, KeyError, TypeError):
            uploaded = None
        if uploaded is None:
            log.warning(
                "run %s: logs on %s not uploaded (exit %d): %s",
                handle.get("run"),
                host["name"],
                code,
                (err or out).strip()[-500:],
            )
            return []
        if uploaded:
            log.info("run %s: %d log(s) uploaded from %s", handle.get("run"), len(uploaded), host["name"])
        return uploaded

    # ---- segments --------------------------------------------------------------------------------

    def _chief(self, handle: Handle) -> dict[str, Any]:
        return handle["hosts"][handle["chief"]]

    def segment_dir(self, handle: Handle, index: int) -> str:
        return posixpath.join(self._chief(handle)["work_dir"], "segments", f"seg-{index:02d}")

    def launch_segment(self, handle: Handle, spec: SegmentSpec) -> dict[str, Any]:
        chief = self._chief(handle)
        recorded = {h["name"]: h.get("forkserver") for h in handle["hosts"]}  # a replaced VM: none
        handle = {**handle, "hosts": [dict(h) for h in handle["hosts"]]}
        # Where every fork server still listens where provisioning left it (every first launch of a
        # healthy cluster), the chief looks as it launches: one SSH command. Otherwise (a relaunch
        # after a failure, a host lost and back, a server gone) every host is looked at over SSH,
        # its fork server started again where it is not (on a new port); a host still lost fails
        # the launch, named.
        # (A host without a recorded server, a replaced VM, is looked at the slow way at once.)
        known = all(h.get("forkserver") for h in handle["hosts"])
        record = self._launch_on_chief(handle, spec, check_servers=True) if known else {}
        if not known or "not_checked" in record:
            log.info(
                "run %s: segment %d: looking at every host's fork server (%s)",
                handle.get("run"),
                spec.index,
                record.get("not_checked", "a host without one"),
            )
            self._start_servers(handle, cluster_token(RunLayout(handle["run_dir"])))
            record = self._launch_on_chief(handle, spec, check_servers=False)
        if "running" in record:
            raise SegmentAlreadyRunning(f"run {handle.get('run')}: segment {spec.index} is already running")
        record = {"index": spec.index, "host": chief["name"], **record}
        hosts = handle["hosts"]
        moved = {h["name"]: h["forkserver"] for h in hosts if h["forkserver"] != recorded[h["name"]]}
        if moved:  # for the run's handle: its next launch then takes the one-command path again
            record["fork_servers"] = moved
        log.info(
            "run %s: launched segment %d on %s (pid %d), log %s",
            handle.get("run"),
            spec.index,
            chief["name"],
            record["pid"],
            record["log"],
        )
        return record

    def _launch_on_chief(self, handle: Handle, spec: SegmentSpec, check_servers: bool) -> dict[str, Any]:
        """One command on the chief host writes the segment's files and starts it; it refuses while
        the segment runs already, and, with ``check_servers``, unless every fork server listens."""
        chief, seg_dir = self._chief(handle), self.segment_dir(handle, spec.index)
        cluster = ClusterFile(
            hosts=tuple(
                ClusterHost(h["name"], h["address"], h["role"], h["forkserver"], h["work_dir"])
                for h in handle["hosts"]
            ),
            token_file=posixpath.join(chief["work_dir"], "token"),
        )
        env = {**handle["env"], CLUSTER_ENV: chief["work_dir"], SEGMENT_ENV: seg_dir, "PYTHONUNBUFFERED": "1"}
        train = [
            chief["python"],
            "-m",
            "syncswitch.cli",
            "train",
            "--spec",
            posixpath.join(seg_dir, "spec.json"),
            "--work-dir",
            posixpath.join(seg_dir, "scratch"),
            "--cluster",
            posixpath.join(seg_dir, "cluster.json"),
            "--data-cache",  # the chief host's, as each node stages into its own host's
            posixpath.join(chief["work_dir"], "data"),
        ]
        flags = [flag for k, v in env.items() for flag in ("--env", f"{k}={v}")]
        if check_servers:
            flags += [flag for h in handle["hosts"] for flag in ("--listening", h["forkserver"])]
        files = {"spec.json": spec.to_json(), "cluster.json": cluster.to_json()}
        launch = ["launch", seg_dir, "--marker", SEGMENT_ENV, "--files-on-stdin", *flags, "--", *train]
        with SshSession(chief) as ssh:
            command = f"cd / && {python_command(chief, 'syncswitch.supervise', *launch)}"
            return ssh.json(command, "launching the segment", stdin=json.dumps(files))

    def segment_status(self, handle: Handle, index: int) -> SegmentStatus:
        chief = self._chief(handle)
        command = python_command(chief, "syncswitch.supervise", "status", self.segment_dir(handle, index))
        try:
            with SshSession(chief) as ssh:
                answer = ssh.json(f"{command} --marker {SEGMENT_ENV}", "segment status")
        except ClusterError as exc:
            # Not known now; the segment trigger counts how long, and the stall rule still applies.
            log.warning("run %s: segment %d status unknown: %s", handle.get("run"), index, exc)
            return SegmentStatus(UNKNOWN)
        return SegmentStatus(answer["state"], exit_code=answer["exit_code"], pid=answer["pid"])

    def segment_log_tail(self, handle: Handle, index: int, lines: int = 20) -> str:
        path = posixpath.join(self.segment_dir(handle, index), "launcher.log")
        try:
            with SshSession(self._chief(handle)) as ssh:
                return ssh.run(f"tail -n {int(lines)} {shlex.quote(path)} 2>/dev/null")[1]
        except ClusterError as exc:
            return f"(the launcher's log is on the chief host, not reachable: {exc})"

    def stop_segment(self, handle: Handle, index: int, grace_seconds: float = 30.0) -> list[int]:
        """Stop the launcher on the chief host; the nodes on the other hosts go with its leases."""
        chief, seg_dir = self._chief(handle), self.segment_dir(handle, index)
        command = python_command(
            chief,
            "syncswitch.supervise",
            "stop",
            "--marker",
            f"{SEGMENT_ENV}={seg_dir}",
            "--records",
            seg_dir,
            "--grace",
            str(grace_seconds),
        )
        with SshSession(chief) as ssh:
            outcome = ssh.json(command, "stopping the segment")
        if outcome["leftovers"]:
            raise ClusterError(
                f"run {handle.get('run')}: segment {index} processes survived on {chief['name']}: "
                f"{outcome['leftovers']}"
            )
        return outcome["stopped"]


def _runtime_venv(host: dict[str, Any]) -> str:
    """The venv of a host record's interpreter (``<venv>/bin/python``)."""
    return posixpath.dirname(posixpath.dirname(host["python"]))


def _by_address(hosts: tuple[HostSpec, ...], addresses: tuple[str, ...]) -> tuple[HostSpec, ...]:
    """The hosts a lease holds, in the job's order: each held address takes one host that has it."""
    left = list(addresses)
    picked = []
    for host in hosts:
        if host.address in left:
            left.remove(host.address)
            picked.append(host)
    return tuple(picked)
