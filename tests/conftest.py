"""Shared fixtures: a real GCS emulator (fake-gcs-server), fresh buckets, process-table checks."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Airflow reads its configuration when first imported, and pytest imports conftest before any test
# module: point every in-process Airflow at one throwaway home, removed when the session's process
# exits (the embedded-Airflow tests give their subprocesses homes of their own).
os.environ["AIRFLOW_HOME"] = os.path.join(tempfile.gettempdir(), f"syncswitch-test-airflow-{os.getpid()}")
atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
# Cluster bookkeeping (the local backend's capacity slot, fork servers, leases) per session process,
# not the machine-wide <tmp>/syncswitch: on two xdist workers, one worker's runs held the one local
# cluster slot for minutes while the other's runs waited for it. Tests that need their own take
# the work_root fixture.
os.environ["SYNCSWITCH_WORK_DIR"] = os.path.join(tempfile.gettempdir(), f"syncswitch-test-work-{os.getpid()}")
atexit.register(shutil.rmtree, os.environ["SYNCSWITCH_WORK_DIR"], True)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "dags")

import pytest  # noqa: E402
import testbed as tb  # noqa: E402
from gcs_emulator import GcsEmulator, free_port  # noqa: E402 - testing/ (the syncswitch-testing distribution)
from proc_utils import assert_no_processes, find_processes  # noqa: E402
from statsd_sink import StatsdSink  # noqa: E402
from syncswitch import storage  # noqa: E402

PROJECT_DIR = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def running_testbed(name: str, hosts: int) -> Iterator[tb.Testbed]:
    """A testbed of ``hosts`` hosts, up for the block and down after it; the test (or the fixture's
    scope) is skipped with the reason where the testbed cannot run here."""
    reason = tb.ensure_prerequisites()
    if reason:
        pytest.skip(reason)
    testbed = tb.Testbed(name, hosts)
    testbed.up()
    try:
        yield testbed
    finally:
        testbed.down()


@pytest.fixture(scope="session")
def session_testbed() -> Iterator[tb.Testbed]:
    """The session's one testbed: a bridge, its gateway and the SSH key, without hosts of its own.
    Each file that needs hosts takes them on it through ``hosts_for_file``; skipped where the testbed
    cannot run. Under xdist each worker process is a session, with a testbed of its own."""
    with running_testbed(f"ss{os.getpid() % 100000}", 0) as bed:
        yield bed
    assert_testbed_gone(bed.name, bed.state_dir)


def assert_testbed_gone(name: str, state_dir: Path) -> None:
    """Nothing of testbed ``name`` is left: no namespace, link, iptables rule, sshd or delayer, and
    no state directory."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in netns.splitlines() if line.startswith(f"{name}-")], netns
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert f"-{name}" not in links, links  # ssbr-<name>, ssbo-<name>, ssv-<name>-<i>, ssvo-<name>
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout
    assert f"syncswitch-testbed:{name}" not in rules, rules
    assert not find_processes(re.escape(str(state_dir))), "an sshd or delayer of the testbed still runs"
    assert not state_dir.exists()


def host_namespaces(bed: tb.Testbed) -> list[str]:
    """The network namespaces of ``bed``'s hosts that exist now, by name (the outside one not)."""
    return [name for name in tb.netns_names() if name.startswith(f"{bed.name}-h")]


@contextlib.contextmanager
def hosts_for_file(
    bed: tb.Testbed, count: int, prerequisites: Callable[[], str | None] = lambda: None
) -> Iterator[tb.Testbed]:
    """``count`` new hosts on the session's testbed, its only hosts until the block ends (a module
    fixture's lifetime: pytest tears one file's module fixtures down before the next file's come up),
    so that the file addresses them as ``bed.hosts``. Then every host goes, those the file's tests
    added (a fake cloud's VMs) and the links they shaped with them. The file is skipped with the
    reason where ``prerequisites`` says it cannot run."""
    reason = prerequisites()
    if reason:
        pytest.skip(reason)
    if bed.hosts:
        raise tb.TestbedError(f"testbed {bed.name} still has hosts {[h.name for h in bed.hosts]}")
    try:
        for _ in range(count):
            bed.add_host()
        yield bed
    finally:
        for host in list(bed.hosts):
            bed.remove_host(host)


