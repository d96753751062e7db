"""The WarmLocalExecutor's wait for a task's end: a worker's result or a deferred task that ended on
the triggerer ends it; with nothing deferred the database is asked once per wait."""

from __future__ import annotations

import multiprocessing
import threading

from syncswitch_airflow.warm_start import wait_for_an_end


class DeferredCounts:
    """The deferred task count as the database would answer it, call after call."""

    def __init__(self, *counts: int) -> None:
        self.counts, self.calls = list(counts), 0

    def __call__(self) -> int:
        self.calls += 1
        return self.counts[min(self.calls, len(self.counts)) - 1]


def test_a_workers_result_ends_the_wait() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    timer = threading.Timer(0.1, writer.send, args=("task ended",))
    timer.start()
    try:
        assert wait_for_an_end(reader.poll, DeferredCounts(0), seconds=30.0)
    finally:
        timer.cancel()
    assert reader.recv() == "task ended", "the wait must leave the result for the executor to read"


def test_a_deferred_task_that_ends_on_the_triggerer_ends_the_wait() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    counts = DeferredCounts(2, 2, 2, 1)
    assert wait_for_an_end(reader.poll, counts, seconds=30.0, look_seconds=0.01)
    assert counts.calls == 4


def test_with_nothing_deferred_the_wait_asks_the_database_once_and_times_out() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    counts = DeferredCounts(0, 5)
    assert not wait_for_an_end(reader.poll, counts, seconds=0.3, look_seconds=0.01)
    assert counts.calls == 1


def test_an_unchanged_deferred_count_waits_the_whole_time() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    counts = DeferredCounts(3)
    assert not wait_for_an_end(reader.poll, counts, seconds=0.3, look_seconds=0.05)
    assert counts.calls > 2
