"""``keras_app_mobilenet``: keras.applications' MobileNetV2 (untrained, ``weights=None``) as the backbone.

Any ``keras.applications`` model is a Keras 3 functional model, so it trains as it is; this one shows
the few things to decide around it:

- preprocessing belongs to the model: the problem yields images in [0, 1] and a Rescaling layer maps
  them to MobileNetV2's [-1, 1], so the exported SavedModel takes the same input as training;
- ``alpha`` (the width multiplier) 0.35 and 32x32 inputs keep it to 0.4 M weights, small enough for 2
  CPU cores;
- keras.applications builds its BatchNormalization layers with momentum 0.999 (for ImageNet-length
  runs): their moving statistics would still be mostly their initial values after a few hundred
  steps, and evaluation would see near-chance accuracy; ``bn_momentum`` sets them after building;
- the head (global average pooling, dropout, logits) is ours, so ``classes`` need not be ImageNet's.
"""

from __future__ import annotations

import keras
from keras import layers
from syncswitch.hparams import HParams
from syncswitch.registry import register_hparams, register_model


def _set_bn_momentum(model: keras.Model, momentum: float) -> None:
    """Keras reads ``momentum`` at each call, so changing it after construction takes effect. A
    keras.applications model is one flat functional model: its ``layers`` are all of them."""
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.momentum = momentum


@register_model("keras_app_mobilenet")
def keras_app_mobilenet(hp: HParams, problem) -> keras.Model:  # noqa: ANN001 - a TFRecordImageProblem
    """MobileNetV2 of width ``hp.alpha`` for ``problem.image_shape`` and ``problem.num_classes``."""
    image = keras.Input(shape=problem.image_shape, name="image")
    scaled = layers.Rescaling(2.0, offset=-1.0, name="to_minus1_1")(image)
    backbone = keras.applications.MobileNetV2(
        input_shape=problem.image_shape,
        alpha=hp.alpha,
        include_top=False,
        weights=None,
        pooling="avg",
    )
    _set_bn_momentum(backbone, hp.bn_momentum)
    features = backbone(scaled)
    features = layers.Dropout(hp.dropout, name="dropout")(features)
    logits = layers.Dense(problem.num_classes, name="logits")(features)
    return keras.Model(image, logits, name="keras_app_mobilenet")


@register_hparams("synthetic_tfrecord_images")
def synthetic_tfrecord_images_hparams() -> HParams:
    """16 images per worker, LR 0.01 for the BSP global batch (MobileNetV2 from scratch diverged at
    0.05 on these small batches), momentum 0.9, MobileNet's weight decay 4e-5; the model's ``alpha``,
    ``dropout`` and ``bn_momentum`` (override with ``--hparams``)."""
    return HParams(
        model="keras_app_mobilenet",
        batch_size=16,
        learning_rate=0.01,
        weight_decay=4e-5,
        optimizer_momentum_momentum=0.9,
        extra={"alpha": 0.35, "dropout": 0.2, "bn_momentum": 0.9},
    )
