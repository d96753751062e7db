"""Hyper-parameter sets, named and keyed as in tensor2tensor so the original's flags still work.

``--hparam-set resnet_cifar_32`` picks a base set; ``--hparams "learning_rate=0.4,batch_size=64"``
(one string per segment) overrides keys of it. Values are parsed to the type of the base value.

``learning_rate`` is the rate for the BSP global batch (num_workers x batch_size). Under ASP each worker
applies batch_size-sample updates, so the configuration policy divides it by num_workers (linear
scaling), as the paper did (BSP 1024 @ 0.8 -> ASP 128 @ 0.1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class HParamsError(ValueError):
    """A bad hparam_set name, override key or override value; the message names the accepted values."""


@dataclass(frozen=True)
class HParams:
    model: str
    batch_size: int = 128
    learning_rate: float = 0.1
    learning_rate_decay_scheme: str = "cosine"  # cosine | piecewise | constant
    learning_rate_warmup_steps: int = 0
    # piecewise: at each boundary (fraction of the job's total steps) multiply by the multiple
    learning_rate_boundaries: tuple[float, ...] = (0.5, 0.75)
    learning_rate_multiples: tuple[float, ...] = (0.1, 0.01)
    # momentum (SGD, the paper's) | adam | adamw (syncswitch.optim). Every segment of a job uses the
    # same one: its slots are handed over at each switch.
    optimizer: str = "momentum"
    optimizer_momentum_momentum: float = 0.9
    optimizer_momentum_nesterov: bool = True
    # Keras' defaults. beta1 stays as set under every protocol (spec.switch_config says why).
    optimizer_adam_beta1: float = 0.9
    optimizer_adam_beta2: float = 0.999
    optimizer_adam_epsilon: float = 1e-7
    # momentum, adam: t2t's L2 term (weight_decay * variable added to the gradient); adamw: the
    # decoupled decay, each update shrinking a decayed variable by learning_rate * weight_decay.
    weight_decay: float = 1e-4
    # Optimizer steps per tf.function execution (an ASP closure, a BSP call); 0 = automatic, about
    # 330 ms of steps (syncswitch.trainer.steps_per_execution). Numerics do not depend on it.
    steps_per_execution: int = 0
    # model shape
    resnet_depth: int = 20
    num_filters: int = 16
    # A user model's own hparams (``embedding_dim=32``...): read as attributes (``hp.embedding_dim``),
    # overridden with ``k=v`` like the fields above, and part of the checkpoint signature.
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.extra, dict):
            object.__setattr__(self, "extra", tuple(sorted(self.extra.items())))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: a user model's extra hparams.
        for key, value in self.__dict__.get("extra", ()):
            if key == name:
                return value
        raise AttributeError(f"hparams has no {name!r} (fields and extra: {', '.join(self.keys())})")

    def keys(self) -> list[str]:
        return sorted(
            [f.name for f in dataclasses.fields(self) if f.name not in ("model", "extra")]
            + [k for k, _ in self.extra]
        )

    def override(self, overrides: str | dict[str, str] | None) -> HParams:
        """Return a copy with ``k=v,k=v`` overrides applied (values parsed to the field's type)."""
        pairs = parse_overrides(overrides) if isinstance(overrides, str | None) else overrides
        if not pairs:
            return self
        changes: dict[str, Any] = {}
        extra = dict(self.extra)
        for key, raw in pairs.items():
            if key not in self.keys():
                raise HParamsError(f"hparams: unknown key {key!r}; accepted keys: {', '.join(self.keys())}")
            if key in extra:
                extra[key] = _parse_value(key, raw, extra[key])
            else:
                changes[key] = _parse_value(key, raw, getattr(self, key))
        updated = dataclasses.replace(self, **changes, extra=tuple(sorted(extra.items())))
        updated.validate()
        return updated

    def validate(self) -> None:
        if self.batch_size < 1:
            raise HParamsError(f"hparams: batch_size must be >= 1, got {self.batch_size}")
        if not self.learning_rate > 0:
            raise HParamsError(f"hparams: learning_rate must be > 0, got {self.learning_rate}")
        if self.learning_rate_decay_scheme not in LR_SCHEMES:
            raise HParamsError(
                f"hparams: learning_rate_decay_scheme {self.learning_rate_decay_scheme!r} is not one of "
                f"{', '.join(LR_SCHEMES)}"
            )
        if len(self.learning_rate_boundaries) != len(self.learning_rate_multiples):
            raise HParamsError(
                "hparams: learning_rate_boundaries and learning_rate_multiples need the same length"
            )
        if self.optimizer not in OPTIMIZERS:
            raise HParamsError(f"hparams: optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not 0 <= self.optimizer_momentum_momentum < 1:
            raise HParamsError("hparams: optimizer_momentum_momentum must be in [0, 1)")
        for name in ("optimizer_adam_beta1", "optimizer_adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise HParamsError(f"hparams: {name} must be in [0, 1)")
        if not self.optimizer_adam_epsilon > 0:
            raise HParamsError("hparams: optimizer_adam_epsilon must be > 0")
        if self.weight_decay < 0:
            raise HParamsError("hparams: weight_decay must be >= 0")
        if not 0 <= self.steps_per_execution <= 1000:
            raise HParamsError("hparams: steps_per_execution must be in 0..1000 (0 = automatic)")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["extra"] = dict(self.extra)
        return data

    def shape_signature(self) -> dict[str, Any]:
        """The hparams that decide the model's variables, for checkpoint signatures."""
        shape = {"depth": self.resnet_depth if self.model == "resnet" else None, "filters": self.num_filters}
        return {**shape, **({"model_hparams": dict(self.extra)} if self.extra else {})}


LR_SCHEMES = ("cosine", "piecewise", "constant")
OPTIMIZERS = ("momentum", "adam", "adamw")


def first_moment(hp: HParams) -> float:
    """The optimizer's first-moment coefficient: momentum SGD's momentum, Adam's beta1."""
    return hp.optimizer_momentum_momentum if hp.optimizer == "momentum" else hp.optimizer_adam_beta1


def check_one_optimizer(segments: list[HParams]) -> None:
    """HParamsError unless every segment's hparams name the same optimizer: each switch hands its slots
    over, and another optimizer has other slots."""
    names = sorted({hp.optimizer for hp in segments})
    if len(names) > 1:
        raise HParamsError(
            f"hparams: optimizer must be the same in every segment (its slots are handed over at each "
            f"switch); got {', '.join(names)}"
        )


def _resnet(depth: int) -> HParams:
    # He et al. 2016 CIFAR ResNets, as in t2t's resnet_cifar_* sets: 128/worker, cosine decay,
    # Nesterov momentum 0.9, weight decay 1e-4.
    return HParams(model="resnet", resnet_depth=depth)


# The built-in sets; syncswitch.registry names them (BUILTIN_ENTRIES) like any registered set.
def resnet_cifar_20() -> HParams:
    return _resnet(20)


def resnet_cifar_32() -> HParams:
    return _resnet(32)


def resnet_cifar_56() -> HParams:
    return _resnet(56)


def cnn_digits() -> HParams:
    """The embedded demo: a small CNN on scikit-learn's 8x8 digits."""
    return HParams(
        model="cnn",
        batch_size=32,
        learning_rate=0.1,
        optimizer_momentum_momentum=0.9,
        weight_decay=1e-4,
        num_filters=16,
    )


def hparam_set_names() -> list[str]:
    from syncswitch.registry import REGISTRY

    return REGISTRY.names("hparams")


def get_hparams(hparam_set: str, model: str | None = None) -> HParams:
    """The named set (built-in, an entry point or a usr_dir's); checks that it belongs to ``model``
    when one is given."""
    from syncswitch.registry import REGISTRY, UnknownNameError

    try:
        hp = REGISTRY.get("hparams", hparam_set)
    except UnknownNameError as err:
        raise HParamsError(str(err)) from None
    if not isinstance(hp, HParams):
        raise HParamsError(
            f"hparam_set: {hparam_set!r} ({REGISTRY.entry('hparams', hparam_set).source}) gave "
            f"{type(hp).__name__}, not syncswitch.hparams.HParams"
        )
    if model is not None and hp.model != model:
        accepted = [n for n in REGISTRY.names("hparams") if _model_of(REGISTRY, n) == model]
        raise HParamsError(
            f"hparam_set: {hparam_set!r} is for model {hp.model!r}, not {model!r}; "
            f"accepted for {model!r}: {', '.join(accepted) or 'none'}"
        )
    return hp


def _model_of(registry: Any, name: str) -> str | None:
    try:
        return getattr(registry.get("hparams", name), "model", None)
    except Exception:  # noqa: BLE001 - a broken user set only drops out of the suggestion list
        return None


def parse_overrides(text: str | None) -> dict[str, str]:
    """Parse the original's ``k=v,k=v`` form. Values may be quoted; tuples use ``;`` (``a=0.5;0.75``)."""
    if not text or not text.strip():
        return {}
    pairs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not key.isidentifier():
            raise HParamsError(f"hparams: malformed item {item!r} in {text!r}; expected k=v,k=v")
        pairs[key] = value.strip().strip("'\"")
    return pairs


def _parse_value(key: str, raw: str, current: object) -> object:
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        if isinstance(current, str):
            return raw
        if isinstance(current, tuple):
            return tuple(float(v) for v in raw.split(";") if v.strip())
        return raw
    except ValueError:
        raise HParamsError(f"hparams: {key}={raw!r} is not a valid {type(current).__name__}") from None


class PythonOps:
    """The few operations the schedules need, on Python floats. ``syncswitch.trainer`` passes the
    TensorFlow equivalents, so the training graph computes the very same formula per step."""

    cos = staticmethod(math.cos)

    @staticmethod
    def clip(value: float, low: float, high: float) -> float:
        return min(max(value, low), high)

    @staticmethod
    def where(condition: bool, if_true: float, if_false: float) -> float:
        return if_true if condition else if_false


def learning_rate_at(hp: HParams, step: Any, total_steps: float, ops: Any = PythonOps) -> Any:
    """LR for the BSP global batch at BSP-equivalent ``step`` of a job of ``total_steps``.

    A pure function of progress, so the schedule continues smoothly across a protocol switch. With
    TensorFlow ``ops`` and a float64 tensor ``step`` it builds the same computation in a graph.
    """
    base = hp.learning_rate
    frac = ops.clip(step / max(total_steps, 1.0), 0.0, 1.0)
    if hp.learning_rate_decay_scheme == "cosine":
        lr = base * 0.5 * (1.0 + ops.cos(math.pi * frac))
    elif hp.learning_rate_decay_scheme == "piecewise":
        multiple = 1.0 + 0.0 * frac
        for boundary, m in zip(hp.learning_rate_boundaries, hp.learning_rate_multiples, strict=True):
            multiple = ops.where(frac >= boundary, m + 0.0 * frac, multiple)
        lr = base * multiple
    else:
        lr = base + 0.0 * frac
    if hp.learning_rate_warmup_steps > 0:
        warmup = hp.learning_rate_warmup_steps
        lr = ops.where(step < warmup, base * (step + 1.0) / warmup, lr)
    return lr
