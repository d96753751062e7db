"""The base of this provider's triggers: ``serialize`` from the trigger's own ``__init__``.

Airflow rebuilds a trigger on the triggerer as ``classpath(**kwargs)``, from what ``serialize``
returned. Every parameter of a trigger's ``__init__`` is kept as the attribute of the same name, so
those parameters are the trigger's fields: a field added to ``__init__`` is serialized without a
second list to keep in step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

# Triggers are not in airflow.sdk (3.3): airflow.triggers.base is their public home.
from airflow.triggers.base import BaseTrigger

_NOT_FIELDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@functools.cache
def trigger_fields(trigger_class: type[BaseTrigger]) -> tuple[str, ...]:
    """The named parameters of ``trigger_class.__init__``, in their order (``self`` left out)."""
    parameters = inspect.signature(trigger_class.__init__).parameters.values()
    return tuple(p.name for p in parameters if p.name != "self" and p.kind not in _NOT_FIELDS)


class FieldsTrigger(BaseTrigger):
    """A trigger that keeps each ``__init__`` parameter as the attribute of the same name, and is
    serialized as those attributes under its own classpath."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        classpath = f"{type(self).__module__}.{type(self).__qualname__}"
        return classpath, {name: getattr(self, name) for name in trigger_fields(type(self))}