def ssh_connection(bed: tb.Testbed, host: tb.TestHost, host_key: str | None = None) -> str:
    """An Airflow SSH connection (as its AIRFLOW_CONN_ variable) to ``host``: the testbed's private key
    inline (no file on the worker), the host's key pinned (the testbed's known_hosts line)."""
    pinned = next(
        line.split(" ", 1)[1].strip()
        for line in Path(bed.known_hosts_path).read_text().splitlines()
        if line.startswith(f"{host.address} ")
    )
    extra = {"private_key": Path(bed.key_path).read_text(), "host_key": host_key or pinned}
    return json.dumps({"conn_type": "ssh", "host": host.address, "login": "root", "extra": extra})


@contextlib.contextmanager
def storage_on_gateway(gateway: str, root: Path, env: dict[str, str] | None = None) -> Iterator[GcsEmulator]:
    """A GCS emulator on a testbed's gateway (reachable from this machine and every testbed host),
    made this process's storage, with ``env`` set too, until the block ends."""
    server = GcsEmulator(root, free_port(), host=gateway)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("STORAGE_EMULATOR_HOST", server.url)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            yield server
    finally:
        server.stop()


def offline_uv_env(tmp_path: Path, *user_requirements: Path) -> dict[str, str]:
    """PATH with uv, and uv offline on this machine's cache: how a testbed host (no route to a
    registry) installs the runtime. Every pin of the lock, and what ``user_requirements`` (a user
    code's lists) resolve to beside them, is put in the cache first (a no-op where the test command's
    ``uv sync`` or an earlier test filled it); skips where uv is not on PATH."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (scripts/test.sh puts it there)")
    requirements = Path(storage.__file__).with_name("requirements.txt")
    warm = tmp_path / "warm-cache"
    subprocess.run([uv, "venv", "-q", str(warm)], check=True)
    lists = [arg for path in (requirements, *user_requirements) for arg in ("-r", str(path))]
    subprocess.run([uv, "pip", "install", "-q", "--python", str(warm), *lists], check=True)
    cache = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    # uv alone in a folder of its own: the uv found may be a virtualenv's (the provider depends on uv),
    # whose python3 would then shadow the host's own.
    uv_bin = tmp_path / "uv-bin"
    uv_bin.mkdir(exist_ok=True)
    if not (uv_bin / "uv").exists():
        (uv_bin / "uv").symlink_to(uv)
    path = f"{uv_bin}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "UV_OFFLINE": "1", "UV_CACHE_DIR": cache}


# The tests on the session's embedded Airflow (conftest ``embedded_airflow``), by test id prefix: under
# ``pytest -n N --dist loadgroup`` (scripts/test.sh) they all go to one xdist worker, so that one
# Airflow serves them. Collection fails on a test that uses the fixture and is not listed here.
EMBEDDED_AIRFLOW_TESTS = (
    "tests/test_airflow_faults.py::",
    "tests/test_embedded_airflow.py::",
    "tests/test_recurring_jobs.py::",
    "tests/test_report_tab.py::",
    "tests/test_trigger_form.py::",
    "tests/test_hosts_backend.py::test_a_network_straggler_",
    "tests/test_sweep.py::test_a_sweep_started_again_",
    "tests/test_metrics.py::test_a_run_on_the_embedded_airflow_",
)
# Queued first, longest first (the rest follow in the files' order), so that the two longest groups
# start at once on different workers and the short files come last, filling whichever worker is free.
# With the other long files in alphabetical order among the short ones, the cores stood 35-100 % idle
# over the last ~4 minutes of a 25-minute suite (/proc/stat every 10 s, 2026-12-06): one worker done,
# the other still in a long file.
LONGEST_GROUPS = (
    "embedded-airflow",
    "docker",
    "tests/test_distributed.py",
    "tests/test_hosts_backend.py",
    "tests/test_runtime_cluster.py",
    "tests/test_gce_backend.py",
    "tests/test_examples_user_code.py",
    "tests/test_pipeline_e2e.py",
    "tests/test_packages.py",
    "tests/test_user_code.py",
)


# The tests on a Docker engine, together: one engine (started once) and its image cache serve them.
DOCKER_TESTS = ("tests/test_compose_stack.py::", "tests/test_install_python313.py::")


def xdist_group_of(nodeid: str) -> str:
    """A test's xdist group: the embedded Airflow's tests together, the Docker ones together, any
    other test with its file (its module fixtures, a testbed or a Celery deployment, are built once)."""
    if nodeid.startswith(EMBEDDED_AIRFLOW_TESTS):
        return "embedded-airflow"
    if nodeid.startswith(DOCKER_TESTS):
        return "docker"
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "embedded_airflow" in item.fixturenames and xdist_group_of(item.nodeid) != "embedded-airflow":
            raise pytest.UsageError(f"{item.nodeid} uses embedded_airflow: add it to EMBEDDED_AIRFLOW_TESTS")
    if not hasattr(config, "workerinput"):
        return  # one process: the files' order, as collected

    def rank(item: pytest.Item) -> int:
        group = xdist_group_of(item.nodeid)
        return LONGEST_GROUPS.index(group) if group in LONGEST_GROUPS else len(LONGEST_GROUPS)

    items.sort(key=rank)  # the order of the groups in xdist's queue: first seen, first sent


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:  # noqa: ANN401 - xdist types
    """``--dist loadgroup`` by ``xdist_group_of``: each worker takes whole groups, in collection order.
    (xdist's own loadgroup reads ``xdist_group`` marks into the test ids, which pytest 9.2 no longer
    lets it do.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Any]:
    """The machine's Docker engine (one started here if none runs, stopped at the end), with the
    stand-ins of the official base images built where no registry is reachable; the test is skipped,
    saying why, where no engine can run (testing/docker_stack.py)."""
    from docker_stack import DockerEngine, DockerUnavailable

    try:
        engine = DockerEngine.ensure()
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker engine: {exc}")
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """The session's GCS emulator (fake-gcs-server, http, objects on disk). Sets
    ``STORAGE_EMULATOR_HOST`` for the session so ``syncswitch.storage`` and every subprocess the tests
    start (Airflow included) talk to it; the previous value is restored afterwards."""
    server = GcsEmulator(tmp_path_factory.mktemp("fake-gcs"), free_port())
    server.start()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    try:
        yield server
    finally:
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
        server.stop()
        assert not find_processes(rf"fake-gcs-server\S* .*-port {server.port}\b"), (
            "fake-gcs-server still running"
        )


