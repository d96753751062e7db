"""The real Airflow UI in a real browser: Debian's Chromium, driven by Playwright pointed at the system
browser, logged in to the session's embedded Airflow as its admin (test_trigger_form, test_report_tab)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator

import pytest
from syncswitch_airflow.embedded.airflow import EmbeddedAirflow
from syncswitch_airflow.embedded.boot import wait_healthy
from syncswitch_airflow.embedded.instance import ADMIN_PASSWORD, ADMIN_USER

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (scripts/test.sh installs it as root)"
)


@contextlib.contextmanager
def logged_in_page(airflow: EmbeddedAirflow) -> Iterator:  # noqa: ANN201 - playwright Page
    """A page of a new browser, logged in to ``airflow``'s UI; the browser closes with the block."""
    from playwright.sync_api import sync_playwright

    # The supervisor may be restarting the api-server (after an earlier test's kill, or its own kill
    # of one that hung): the browser's first page load would be refused while uvicorn is not
    # listening yet (it was, once, 8 s after such a restart).
    wait_healthy(airflow, time.monotonic() + 180)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(airflow.url + "/")
            page.get_by_label("Username").fill(ADMIN_USER)
            page.get_by_label("Password").fill(ADMIN_PASSWORD)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url("**/")
            yield page
        finally:
            browser.close()
