"""The models of the training runtime, named as in tensor2tensor (``--model resnet|cnn``).

    build_model(hp, problem)            -> the keras.Model registered as ``hp.model`` (built-in,
                                           an entry point, or a usr_dir's: syncswitch.registry)
    decayed_weights(model)              -> what weight decay applies to: every weight of rank >= 2
                                           (conv and dense kernels, embeddings)
    example_loss(problem, model)        -> fn(outputs, labels): the per-example loss training and
                                           evaluation use (the model's own, else the problem's)

Checkpoint signatures (what a checkpoint must match to be restored) live in syncswitch.checkpoints,
derived from the hparams and the problem so the launcher can check them without TensorFlow.

``resnet`` is the CIFAR ResNet of He et al. 2016 (section 4.2): depth 6n+2, a 3x3 stem, three stages of
n basic blocks with ``num_filters`` x 1, 2, 4 filters, option-A (parameter-free) shortcuts, global
average pooling and a dense layer. ResNet-20 has 0.27M weights. ``cnn`` is a small CNN for the 8x8
digits demo.

Weight decay is not attached to layers: the optimizer (syncswitch.optim) adds its gradient beside each
kernel, so the same model serves the BSP and ASP strategies. The logged loss is the cross-entropy.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import layers

from syncswitch.hparams import HParams
from syncswitch.problems import Problem

# As in tensor2tensor's resnet: a faster-moving BN average than Keras' 0.99 default, so the moving
# statistics used at evaluation are already good after a few hundred steps.
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5


def build_model(hp: HParams, problem: Problem) -> keras.Model:
    """The model registered as ``hp.model``, built for ``problem``. Builds variables in the current
    distribution strategy scope, if any. A builder that returns no Keras model is named."""
    from syncswitch.registry import REGISTRY

    model = REGISTRY.get("model", hp.model)(hp, problem)
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model {hp.model!r} ({REGISTRY.entry('model', hp.model).source}) returned "
            f"{type(model).__name__}, not a keras.Model"
        )
    if not model.built:
        raise ValueError(
            f"model {hp.model!r} ({REGISTRY.entry('model', hp.model).source}) is not built: its variables "
            "must exist before training (give it an Input, or call model.build(shape) in the builder)"
        )
    return model


def example_loss(problem: Problem, model: keras.Model) -> Any:
    """``fn(outputs, labels) -> per-example loss``: the model's ``example_loss(labels, outputs)`` when
    it defines one, else the problem's ``loss``. (Weight decay is applied by the optimizer, beside
    each variable: see syncswitch.optim.)"""
    loss = getattr(model, "example_loss", None) or problem.loss
    return lambda outputs, labels: loss(labels, outputs)


def resnet(hp: HParams, problem: Problem) -> keras.Model:
    """The CIFAR ResNet of depth ``hp.resnet_depth`` for ``problem``'s image shape and classes."""
    return _resnet(hp.resnet_depth, hp.num_filters, problem.image_shape, problem.num_classes)


def cnn(hp: HParams, problem: Problem) -> keras.Model:
    """The small digits CNN."""
    return _cnn(hp.num_filters, problem.image_shape, problem.num_classes)


# --- ResNet (He et al. 2016, CIFAR variant) ---------------------------------------------------------


@keras.saving.register_keras_serializable(package="syncswitch")
class ZeroPadShortcut(layers.Layer):
    """Option-A shortcut: subsample by 2 and zero-pad the new channels; no weights."""

    def __init__(self, out_channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_channels = out_channels

    def call(self, inputs: Any) -> Any:
        subsampled = inputs[:, ::2, ::2, :]
        extra = self.out_channels - subsampled.shape[-1]
        return keras.ops.pad(subsampled, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        batch, height, width, _ = input_shape
        halve = lambda n: None if n is None else (n + 1) // 2  # noqa: E731 - tiny local helper
        return (batch, halve(height), halve(width), self.out_channels)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "out_channels": self.out_channels}


def _conv(filters: int, strides: int, name: str) -> layers.Conv2D:
    # No bias: the following batch norm has its own shift.
    return layers.Conv2D(
        filters,
        3,
        strides=strides,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",
        name=name,
    )


def _bn(name: str) -> layers.BatchNormalization:
    return layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON, name=name)


def _basic_block(x: Any, filters: int, strides: int, name: str) -> Any:
    shortcut = x
    x = _conv(filters, strides, f"{name}_conv1")(x)
    x = layers.ReLU(name=f"{name}_relu1")(_bn(f"{name}_bn1")(x))
    x = _conv(filters, 1, f"{name}_conv2")(x)
    x = _bn(f"{name}_bn2")(x)
    if strides != 1 or shortcut.shape[-1] != filters:
        shortcut = ZeroPadShortcut(filters, name=f"{name}_shortcut")(shortcut)
    x = layers.Add(name=f"{name}_add")([x, shortcut])
    return layers.ReLU(name=f"{name}_relu2")(x)


def resnet_blocks_per_stage(depth: int) -> int:
    """n of a depth-(6n+2) CIFAR ResNet; ValueError naming the hparam for other depths."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"hparams: resnet_depth must be 6n+2 (20, 32, 44, 56, 110, ...), got {depth}")
    return (depth - 2) // 6


def _resnet(depth: int, filters: int, image_shape: tuple[int, int, int], num_classes: int) -> keras.Model:
    blocks = resnet_blocks_per_stage(depth)
    inputs = keras.Input(shape=image_shape, name="image")
    x = _conv(filters, 1, "stem_conv")(inputs)
    x = layers.ReLU(name="stem_relu")(_bn("stem_bn")(x))
    for stage, multiple in enumerate((1, 2, 4), start=1):
        for block in range(1, blocks + 1):
            strides = 2 if stage > 1 and block == 1 else 1
            x = _basic_block(x, filters * multiple, strides, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name=f"resnet{depth}")


# --- the digits CNN ----------------------------------------------------------------------------------


def _cnn(filters: int, image_shape: tuple[int, int, int], num_classes: int) -> keras.Model:
    """conv-conv-pool-conv with batch norm, global average pooling, dense: 24k weights at 16 filters."""
    inputs = keras.Input(shape=image_shape, name="image")
    x = inputs
    for index, multiple in enumerate((1, 2, 4), start=1):
        if index == 3:
            x = layers.MaxPooling2D(2, name="pool")(x)
        x = _conv(filters * multiple, 1, f"conv{index}")(x)
        x = layers.ReLU(name=f"relu{index}")(_bn(f"bn{index}")(x))
    x = layers.GlobalAveragePooling2D(name="global_pool")(x)
    logits = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="cnn")


# --- weight decay ------------------------------------------------------------------------------


def decayed_weights(model: keras.Model) -> list[keras.Variable]:
    """What weight decay applies to: trainable weights of rank >= 2 (conv and dense kernels,
    embeddings), not batch-norm scales and shifts or biases. For the built-in models these are
    exactly their kernels."""
    return [w for w in model.trainable_weights if len(w.shape) >= 2]