@pytest.fixture(scope="session")
def gcs_emulator(gcs_server: GcsEmulator) -> str:
    """The session emulator's URL."""
    return gcs_server.url


@pytest.fixture
def gcs_bucket(gcs_emulator: str) -> str:
    """A fresh, uniquely named bucket in the emulator, as ``gs://<bucket>``."""
    return new_bucket("test")


def new_bucket(prefix: str) -> str:
    """A fresh, uniquely named bucket in the storage this process uses now, as ``gs://<bucket>``."""
    name = f"{prefix}-{uuid.uuid4().hex[:16]}"
    storage.gcs_client().create_bucket(name)
    return f"{storage.GS_PREFIX}{name}"


@pytest.fixture
def work_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's cluster work folders (the backends read SYNCSWITCH_WORK_DIR per call)."""
    root = tmp_path / "work"
    monkeypatch.setenv("SYNCSWITCH_WORK_DIR", str(root))
    return root


@pytest.fixture
def no_leftover_processes() -> Iterator[Callable[[str], None]]:
    """Register command-line regexes that must match no live process when the test ends.

    Usage: ``no_leftover_processes(re.escape(str(tmp_path)))`` before starting processes whose
    command line mentions ``tmp_path``. Match on something unique to the test: the machine is
    shared with other test runs.
    """
    patterns: list[str] = []
    yield patterns.append
    for pattern in patterns:
        assert_no_processes(pattern)


