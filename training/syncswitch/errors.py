"""The errors the runtime's entry points raise: bad user input (DAG params, job files, CLI, REST conf),
and a segment that failed."""

from __future__ import annotations


class SpecError(ValueError):
    """Bad user input. ``field`` names the parameter; the message says what is accepted."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class SegmentFailed(RuntimeError):
    """The segment did not reach its end; the message says which process failed and where its log is."""
