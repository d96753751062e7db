"""A poll loop on a background thread, as a context manager: the helpers that watch or drive a run
while the test (or benchmark) waits for it: a ledger watcher, a launch killer, event writers, samplers."""

from __future__ import annotations

import threading
from typing import Self


class Poller:
    """Calls ``poll()`` every ``every`` seconds on a daemon thread, from entering the ``with`` block
    until it ends or ``poll()`` returns True (done); the first call comes at once."""

    def __init__(self, every: float, join_seconds: float | None = 10.0) -> None:
        self.every, self.join_seconds = every, join_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> bool | None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.poll():
                return
            self._stop.wait(self.every)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_seconds)
