"""The embedded Airflow's triggerer: ``airflow triggerer``, with its execution API built as it starts.

A trigger's calls to the task SDK (a watcher asks for its segment task's state) reach the triggerer's
main process, which answers them through an execution API it builds in-process on the first such
call: seconds of CPU (FastAPI and Cadwyn's versioned routes), which on a fresh instance would come
just as the first segment starts up and trains on the same cores. Built in a thread as the triggerer
starts, it is ready before any run.

A long-lived triggerer of a deployment pays those seconds once in its life, at its first run; this
module is for the embedded Airflow, which ``syncswitch run`` starts for one run.

It also makes the triggerer's supervisor reap its trigger runner as soon as the runner's sockets have
closed (``warm_start.reap_exiting_processes``): else a stop can wait out the escalation delay in a
select() on no socket.

    python -m syncswitch_airflow.embedded.triggerer     # in place of: airflow triggerer
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def build_execution_api_at_start() -> None:
    """Make each TriggerRunnerSupervisor this process starts build its API client (and with it the
    in-process execution API) in a thread of its own, as soon as it has started."""
    from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor

    start = TriggerRunnerSupervisor.start.__func__  # type: ignore[attr-defined]
    if getattr(start, "builds_execution_api_at_start", False):
        return

    def start_and_build(
        cls: type[TriggerRunnerSupervisor], *args: Any, **kwargs: Any
    ) -> TriggerRunnerSupervisor:
        supervisor = start(cls, *args, **kwargs)
        threading.Thread(target=_build_client, args=(supervisor,), name="execution-api", daemon=True).start()
        return supervisor

    start_and_build.builds_execution_api_at_start = True  # type: ignore[attr-defined]
    TriggerRunnerSupervisor.start = classmethod(start_and_build)  # type: ignore[assignment,method-assign]


def _build_client(supervisor: Any) -> None:
    started = time.monotonic()
    try:
        # The client (a cached property) builds the app; the app builds its routes on its first request.
        supervisor.client.get("health")
    except Exception as exc:  # noqa: BLE001 - a head start only: the first trigger call builds it otherwise
        log.warning("could not build the triggerer's execution API ahead of its first use: %s", exc)
        return
    log.info("execution API ready for the triggers (built in %.1f s)", time.monotonic() - started)


def main() -> int:
    from syncswitch_airflow.warm_start import reap_exiting_processes

    build_execution_api_at_start()
    reap_exiting_processes()
    from airflow.__main__ import main as airflow_main

    sys.argv = ["airflow", "triggerer", *sys.argv[1:]]
    return airflow_main() or 0


if __name__ == "__main__":
    sys.exit(main())