# A recurring job for the backfill tests (tests/test_recurring_jobs.py): daily, a short digits job whose
# timing policy searches with one run per candidate, and a data_dir that is a template of the date. Its
# checkpoints are evaluated, so the runs also feed the comparison report's time-to-accuracy.
BACKFILL_JOB = """\
schedule: "@daily"
start_date: 2026-01-01
# Over before today: unpausing it (for the backfill) schedules no run of its own.
end_date: 2026-01-31
tags: [test]
params:
  job_name: backfill-search
  bucket_dir: {bucket}
  total_steps: 120
  ckpt_frequency: [60]
  data_dir: "dates/{{{{ ds }}}}"
  timing_policy: search
  timing_repeats: 1
  evaluate_checkpoints: true
"""


# The Google connection of the tests' Airflow instances: anonymous, as the GCS emulator wants.
ANONYMOUS_GOOGLE_CONNECTION = '{"conn_type": "google_cloud_platform", "extra": {"is_anonymous": true}}'
BUCKET_CONN_ID = "syncswitch_bucket"
BUCKET_CONN_ENV = f"AIRFLOW_CONN_{BUCKET_CONN_ID.upper()}"


class EmbeddedAirflowReplaced(UserWarning):
    """The session's embedded Airflow was wedged before a test and was replaced."""


class SessionAirflow:
    """The test session's one embedded Airflow, checked before each test that uses it: a component
    left stopped, dead or not answering by an earlier test is reported once, naming it and its state,
    and the instance is replaced, so that one wedged component cannot fail every later test."""

    # How long an instance that does not answer is given to recover by its supervisor's own means (a
    # hung api-server is killed after the session's 20 s, one never answering after 60 s, a dead
    # component restarted within its backoff) before it counts as wedged.
    RECOVERY_SECONDS = 150.0

    def __init__(self, instance: Any, wait_for_dags: tuple[str, ...]) -> None:  # noqa: ANN401
        self.instance = instance
        self.wait_for_dags = wait_for_dags
        self.replaced: list[str] = []

    def with_its_settings(self) -> Any:  # noqa: ANN401 - EmbeddedAirflow
        """``serving()``, started again with the session's settings where the instance runs without
        them: one that ``syncswitch run`` started again after it had stopped (test_airflow_faults'
        last test) has the CLI's, without the session's metrics and bucket connection."""
        from proc_utils import environ
        from syncswitch_airflow.embedded.supervisor import read_status

        instance = self.serving()
        status = read_status(Path(instance.home)) or {}
        scheduler = status.get("components", {}).get("scheduler", {}).get("pid")
        wanted = {f"AIRFLOW__{key}": value for key, value in instance.settings_overrides.items()}
        running = environ(scheduler) if scheduler else {}
        if all(running.get(key) == value for key, value in wanted.items()):
            return instance
        print("the session's embedded Airflow runs without its settings; starting it again", file=sys.stderr)
        instance.stop()
        self.start()
        return instance

    def start(self) -> None:
        self.instance.start(wait_for_dags=self.wait_for_dags, timeout=600)

    def serving(self) -> Any:  # noqa: ANN401 - EmbeddedAirflow, imported late
        problem = self.problem()
        if problem is not None:
            message = f"the session's embedded Airflow was wedged: {problem}; replacing it"
            self.replaced.append(message)
            warnings.warn(EmbeddedAirflowReplaced(message), stacklevel=2)
            print(message, file=sys.stderr)
            self.instance.stop()
            self.start()
        return self.instance

    def problem(self) -> str | None:
        """None while the instance answers with every component running; else what is wrong."""
        from syncswitch_airflow.embedded.supervisor import answers

        deadline = time.monotonic() + self.RECOVERY_SECONDS
        while True:
            if not self.instance.is_running():
                return "its supervisor is gone"
            problems = self.instance.component_problems()
            stopped = [line for line in problems if "(T)" in line or "(t)" in line]
            if stopped:  # nothing of the instance continues a stopped process
                return "; ".join(stopped)
            health = f"{self.instance.url}/api/v2/monitor/health"
            if not problems and answers(health, timeout=10):
                return None
            if time.monotonic() > deadline:
                unanswered = [] if answers(health, timeout=10) else [f"no answer from {health}"]
                return "; ".join(problems + unanswered)
            time.sleep(5.0)


