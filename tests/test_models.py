"""syncswitch.models: shapes, the ResNet-20 size, weight decay, signatures, and a digits CNN that learns."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from syncswitch import checkpoints
from syncswitch.hparams import HParams, get_hparams
from syncswitch.models import (
    ZeroPadShortcut,
    build_model,
    kernel_weights,
    regularization_loss,
)
from syncswitch.problems import get_problem

CIFAR10 = get_problem("image_cifar10")
DIGITS = get_problem("digits")


@pytest.mark.parametrize(
    ("hparam_set", "problem_name", "classes"),
    [
        ("resnet_cifar_20", "image_cifar10", 10),
        ("resnet_cifar_20", "image_cifar100", 100),
        ("resnet_cifar_20", "synthetic_cifar", 10),
        ("cnn_digits", "digits", 10),
    ],
)
def test_models_output_logits_of_the_problem_classes(
    hparam_set: str, problem_name: str, classes: int
) -> None:
    problem = get_problem(problem_name)
    model = build_model(get_hparams(hparam_set), problem)
    images = np.random.default_rng(0).normal(size=(3, *problem.image_shape)).astype(np.float32)

    logits = model(images, training=False).numpy()

    assert model.input_shape == (None, *problem.image_shape)
    assert logits.shape == (3, classes)
    # Logits, not probabilities: the last layer is linear and rows do not sum to one.
    assert model.layers[-1].activation is keras.activations.linear
    assert not np.allclose(logits.sum(axis=1), 1.0)


def test_resnet20_has_the_papers_027m_weights_and_depth_counts_layers() -> None:
    model = build_model(get_hparams("resnet_cifar_20"), CIFAR10)
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert 0.26e6 < trainable < 0.28e6
    # 19 convolutions + the dense layer = 20 weighted layers.
    assert len(kernel_weights(model)) == 20
    stage_outputs = [layer.output.shape for layer in model.layers if layer.name.endswith("block1_relu2")]
    assert stage_outputs == [(None, 32, 32, 16), (None, 16, 16, 32), (None, 8, 8, 64)]

    deeper = build_model(get_hparams("resnet_cifar_32").override("num_filters=8"), CIFAR10)
    assert len(kernel_weights(deeper)) == 32
    assert deeper.get_layer("stage3_block5_conv2").filters == 32


def test_option_a_shortcut_subsamples_and_zero_pads_channels() -> None:
    x = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
    out = ZeroPadShortcut(6)(x).numpy()
    assert out.shape == (2, 2, 2, 6)
    np.testing.assert_array_equal(out[..., 2:4], x[:, ::2, ::2, :])
    assert not out[..., :2].any() and not out[..., 4:].any()


def test_bad_model_and_depth_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^model: unknown 'vgg'; accepted: resnet, cnn$"):
        build_model(HParams(model="vgg"), CIFAR10)
    with pytest.raises(ValueError, match=r"^hparams: resnet_depth must be 6n\+2"):
        build_model(get_hparams("resnet_cifar_20").override("resnet_depth=21"), CIFAR10)


def test_regularization_loss_covers_kernels_only() -> None:
    model = build_model(get_hparams("cnn_digits"), DIGITS)
    kernels = kernel_weights(model)
    assert {w.path.rsplit("/", 1)[0] for w in kernels} == {"conv1", "conv2", "conv3", "logits"}
    expected = 1e-3 * sum(0.5 * np.sum(np.square(k.numpy())) for k in kernels)
    assert float(regularization_loss(model, 1e-3)) == pytest.approx(expected, rel=1e-5)

    # Batch-norm scales and shifts and the dense bias do not count...
    for weight in model.trainable_weights:
        if weight.name != "kernel":
            weight.assign(np.full(weight.shape, 5.0, dtype=np.float32))
    assert float(regularization_loss(model, 1e-3)) == pytest.approx(expected, rel=1e-5)
    # ...a kernel does.
    model.get_layer("logits").kernel.assign(np.zeros(model.get_layer("logits").kernel.shape, np.float32))
    assert float(regularization_loss(model, 1e-3)) < expected
    assert float(regularization_loss(model, 0.0)) == 0.0


def test_checkpoint_signature_round_trips_and_names_differences() -> None:
    hp20 = get_hparams("resnet_cifar_20")
    signature = checkpoints.signature(hp20, CIFAR10)
    assert signature == {
        "model": "resnet",
        "depth": 20,
        "filters": 16,
        "input_shape": [32, 32, 3],
        "num_classes": 10,
    }
    manifest = {"uri": "runs/x/checkpoints/ckpt-000000000000", "signature": json.loads(json.dumps(signature))}
    checkpoints.check_compatible(manifest, signature)  # JSON round trip: still equal

    other = checkpoints.signature(get_hparams("resnet_cifar_32"), get_problem("image_cifar100"))
    with pytest.raises(checkpoints.CheckpointMismatchError) as error:
        checkpoints.check_compatible({**manifest, "signature": other}, signature)
    message = str(error.value)
    assert message.startswith("run_dir:")
    assert "depth: checkpoint has 32, requested 20" in message
    assert "num_classes: checkpoint has 100, requested 10" in message
    assert "filters" not in message


def test_digits_cnn_reaches_95_percent_in_200_steps() -> None:
    """The embedded demo's claim: momentum SGD at lr 0.1, batch 64, 200 steps, single process."""
    keras.utils.set_random_seed(0)
    hp = get_hparams("cnn_digits")
    model = build_model(hp, DIGITS)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)

    @tf.function
    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            loss = tf.reduce_mean(cross_entropy) + regularization_loss(model, hp.weight_decay)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    train = DIGITS.train_dataset("", batch_size=64, shard_index=0, num_shards=1, seed=0)
    losses = [float(train_step(images, labels)) for images, labels in train.take(200)]

    correct = 0
    for images, labels in DIGITS.test_dataset("", batch_size=128):
        predictions = tf.argmax(model(images, training=False), axis=-1, output_type=tf.int32)
        correct += int(tf.reduce_sum(tf.cast(predictions == labels, tf.int32)))
    assert np.mean(losses[-20:]) < np.mean(losses[:20])
    assert correct / DIGITS.num_test_examples("") >= 0.95
