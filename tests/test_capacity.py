"""Cluster capacity: one ledger per backend, shared by every Airflow worker of a deployment.

The ledger is one JSON document changed only by atomic read-modify-writes (a file lock locally, a
generation precondition in a bucket), so workers that provision at the same moment never take one slot
or one host twice. These tests run it on local files and on the real GCS emulator.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
from syncswitch import state
from syncswitch.layout import RunLayout
from syncswitch_airflow.backends import ClusterBusy, ClusterCapacity
from syncswitch_airflow.backends.base import capacity_refusal, leases_uri, run_cluster_gone


def test_cluster_capacity_hands_out_slots_once_and_takes_them_back(tmp_path: Path) -> None:
    capacity = ClusterCapacity(tmp_path / "leases" / "local.json", 2)
    clusters = {run: tmp_path / run for run in ("a", "b", "c")}
    for folder in clusters.values():
        folder.mkdir()
    assert capacity.acquire("a", str(clusters["a"])) and capacity.acquire("a", str(clusters["a"]))
    assert capacity.acquire("b", str(clusters["b"]))
    assert not capacity.acquire("c", str(clusters["c"])) and not capacity.has_free_slot()
    assert capacity.holders() == ["a", "b"]
    capacity.release("a")
    assert capacity.has_free_slot() and capacity.acquire("c", str(clusters["c"]))
    assert capacity.holders() == ["b", "c"]


def test_a_lease_whose_cluster_is_gone_frees_its_slot_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capacity = ClusterCapacity(tmp_path / "leases.json", 1)
    assert capacity.acquire("crashed", str(tmp_path / "never-made"))
    assert not capacity.acquire("next", str(tmp_path / "next"))  # young: provisioning may be under way
    monkeypatch.setattr(ClusterCapacity, "STALE_SECONDS", 0.0)
    assert capacity.acquire("next", str(tmp_path / "next"))
    assert capacity.holders() == ["next"]


def test_a_host_is_never_in_two_clusters_whatever_the_capacity(tmp_path: Path) -> None:
    capacity = ClusterCapacity(tmp_path / "hosts.json", 5, setting="hosts_clusters", what="hosts")
    capacity.claim("r1", hosts=("10.0.0.1", "10.0.0.2"), run_dir=str(tmp_path / "r1"))
    with pytest.raises(ClusterBusy, match=r"10\.0\.0\.2 \(run r1\)") as busy:
        capacity.claim("r2", hosts=("10.0.0.2", "10.0.0.3"), run_dir=str(tmp_path / "r2"))
    assert busy.value.hosts == ("10.0.0.2", "10.0.0.3")  # what its deferred wait watches
    assert not capacity.has_free_slot(("10.0.0.2",)) and capacity.has_free_slot(("10.0.0.3",))
    capacity.claim("r3", hosts=("10.0.0.3",), run_dir=str(tmp_path / "r3"))
    capacity.release("r1")
    capacity.claim("r2", hosts=("10.0.0.2", "10.0.0.4"), run_dir=str(tmp_path / "r2"))
    assert capacity.holders() == ["r2", "r3"]


def test_a_pool_of_hosts_gives_each_run_its_own_free_ones_and_a_retry_the_same(tmp_path: Path) -> None:
    """``hosts_per_cluster``: the job's six hosts are a pool, each run takes three free ones in order."""
    capacity = ClusterCapacity(tmp_path / "hosts.json", 5, setting="hosts_clusters", what="hosts")
    pool = tuple(f"10.0.0.{i}" for i in range(6))
    assert capacity.claim("r1", hosts=pool, need=3, run_dir=str(tmp_path / "r1")) == pool[:3]
    assert capacity.claim("r2", hosts=pool, need=3, run_dir=str(tmp_path / "r2")) == pool[3:]
    assert capacity.claim("r1", hosts=pool, need=3, run_dir=str(tmp_path / "r1")) == pool[:3]  # a retry
    assert not capacity.has_free_slot(pool, need=1)
    with pytest.raises(
        ClusterBusy, match=r"0 of the pool's 6 host\(s\) are free, 3 needed; held: 10\.0\.0\.0 \(run r1\)"
    ) as busy:
        capacity.claim("r3", hosts=pool, need=3, run_dir=str(tmp_path / "r3"))
    assert (busy.value.hosts, busy.value.need) == (pool, 3)  # what its deferred wait watches
    capacity.release("r1")
    assert capacity.has_free_slot(pool, need=3) and not capacity.has_free_slot(pool, need=4)
    assert capacity.claim("r3", hosts=pool, need=3, run_dir=str(tmp_path / "r3")) == pool[:3]
    # Without a pool, a run needs every host it names.
    assert not capacity.acquire("r4", hosts=(pool[0], "10.0.0.9"), run_dir=str(tmp_path / "r4"))


def test_a_full_ledger_names_the_holders_and_the_setting(tmp_path: Path) -> None:
    capacity = ClusterCapacity(tmp_path / "gce.json", 1, setting="gce_clusters", what="gce")
    capacity.claim("r1", run_dir=str(tmp_path / "r1"))
    with pytest.raises(ClusterBusy, match=r"all 1 gce cluster slot\(s\) are taken \(by r1\).*gce_clusters"):
        capacity.claim("r2", run_dir=str(tmp_path / "r2"))