@pytest.fixture(scope="session")
def statsd_sink() -> Iterator[StatsdSink]:
    """The session's StatsD sink: a UDP port of this machine, where the session's embedded Airflow
    sends its metrics (Airflow's and the pipeline's) for as long as the session lasts."""
    with StatsdSink() as sink:
        yield sink


def statsd_settings(sink: StatsdSink) -> dict[str, str]:
    """Airflow settings (``SECTION__KEY``) that send its metrics to ``sink``, tags included."""
    return {
        "METRICS__STATSD_ON": "True",
        "METRICS__STATSD_HOST": sink.host,
        "METRICS__STATSD_PORT": str(sink.port),
        "METRICS__STATSD_INFLUXDB_ENABLED": "True",
    }


@contextlib.contextmanager
def statsd_in_this_process(sink: StatsdSink) -> Iterator[StatsdSink]:
    """Airflow's ``Stats`` in this process send to ``sink`` until the block ends, as a task's or a
    trigger's do under ``[metrics] statsd_on`` (dag.test() runs both in this process)."""
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics import stats_utils

    with pytest.MonkeyPatch.context() as patch:
        for key, value in statsd_settings(sink).items():
            patch.setenv(f"AIRFLOW__{key}", value)
        stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
        try:
            yield sink
        finally:
            patch.setenv("AIRFLOW__METRICS__STATSD_ON", "False")
            stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)


@pytest.fixture
def statsd_here() -> Iterator[StatsdSink]:
    """A StatsD sink of its own that this process's Airflow ``Stats`` send to during the test."""
    with StatsdSink() as sink, statsd_in_this_process(sink):
        yield sink


@pytest.fixture(scope="session")
def session_airflow(
    gcs_server: GcsEmulator, statsd_sink: StatsdSink, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SessionAirflow]:
    """One real embedded Airflow (supervised scheduler, triggerer, dag-processor, api-server) for the
    whole session, with this project's dags/ and plugins/ and a private AIRFLOW_HOME; it reaches the
    session's GCS emulator and sends its metrics to the session's StatsD sink. Stopped at the end by
    ``syncswitch run --stop-ui`` (one instance serves that check too: a second one costs a minute or
    two), and nothing of it may be left running."""
    from syncswitch import procs
    from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
    from syncswitch_airflow.embedded.supervisor import BOOT_SECONDS_ENV, HUNG_SECONDS_ENV

    # Runs triggered with the DAG's defaults (the Trigger form) go to a throwaway bucket folder, not
    # to <project>/runs: the DAG file reads SYNCSWITCH_BUCKET_DIR when Airflow parses it.
    bucket = tmp_path_factory.mktemp("default-bucket")
    # The recurring-job DAGs of the session: the project's example and the tests' own (job files).
    jobs = tmp_path_factory.mktemp("jobs")
    shutil.copy(PROJECT_DIR / "jobs" / "digits-nightly.yaml", jobs)
    (jobs / "backfill-search.yaml").write_text(BACKFILL_JOB.format(bucket=bucket))
    saved = {name: os.environ.get(name) for name in ("SYNCSWITCH_BUCKET_DIR", "SYNCSWITCH_JOBS_DIR")}
    saved[BUCKET_CONN_ENV] = os.environ.get(BUCKET_CONN_ENV)
    os.environ["SYNCSWITCH_BUCKET_DIR"] = str(bucket)
    os.environ["SYNCSWITCH_JOBS_DIR"] = str(jobs)
    # Every bucket call of the tasks and triggers through a named connection (the provider's GCS
    # hook), as on a deployment that keeps its key in one: a named connection must exist, so a task
    # that did not read it would fail.
    os.environ[BUCKET_CONN_ENV] = ANONYMOUS_GOOGLE_CONNECTION
    # The api-server fault tests wait this long for its restart rather than the defaults (an instance
    # the CLI starts again, or a replacement, reads them from here too).
    for name, seconds in ((HUNG_SECONDS_ENV, "20"), (BOOT_SECONDS_ENV, "60")):
        saved[name] = os.environ.get(name)
        os.environ[name] = seconds
    settings = {"SYNCSWITCH__GCP_CONN_ID": BUCKET_CONN_ID, **statsd_settings(statsd_sink)}
    # Any free port: 8080 is left to a demo or another test session on the same machine.
    instance = EmbeddedAirflow(
        PROJECT_DIR, home=tmp_path_factory.mktemp("airflow-home"), port=0, settings=settings
    )
    holder = SessionAirflow(instance, wait_for_dags=("sync_switch",))
    try:
        holder.start()
        yield holder
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        record = instance.running_instance()
        stop_with_the_cli(instance.home)
        assert not procs.processes_with_env("AIRFLOW_HOME", str(instance.home)), "Airflow processes left"
        if record is not None:
            assert procs.processes_in_group(record.pid) == [], "the supervisor's process group is left"
        assert not instance.is_running() and not instance.pid_file.exists()


