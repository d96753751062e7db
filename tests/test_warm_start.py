"""The WarmLocalExecutor's wait for a task's end: a worker's result, a deferred task that ended on the
triggerer or a newly triggered run ends it (a run triggered since the previous wait ends the next one
at once); the database is asked every 0.2 s while a task is deferred and every 0.5 s otherwise."""

from __future__ import annotations

import multiprocessing
import threading

from syncswitch_airflow.warm_start import wait_for_an_end


class Looks:
    """(deferred tasks, newest run id) as the database would answer, look after look (None: it did
    not answer)."""

    def __init__(self, *answers: tuple[int, int] | None) -> None:
        self.answers, self.calls = list(answers), 0

    def __call__(self) -> tuple[int, int] | None:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


def test_a_workers_result_ends_the_wait() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    timer = threading.Timer(0.1, writer.send, args=("task ended",))
    timer.start()
    try:
        assert wait_for_an_end(reader.poll, Looks((0, 7)), seconds=30.0)[0]
    finally:
        timer.cancel()
    assert reader.recv() == "task ended", "the wait must leave the result for the executor to read"


def test_a_deferred_task_that_ends_on_the_triggerer_ends_the_wait() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((2, 7), (2, 7), (2, 7), (1, 7))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, deferred_look_seconds=0.01) == (True, (1, 7))
    assert looks.calls == 4


def test_a_triggered_run_ends_the_wait() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((0, 7), (0, 7), (0, 8))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, queued_look_seconds=0.01) == (True, (0, 8))
    assert looks.calls == 3


def test_a_run_triggered_between_two_waits_ends_the_next_at_once() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    looks = Looks((0, 8))
    assert wait_for_an_end(reader.poll, looks, seconds=30.0, since=(0, 7)) == (True, (0, 8))
    assert looks.calls == 1
    # Nothing new since the last look: the wait runs its time.
    assert wait_for_an_end(reader.poll, Looks((0, 8)), seconds=0.2, since=(0, 8)) == (False, (0, 8))


def test_nothing_deferred_is_asked_less_often_and_a_silent_database_changes_nothing() -> None:
    reader, _writer = multiprocessing.Pipe(duplex=False)
    idle, busy, silent = Looks((0, 7)), Looks((3, 7)), Looks(None, (0, 7), None)
    timing = {"seconds": 0.3, "deferred_look_seconds": 0.01, "queued_look_seconds": 0.1}
    assert wait_for_an_end(reader.poll, idle, **timing) == (False, (0, 7))
    assert wait_for_an_end(reader.poll, busy, **timing) == (False, (3, 7))
    assert 2 <= idle.calls <= 5 and busy.calls > 10
    assert not wait_for_an_end(reader.poll, silent, **timing)[0]
