"""One registry of models, problems, hparam sets and hooks, by name (tensor2tensor's vocabulary).

Three sources feed it, and their names are used alike everywhere (``--model``, job files, the Trigger
form, REST conf):

- the runtime's own entries (``BUILTIN_ENTRIES``: ``resnet``, ``cnn``, ``digits``, ...);
- installed packages that declare entry points in the groups ``syncswitch.models``,
  ``syncswitch.problems``, ``syncswitch.hparams`` and ``syncswitch.hooks``
  (``name = "package.module:attribute"``);
- a job's ``usr_dir`` (syncswitch.usercode), whose modules call the decorators below when imported::

      from syncswitch import register_model, register_problem, register_hparams

      @register_model("text_cnn")
      def text_cnn(hp, problem) -> keras.Model: ...

Built-ins and entry points are references (``module:attribute``) loaded on first use, so listing the
names (the Trigger form, validation) imports no TensorFlow. What a name resolves to:

- model: ``builder(hp, problem) -> keras.Model``;
- problem: a ``syncswitch.problems.Problem`` subclass (instantiated without arguments) or instance;
- hparams: ``factory() -> syncswitch.hparams.HParams`` (or an HParams instance);
- hooks: a class (instantiated without arguments) or an object with ``on_checkpoint(step, path)``
  and/or ``on_evaluate(step, metrics)``, called on the chief (syncswitch.hooks).

The registry is this process's one table (``REGISTRY``), as Keras' serializable registry is: user
code registers by importing a module, which has no other way to reach it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from syncswitch.errors import SpecError

KINDS = ("model", "problem", "hparams", "backend", "hooks")
ENTRY_POINT_GROUPS = {
    "model": "syncswitch.models",
    "problem": "syncswitch.problems",
    "hparams": "syncswitch.hparams",
    "backend": "syncswitch.backends",
    "hooks": "syncswitch.hooks",
}
# The field of a job that names an entry of each kind (for error messages).
FIELDS = {
    "model": "model",
    "problem": "problem",
    "hparams": "hparam_set",
    "backend": "cluster_backend",
    "hooks": "hooks",
}

BUILTIN_ENTRIES: dict[str, dict[str, str]] = {
    "model": {"resnet": "syncswitch.models:resnet", "cnn": "syncswitch.models:cnn"},
    "problem": {
        "digits": "syncswitch.problems:DigitsProblem",
        "image_cifar10": "syncswitch.problems:cifar10",
        "image_cifar100": "syncswitch.problems:cifar100",
        "synthetic_cifar": "syncswitch.problems:SyntheticCifarProblem",
    },
    "hparams": {
        "resnet_cifar_20": "syncswitch.hparams:resnet_cifar_20",
        "resnet_cifar_32": "syncswitch.hparams:resnet_cifar_32",
        "resnet_cifar_56": "syncswitch.hparams:resnet_cifar_56",
        "cnn_digits": "syncswitch.hparams:cnn_digits",
    },
    # Cluster backends live on the Airflow side (syncswitch_airflow.backends.get_backend loads them);
    # the runtime only needs their names, to validate a job's cluster_backend.
    "backend": {
        "local": "syncswitch_airflow.backends.local:LocalBackend",
        "hosts": "syncswitch_airflow.backends.hosts:HostsBackend",
        "gce": "syncswitch_airflow.backends.gce:GceBackend",
    },
}
BUILTIN_SOURCE = "built-in"


class UnknownNameError(SpecError):
    """A name that no source registered; the message lists the accepted names."""


class RegistrationError(ValueError):
    """Two different objects registered under one name."""


@dataclass
class Entry:
    """One registered name: a loaded object, or a ``module:attribute`` reference loaded on first use."""

    kind: str
    name: str
    source: str  # "built-in", "entry point <distribution> <version>", or "<file>" of a usr_dir module
    reference: str = ""
    obj: Any = None
    loaded: bool = False

    def load(self) -> Any:
        if not self.loaded:
            module_name, _, attribute = self.reference.partition(":")
            target: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                target = getattr(target, part)
            self.obj, self.loaded = target, True
        return self.obj


class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._instances: dict[tuple[str, str], Any] = {}
        self._entry_points_read = False
        for kind, refs in BUILTIN_ENTRIES.items():
            for name, reference in refs.items():
                self._entries[kind][name] = Entry(kind, name, BUILTIN_SOURCE, reference=reference)

    # ---- registration ------------------------------------------------------------------------------

    def add(self, kind: str, name: str, obj: Any, source: str) -> None:
        """Register a loaded object. Re-registering the same definition (a module imported again)
        replaces it; another definition under a taken name is an error naming both."""
        self._read_entry_points()
        current = self._entries[kind].get(name)
        if current is not None and not _same_definition(current, obj, source):
            raise RegistrationError(
                f"{FIELDS[kind]} {name!r}: registered twice, by {current.source} and by {source}; "
                "rename one of them"
            )
        self._entries[kind][name] = Entry(kind, name, source, obj=obj, loaded=True)
        self._instances.pop((kind, name), None)

    def _read_entry_points(self) -> None:
        if self._entry_points_read:
            return
        self._entry_points_read = True
        for kind, group in ENTRY_POINT_GROUPS.items():
            for point in metadata.entry_points(group=group):
                dist = getattr(point, "dist", None)
                source = f"entry point of {dist.name} {dist.version}" if dist else "an entry point"
                if point.name in self._entries[kind]:
                    raise RegistrationError(
                        f"{FIELDS[kind]} {point.name!r}: registered twice, by "
                        f"{self._entries[kind][point.name].source} and by {source}; rename one of them"
                    )
                self._entries[kind][point.name] = Entry(kind, point.name, source, reference=point.value)

    # ---- lookup -----------------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        self._read_entry_points()
        return sorted(self._entries[kind])

    def entry(self, kind: str, name: str) -> Entry:
        self._read_entry_points()
        if name not in self._entries[kind]:
            raise UnknownNameError(
                FIELDS[kind], f"unknown {name!r}; accepted: {', '.join(self.names(kind)) or 'none'}"
            )
        return self._entries[kind][name]

    def get(self, kind: str, name: str) -> Any:
        """The model builder, the problem instance (made once, ``name`` set), the HParams or the hooks
        object (made once)."""
        key = (kind, name)
        if key not in self._instances:
            obj = self.entry(kind, name).load()
            if kind == "problem":
                obj = obj() if inspect.isclass(obj) or inspect.isfunction(obj) else obj
                if getattr(obj, "name", None) != name:
                    _set_name(obj, name)
            elif kind == "hparams" and callable(obj) or kind == "hooks" and inspect.isclass(obj):
                obj = obj()
            self._instances[key] = obj
        return self._instances[key]

    def sources(self) -> dict[str, dict[str, str]]:
        """Where each name comes from, per kind (for reports and ``syncswitch registry``)."""
        self._read_entry_points()
        return {
            kind: {name: entry.source for name, entry in sorted(entries.items())}
            for kind, entries in self._entries.items()
        }


def _same_definition(current: Entry, obj: Any, source: str) -> bool:
    if current.source != source:
        return False
    if current.loaded and current.obj is obj:
        return True
    return getattr(current.obj, "__qualname__", None) == getattr(obj, "__qualname__", object())


def _set_name(problem: Any, name: str) -> None:
    # Problems are often frozen dataclasses; the registered name wins over a class default.
    object.__setattr__(problem, "name", name)


REGISTRY = Registry()


def _register(kind: str, name: str | None) -> Callable[[Any], Any]:
    def decorate(obj: Any) -> Any:
        defined = inspect.isclass(obj) or inspect.isfunction(obj)
        source = (inspect.getsourcefile(obj) if defined else None) or getattr(obj, "__module__", "?")
        REGISTRY.add(kind, name or getattr(obj, "__name__", ""), obj, source)
        return obj

    return decorate


def register_model(name: str | None = None) -> Callable[[Any], Any]:
    """Register ``builder(hp, problem) -> keras.Model`` under ``name`` (default: the function's)."""
    return _register("model", name)


def register_problem(name: str | None = None) -> Callable[[Any], Any]:
    """Register a Problem subclass (or a function returning a Problem) under ``name``."""
    return _register("problem", name)


def register_hparams(name: str | None = None) -> Callable[[Any], Any]:
    """Register ``factory() -> HParams`` under ``name`` (the hparam_set)."""
    return _register("hparams", name)


def register_hooks(name: str | None = None) -> Callable[[Any], Any]:
    """Register a hooks class (or object) under ``name``, which a job's ``hooks`` field names."""
    return _register("hooks", name)