@pytest.fixture
def embedded_airflow(session_airflow: SessionAirflow):  # noqa: ANN201 - EmbeddedAirflow
    """The session's embedded Airflow, found serving before the test (or replaced: SessionAirflow)."""
    return session_airflow.serving()


@pytest.fixture
def metrics_airflow(embedded_airflow: Any, session_airflow: SessionAirflow):  # noqa: ANN201, ANN401
    """The session's embedded Airflow sending its metrics to the session's StatsD sink (started again
    with the session's settings where it runs without them: SessionAirflow.with_its_settings)."""
    return session_airflow.with_its_settings()


def stop_with_the_cli(home: Path) -> None:
    """Stop a kept UI as a user does, ``syncswitch run --stop-ui``, after the session's runs: every
    component stops without SIGKILL, the triggerer on one SIGTERM (a second one is its "force exit").
    Only what the logs gain during this stop counts: the session's fault tests kill components on
    purpose, and the supervisor rightly SIGKILLs what those leave when they die."""
    logs = [home / "embedded.log", home / "logs" / "components" / "triggerer.log"]
    sizes = [path.stat().st_size if path.exists() else 0 for path in logs]
    stop = subprocess.run(
        [str(Path(sys.executable).parent / "syncswitch"), "run", "--airflow-home", str(home), "--stop-ui"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert stop.returncode == 0 and "embedded Airflow stopped" in stop.stderr, stop.stderr
    supervisor_log, triggerer_log = (_tail_from(path, size) for path, size in zip(logs, sizes, strict=True))
    assert "SIGKILL" not in stop.stderr + supervisor_log, supervisor_log
    assert "second exit signal" not in triggerer_log


def _tail_from(path: Path, offset: int) -> str:
    """What ``path`` holds past byte ``offset`` (all of it if it was rotated since)."""
    data = path.read_bytes()
    return data[offset if len(data) >= offset else 0 :].decode("utf-8", errors="replace")


# ---- dag.test() runs ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated SQLite metadata database, the one this process's Airflow is configured with."""
    from airflow.configuration import AIRFLOW_HOME, conf

    env = {
        **os.environ,
        "AIRFLOW_HOME": AIRFLOW_HOME,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": conf.get("database", "sql_alchemy_conn"),
    }
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return AIRFLOW_HOME


@pytest.fixture
def dag(airflow_db: str):  # noqa: ANN201 - airflow DAG
    """A freshly parsed DAG per test: in-process task runs write a run's conf into the DAG's Param
    objects (airflow.sdk process_params shares them), so a parsed DAG serves one dag.test() only."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[1] / "dags"))
    assert bag.import_errors == {}
    return bag.dags["sync_switch"]