def test_workers_provisioning_at_the_same_moment_on_a_bucket_ledger_never_share_a_host(
    gcs_bucket: str,
) -> None:
    """Eight provisioning tasks (as on eight Airflow workers: nothing shared but the bucket) ask at the
    same instant for overlapping pairs of four hosts, with room for three clusters."""
    capacity = ClusterCapacity(f"{gcs_bucket}/_leases/hosts.json", 3, what="hosts")
    hosts = [f"10.0.0.{i}" for i in range(4)]
    wanted = {f"r{i}": (hosts[i % 4], hosts[(i + 1) % 4]) for i in range(8)}
    start = threading.Barrier(len(wanted))
    won: dict[str, bool] = {}

    def provision(run: str) -> None:
        start.wait()
        won[run] = capacity.acquire(run, hosts=wanted[run], run_dir=f"{gcs_bucket}/job/{run}")

    threads = [threading.Thread(target=provision, args=(run,)) for run in wanted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = sorted(run for run, ok in won.items() if ok)
    held = [host for run in winners for host in wanted[run]]
    assert winners and len(held) == len(set(held)), f"a host in two clusters: {winners}"
    assert capacity.holders() == winners  # the ledger holds exactly those who were told yes
    # Four hosts in pairs: at most two disjoint clusters.
    assert len(winners) == 2


def test_runs_of_one_job_taking_from_a_pool_at_the_same_moment_never_share_a_host(gcs_bucket: str) -> None:
    """Eight provisioning tasks of one job (a backfill on eight Airflow workers) take two hosts each
    from the same pool of seven, at the same instant, with room for five clusters: three win."""
    capacity = ClusterCapacity(f"{gcs_bucket}/_leases/pool.json", 5, what="hosts")
    pool = tuple(f"10.0.1.{i}" for i in range(7))
    runs = [f"b{i}" for i in range(8)]
    start = threading.Barrier(len(runs))
    held: dict[str, tuple[str, ...]] = {}

    def provision(run: str) -> None:
        start.wait()
        with contextlib.suppress(ClusterBusy):
            held[run] = capacity.claim(run, hosts=pool, need=2, run_dir=f"{gcs_bucket}/job/{run}")

    threads = [threading.Thread(target=provision, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken = [host for hosts in held.values() for host in hosts]
    assert len(held) == 3 and all(len(hosts) == 2 for hosts in held.values()), held
    assert len(taken) == len(set(taken)), f"a host in two clusters: {held}"
    assert capacity.holders() == sorted(held)


def test_a_hosts_lease_is_freed_when_its_run_has_finished_or_never_recorded_a_cluster(
    gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What any worker can check, from the run's state.json in the bucket."""
    capacity = ClusterCapacity(f"{gcs_bucket}/_leases/hosts.json", 3, run_cluster_gone)
    live, done, died = (RunLayout(f"{gcs_bucket}/job/{run}") for run in ("live", "done", "died"))
    for layout in (live, done):
        state.record_cluster(layout, {"backend": "hosts", "run": layout.root.rsplit("/", 1)[-1]})
    state.finish_run(done, "success")
    for layout, host in ((live, "10.0.0.1"), (done, "10.0.0.2"), (died, "10.0.0.3")):
        assert capacity.acquire(layout.root.rsplit("/", 1)[-1], hosts=(host,), run_dir=layout.root)
    assert capacity.holders() == ["died", "done", "live"]
    monkeypatch.setattr(ClusterCapacity, "STALE_SECONDS", 0.0)  # old enough to be checked; died:
    # no cluster yet, but its provisioning may still be creating VMs
    assert not capacity.acquire("next", hosts=("10.0.0.1",), run_dir=f"{gcs_bucket}/job/next")
    assert capacity.acquire("next", hosts=("10.0.0.2",), run_dir=f"{gcs_bucket}/job/next")
    assert capacity.holders() == ["died", "live", "next"]
    monkeypatch.setattr("syncswitch_airflow.backends.base.PROVISIONING_SECONDS", 0.0)
    assert capacity.acquire("last", hosts=("10.0.0.3",), run_dir=f"{gcs_bucket}/job/last")
    assert capacity.holders() == ["last", "live"]  # died and next recorded no cluster in time


def test_the_ledger_is_where_the_deployment_setting_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCSWITCH_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("SYNCSWITCH_LEASES_DIR", raising=False)
    assert leases_uri("hosts") == f"{tmp_path}/work/leases/hosts.json"
    monkeypatch.setenv("SYNCSWITCH_LEASES_DIR", "gs://deployment/syncswitch/_leases/")
    assert leases_uri("gce") == "gs://deployment/syncswitch/_leases/gce.json"


def test_a_distributed_airflow_is_refused_a_ledger_in_each_workers_own_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, leases_dir is in each worker's work folder: right on one machine, a per-worker count
    (and hosts given twice) where workers run on other machines. There, validate refuses to run."""
    celery = "airflow.providers.celery.executors.celery_executor.CeleryExecutor"
    monkeypatch.delenv("SYNCSWITCH_LEASES_DIR", raising=False)
    monkeypatch.delenv("AIRFLOW__SYNCSWITCH__LEASES_DIR", raising=False)
    assert capacity_refusal("LocalExecutor") == ""
    assert capacity_refusal("syncswitch_airflow.warm_start.WarmLocalExecutor") == ""
    refusal = capacity_refusal(celery)
    assert "[syncswitch] leases_dir is unset" in refusal and "CeleryExecutor" in refusal
    assert "KubernetesExecutor" in capacity_refusal("LocalExecutor,KubernetesExecutor")
    monkeypatch.setenv("AIRFLOW__SYNCSWITCH__LEASES_DIR", "gs://deployment/_leases")
    assert capacity_refusal(celery) == ""
    monkeypatch.setenv("AIRFLOW__SYNCSWITCH__LEASES_DIR", "/mnt/shared/leases")  # a shared mount: trusted
    assert capacity_refusal(celery) == ""
