"""A user's hooks, Keras callbacks' style: called on the segment's chief at each checkpoint and evaluation.

    from syncswitch.hooks import Hooks
    from syncswitch.registry import register_hooks

    @register_hooks("notify")
    class Notify(Hooks):
        def on_checkpoint(self, step: int, path: str) -> None: ...       # a checkpoint was written
        def on_evaluate(self, step: int, metrics: dict[str, float]) -> None: ...  # test_accuracy, ...

A job names the hooks it runs (the ``hooks`` field). Only the chief calls them (BSP's worker 0, ASP's
coordinator): it alone writes checkpoints and evaluates, so each hook sees each event once per run.
``step`` is the BSP-equivalent global step of the checkpoint (a whole step); ``path`` its folder (a
local path or a ``gs://`` URI), complete when the hook runs. ``on_evaluate`` follows each evaluation of
a checkpoint: every one with ``evaluate_checkpoints``, and a segment's last with ``evaluate_segments``
(the final model's whenever the last segment evaluates it; the pipeline's evaluate task, which
evaluates where no segment did, runs on an Airflow worker and calls no hook).

Hooks run in the chief's training loop, between executions: a slow hook delays training, so hand long
work (an upload, a request) to a thread of its own. A hook's error is logged (stderr and a
``hook_error`` event) and training goes on: a hook is a side channel, and the checkpoint it was told
about is already written.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from syncswitch.errors import SpecError
from syncswitch.events import EventWriter

HOOK_METHODS = ("on_checkpoint", "on_evaluate")


class NotAHookError(SpecError):
    """A registered hooks entry whose object has neither hook method (bad input of the hooks field)."""


class Hooks:
    """A base to subclass (optional: any object with either method will do); both methods do nothing."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """A checkpoint of global step ``step`` was written at ``path``."""

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """The checkpoint of global step ``step`` was evaluated: ``metrics`` holds test_loss,
        test_accuracy and the problem's other test metrics."""


def load_hooks(names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(name, hook object) of each registered name; SpecError naming the field for an unknown name or
    an object with neither method (NotAHookError)."""
    from syncswitch.registry import REGISTRY

    hooks = []
    for name in names:
        hook = REGISTRY.get("hooks", name)
        if not any(callable(getattr(hook, method, None)) for method in HOOK_METHODS):
            raise NotAHookError(
                "hooks",
                f"{name!r} ({REGISTRY.entry('hooks', name).source}): {type(hook).__name__} has "
                f"neither {' nor '.join(HOOK_METHODS)}",
            )
        hooks.append((name, hook))
    return hooks


class HookRunner:
    """Calls the job's hooks on the chief; an error is reported, never raised."""

    def __init__(self, names: tuple[str, ...], events: EventWriter) -> None:
        self.hooks = load_hooks(names)
        self.events = events
        self._evaluated: set[int] = set()

    def checkpoint(self, step: int, path: str) -> None:
        self._call("on_checkpoint", step, path)

    def evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        """Once per evaluated step: the segment's final evaluation may repeat its last checkpoint's."""
        if step in self._evaluated:
            return
        self._evaluated.add(step)
        tests = {k: float(v) for k, v in metrics.items() if k.startswith("test_")}
        self._call("on_evaluate", step, tests)

    def _call(self, method: str, *args: Any) -> None:
        for name, hook in self.hooks:
            function = getattr(hook, method, None)
            if not callable(function):
                continue
            try:
                function(*args)
            except Exception as exc:  # noqa: BLE001 - a hook's failure is reported, training goes on
                error = f"{type(exc).__name__}: {exc}"
                where = _user_frame(exc)
                print(
                    f"hooks {name!r}: {method}{args[:1]} failed ({where}): {error}",
                    file=sys.stderr,
                    flush=True,
                )
                self.events.emit(
                    "hook_error", hook=name, method=method, step=args[0], error=error, where=where
                )


def _user_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the hook's traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
