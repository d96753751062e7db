#!/usr/bin/env bash
# The README's second command: install everything from the lock, lint, run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k cli -x.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/_uv.sh
source scripts/_uv.sh
# shellcheck source=scripts/_system_deps.sh
source scripts/_system_deps.sh
uv run --frozen ruff check .
# Each distribution declares every module it imports, and imports every package it declares:
# the runtime (training/), the Airflow provider (plugins/ and the DAGs it ships), the test infrastructure.
uv run --frozen deptry training --config training/pyproject.toml
uv run --frozen deptry plugins dags --config plugins/pyproject.toml
uv run --frozen deptry testing --config testing/pyproject.toml
# Two xdist workers by default, for CI's 2 cores (--dist loadgroup: tests/conftest.py keeps each file
# on one worker and every test of the session's embedded Airflow on one, and queues the longest groups
# first): 34-42 min from a clean clone on a quiet machine here, 29-33 min on CI (docs/benchmarks.md,
# "The test suite").
# SYNCSWITCH_TEST_WORKERS=0 runs it in one process, in the files' order.
# -p no:cacheprovider: no .pytest_cache in the checkout; --durations: where the minutes go.
exec uv run --frozen pytest -q -p no:cacheprovider -n "${SYNCSWITCH_TEST_WORKERS:-2}" --dist loadgroup \
    --no-loadscope-reorder --durations=15 "$@"
