"""The Airflow side's bucket client comes from an Airflow connection (``[syncswitch] gcp_conn_id``),
through the Google provider's GCSHook; training code keeps storage's plain client."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException
from syncswitch import storage
from syncswitch_airflow.hooks.bucket import BucketHook, bucket_client, with_bucket_credentials
from syncswitch_airflow.hooks.compute import ComputeHook

CONN = {"conn_type": "google_cloud_platform", "extra": {"is_anonymous": True, "project": "from-the-conn"}}


@pytest.fixture
def connection(monkeypatch: pytest.MonkeyPatch, gcs_emulator: str) -> str:
    """An anonymous Google connection (the emulator takes no credentials) with a project of its own,
    so that a client made from it can be told apart from storage's default one."""
    monkeypatch.setenv("AIRFLOW_CONN_RUN_BUCKET", json.dumps(CONN))
    monkeypatch.setenv("SYNCSWITCH_GCP_CONN_ID", "run_bucket")
    return "run_bucket"


def test_inside_a_hook_every_bucket_call_uses_the_connections_client_made_once(
    connection: str, gcs_bucket: str
) -> None:
    hook = BucketHook()
    assert hook.gcp_conn_id == connection
    with hook.credentials():
        client = storage.gcs_client()
        assert client.project == "from-the-conn"
        storage.write_text(f"{gcs_bucket}/state.json", "{}")
        assert storage.gcs_client() is client  # one client per hook, not one per call
    assert storage.read_text(f"{gcs_bucket}/state.json") == "{}"
    assert storage.gcs_client() is storage.default_client()  # the block ended


def test_a_block_that_touches_no_bucket_reads_no_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCSWITCH_GCP_CONN_ID", "not_defined_anywhere")
    with BucketHook().credentials():
        pass  # the validate task of a local run: no connection needed, none read


def test_threads_carry_the_client_only_where_asked(connection: str) -> None:
    seen: dict[str, str] = {}

    def project(name: str) -> None:
        seen[name] = storage.gcs_client().project

    with BucketHook().credentials(), ThreadPoolExecutor(2) as pool:
        pool.submit(storage.carry_context(project), "carried").result()
        [done] = storage.submit_each(pool, project, ["each"])
        done.result()
        pool.submit(project, "bare").result()
    assert seen == {
        "carried": "from-the-conn",
        "each": "from-the-conn",
        "bare": storage.default_client().project,
    }


def test_a_triggers_blocking_calls_run_in_a_thread_with_the_client(connection: str) -> None:
    hook = BucketHook()

    def call() -> tuple[str, bool]:
        return storage.gcs_client().project, threading.current_thread() is threading.main_thread()

    assert asyncio.run(hook.in_thread(call)) == ("from-the-conn", False)


def test_an_operator_method_runs_with_the_credentials(connection: str) -> None:
    class Operator:
        @with_bucket_credentials
        def execute(self, context: dict) -> str:
            return storage.gcs_client().project

    assert Operator().execute({}) == "from-the-conn"


def test_a_named_connection_must_exist_the_default_one_may_not(
    monkeypatch: pytest.MonkeyPatch, gcs_emulator: str
) -> None:
    with pytest.raises(AirflowNotFoundException, match="gcp_conn_id.*'missing_conn'"):
        bucket_client("missing_conn")
    # The embedded default defines no connection: the worker's default credentials, as before.
    monkeypatch.delenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", raising=False)
    assert bucket_client("google_cloud_default") is storage.default_client()


def test_compute_engine_calls_use_the_same_connection(connection: str) -> None:
    assert ComputeHook().gcp_conn_id == connection
