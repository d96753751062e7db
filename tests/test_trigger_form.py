"""The Trigger form of the sync_switch DAG, driven as a new user would: the real Airflow UI in a real
browser (tests/browser.py), on the session's embedded Airflow. It triggers with the defaults and the
run succeeds; a bad value is refused with a message naming the field, and no run is created.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from airflow_runs import DAG_ID, wait_run
from browser import logged_in_page, needs_chromium
from proc_utils import wait_for
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow

pytestmark = [pytest.mark.airflow, pytest.mark.cluster, needs_chromium]


@pytest.fixture
def page(embedded_airflow: EmbeddedAirflow) -> Iterator:  # noqa: ANN201 - playwright Page
    with logged_in_page(embedded_airflow) as page:
        yield page


def open_trigger_form(page, airflow: EmbeddedAirflow):  # noqa: ANN001, ANN201 - playwright types
    page.goto(f"{airflow.url}/dags/{DAG_ID}")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name="Trigger").wait_for()
    return dialog


def run_ids(airflow: EmbeddedAirflow) -> set[str]:
    body = airflow.api.get_json(f"/api/v2/dags/{DAG_ID}/dagRuns?limit=100")
    return {run["dag_run_id"] for run in body["dag_runs"]}


def test_the_trigger_form_submits_its_defaults_and_the_run_succeeds(
    page, embedded_airflow: EmbeddedAirflow
) -> None:  # noqa: ANN001
    before = run_ids(embedded_airflow)
    dialog = open_trigger_form(page, embedded_airflow)
    submit = dialog.get_by_role("button", name="Trigger")
    assert submit.is_enabled(), "the form must submit with its defaults"
    submit.click()
    page.get_by_text("Dag run has been successfully triggered").first.wait_for()
    wait_for(lambda: run_ids(embedded_airflow) - before, timeout=30, what="the new run")
    [run_id] = run_ids(embedded_airflow) - before
    assert wait_run(embedded_airflow, run_id) == "success"


def test_the_trigger_form_refuses_a_bad_value_naming_the_field(
    page, embedded_airflow: EmbeddedAirflow
) -> None:  # noqa: ANN001
    before = run_ids(embedded_airflow)
    dialog = open_trigger_form(page, embedded_airflow)
    # A job name outside its pattern (a switch order's spelling is checked at validate instead,
    # where the message can name the bad segment: test_dag_integrity).
    dialog.locator("#element_job_name").fill("Not A Job Name")
    dialog.get_by_role("button", name="Trigger").click()
    page.get_by_text("Invalid input for param job_name").wait_for()
    assert run_ids(embedded_airflow) == before, "a refused form must not create a run"
