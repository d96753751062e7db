"""``user_resnet20``: He et al.'s CIFAR ResNet-20 as a subclassed model with projection shortcuts."""

from __future__ import annotations

from typing import Any

import keras
from keras import layers
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model


@keras.saving.register_keras_serializable(package="bench_models")
class ResidualBlock(layers.Layer):
    """Two 3x3 convolutions with batch norm; a 1x1 projection when the shape changes."""

    def __init__(self, filters: int, strides: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters, self.strides = filters, strides
        self.conv1 = layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)
        self.bn1 = layers.BatchNormalization(momentum=0.9)
        self.conv2 = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.bn2 = layers.BatchNormalization(momentum=0.9)
        self.project = layers.Conv2D(filters, 1, strides=strides, use_bias=False) if strides > 1 else None

    def call(self, x: Any, training: bool = False) -> Any:
        shortcut = self.project(x) if self.project is not None else x
        y = keras.ops.relu(self.bn1(self.conv1(x), training=training))
        return keras.ops.relu(self.bn2(self.conv2(y), training=training) + shortcut)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters, "strides": self.strides}


@keras.saving.register_keras_serializable(package="bench_models")
class UserResNet(keras.Model):
    def __init__(self, num_classes: int = 10, filters: int = 16, blocks: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes, self.filters_, self.blocks = num_classes, filters, blocks
        self.stem = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.stem_bn = layers.BatchNormalization(momentum=0.9)
        self.stages = [
            ResidualBlock(filters * multiple, 2 if stage and not block else 1)
            for stage, multiple in enumerate((1, 2, 4))
            for block in range(blocks)
        ]
        self.pool = layers.GlobalAveragePooling2D()
        self.head = layers.Dense(num_classes)

    def call(self, x: Any, training: bool = False) -> Any:
        x = keras.ops.relu(self.stem_bn(self.stem(x), training=training))
        for block in self.stages:
            x = block(x, training=training)
        return self.head(self.pool(x))

    def get_config(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "filters": self.filters_, "blocks": self.blocks}


@register_model("user_resnet20")
def user_resnet20(hp: HParams, problem: Any) -> keras.Model:
    model = UserResNet(problem.num_classes, hp.num_filters, blocks=3, name="user_resnet20")
    model(keras.ops.zeros((1, *problem.image_shape)))  # creates every variable (a subclassed model)
    return model


@register_hparams("user_resnet20")
def user_resnet20_hparams() -> HParams:
    return HParams(model="user_resnet20")
