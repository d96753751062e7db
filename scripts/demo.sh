#!/usr/bin/env bash
# The README's first command: install everything from the lock, then run the main job
# (`syncswitch run`: an embedded Airflow triggers the sync_switch DAG with the default params).
# Extra arguments go to `syncswitch run`, e.g. scripts/demo.sh --keep-ui --switch-order 101.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/_uv.sh
source scripts/_uv.sh
exec uv run --frozen syncswitch run "$@"
