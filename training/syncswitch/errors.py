"""The user-input error every entry point raises (DAG params, job files, CLI, REST conf)."""

from __future__ import annotations


class SpecError(ValueError):
    """Bad user input. ``field`` names the parameter; the message says what is accepted."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
