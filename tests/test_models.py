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
    decayed_weights,
)
from syncswitch.optim import Adam, MomentumSGD, StepConfig
from syncswitch.params import FlatModel
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
    assert len(decayed_weights(model)) == 20
    stage_outputs = [layer.output.shape for layer in model.layers if layer.name.endswith("block1_relu2")]
    assert stage_outputs == [(None, 32, 32, 16), (None, 16, 16, 32), (None, 8, 8, 64)]

    deeper = build_model(get_hparams("resnet_cifar_32").override("num_filters=8"), CIFAR10)
    assert len(decayed_weights(deeper)) == 32
    assert deeper.get_layer("stage3_block5_conv2").filters == 32


def test_option_a_shortcut_subsamples_and_zero_pads_channels() -> None:
    x = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
    out = ZeroPadShortcut(6)(x).numpy()
    assert out.shape == (2, 2, 2, 6)
    np.testing.assert_array_equal(out[..., 2:4], x[:, ::2, ::2, :])
    assert not out[..., :2].any() and not out[..., 4:].any()


def test_bad_model_and_depth_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^model: unknown 'vgg'; accepted: cnn, (.+, )?resnet(, .+)?$"):
        build_model(HParams(model="vgg"), CIFAR10)
    with pytest.raises(ValueError, match=r"^hparams: resnet_depth must be 6n\+2"):
        build_model(get_hparams("resnet_cifar_20").override("resnet_depth=21"), CIFAR10)


def test_weight_decay_is_applied_to_kernels_only_by_the_optimizer() -> None:
    """t2t's ``weight_decay * l2_loss(kernel)``: its gradient ``weight_decay * kernel`` is added in the
    update, beside the variable; batch-norm scales and shifts and the dense bias are not decayed."""
    model = build_model(get_hparams("cnn_digits"), DIGITS)
    kernels = decayed_weights(model)
    assert {w.path.rsplit("/", 1)[0] for w in kernels} == {"conv1", "conv2", "conv3", "logits"}
    before = {w.path: w.numpy().copy() for w in model.trainable_variables}
    kernel_refs = {k.value.ref() for k in kernels}
    masks = [1.0 if w.value.ref() in kernel_refs else 0.0 for w in model.trainable_variables]
    optimizer = MomentumSGD(model.trainable_variables, nesterov=False, weight_decay=1e-2, decay_masks=masks)
    zeros = [tf.zeros_like(w) for w in model.trainable_variables]
    optimizer.apply(zeros, model.trainable_variables, StepConfig(tf.constant(0.5), tf.constant(0.0)))
    kernel_paths = {k.path for k in kernels}
    for weight in model.trainable_variables:
        if weight.path in kernel_paths:
            np.testing.assert_allclose(weight.numpy(), before[weight.path] * (1 - 0.5 * 1e-2), rtol=1e-6)
        else:
            np.testing.assert_array_equal(weight.numpy(), before[weight.path])


def test_the_optimizer_is_keras_nesterov_momentum_sgd() -> None:
    """Two steps of MomentumSGD equal two steps of Keras' SGD (same LR, momentum, Nesterov)."""
    model = build_model(get_hparams("cnn_digits"), DIGITS)
    twin = build_model(get_hparams("cnn_digits"), DIGITS)
    twin.set_weights(model.get_weights())
    ours = MomentumSGD(model.trainable_variables, nesterov=True)
    keras_sgd = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    rng = np.random.default_rng(0)
    for _ in range(2):
        grads = [rng.normal(size=w.shape).astype(np.float32) for w in model.trainable_variables]
        ours.apply([tf.constant(g) for g in grads], model.trainable_variables, StepConfig(0.05, 0.9))
        keras_sgd.apply_gradients(zip([tf.constant(g) for g in grads], twin.trainable_variables, strict=True))
    for mine, theirs in zip(model.trainable_variables, twin.trainable_variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)


def _twin_models() -> tuple[keras.Model, keras.Model]:
    model = build_model(get_hparams("cnn_digits"), DIGITS)
    twin = build_model(get_hparams("cnn_digits"), DIGITS)
    twin.set_weights(model.get_weights())
    return model, twin


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_and_adamw_are_keras_adam_and_adamw(decoupled: bool) -> None:
    """Three steps of our Adam (AdamW) equal three of Keras' Adam (AdamW, every weight decayed), the
    step's number given as the update count: the bias correction counts the job's updates, not a
    Keras ``iterations`` variable. Slots are per variable, named as checkpoints hold them."""
    model, twin = _twin_models()
    variables = model.trainable_variables
    weight_decay = 0.05 if decoupled else 0.0
    ours = Adam(variables, decoupled=decoupled, weight_decay=weight_decay, decay_masks=[1.0] * len(variables))
    keras_class = keras.optimizers.AdamW if decoupled else keras.optimizers.Adam
    kwargs = {"weight_decay": weight_decay} if decoupled else {}
    theirs = keras_class(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, **kwargs)
    rng = np.random.default_rng(0)
    for update in (1, 2, 3):
        grads = [rng.normal(size=w.shape).astype(np.float32) for w in variables]
        ours.apply([tf.constant(g) for g in grads], variables, StepConfig(0.01, 0.8, 0.99, 1e-6, update))
        theirs.apply_gradients(zip([tf.constant(g) for g in grads], twin.trainable_variables, strict=True))
    for mine, keras_weight in zip(variables, twin.trainable_variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), keras_weight.numpy(), rtol=1e-5, atol=1e-6)
    assert list(ours.slots) == ["first_moments", "second_moments"]
    assert all(len(slot) == len(variables) for slot in ours.slots.values())


def test_adamw_decays_kernels_only_by_the_scheduled_learning_rate() -> None:
    """Decoupled decay: with no gradient Adam moves nothing, and each masked kernel shrinks by
    learning_rate x weight_decay; biases and batch-norm weights stay."""
    model = build_model(get_hparams("cnn_digits"), DIGITS)
    kernel_refs = {k.value.ref() for k in decayed_weights(model)}
    masks = [1.0 if w.value.ref() in kernel_refs else 0.0 for w in model.trainable_variables]
    before = [w.numpy().copy() for w in model.trainable_variables]
    ours = Adam(model.trainable_variables, decoupled=True, weight_decay=0.1, decay_masks=masks)
    zeros = [tf.zeros_like(w) for w in model.trainable_variables]
    ours.apply(zeros, model.trainable_variables, StepConfig(0.2, 0.9, 0.999, 1e-7, 1))
    for weight, old, mask in zip(model.trainable_variables, before, masks, strict=True):
        np.testing.assert_allclose(weight.numpy(), old * (1 - 0.2 * 0.1 * mask), rtol=1e-6)


def test_adam_weight_decay_is_the_l2_term_on_the_gradient() -> None:
    """``adam`` with weight_decay: t2t's L2 term, Keras' Adam on gradient + weight_decay * kernel."""
    model, twin = _twin_models()
    variables = model.trainable_variables
    masks = [1.0 if len(w.shape) > 1 else 0.0 for w in variables]
    ours = Adam(variables, weight_decay=0.1, decay_masks=masks)
    theirs = keras.optimizers.Adam(0.01)
    grads = [tf.constant(np.full(w.shape, 0.5, np.float32)) for w in variables]
    ours.apply(grads, variables, StepConfig(0.01, 0.9, 0.999, 1e-7, 1))
    l2 = [g + 0.1 * m * w for g, m, w in zip(grads, masks, twin.trainable_variables, strict=True)]
    theirs.apply_gradients(zip(l2, twin.trainable_variables, strict=True))
    for mine, keras_weight in zip(variables, twin.trainable_variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), keras_weight.numpy(), rtol=1e-5, atol=1e-6)


def test_checkpoint_signature_round_trips_and_names_differences() -> None:
    hp20 = get_hparams("resnet_cifar_20")
    signature = checkpoints.signature(hp20, CIFAR10)
    assert signature == {
        "model": "resnet",
        "depth": 20,
        "filters": 16,
        "input_shape": [32, 32, 3],
        "num_classes": 10,
        "optimizer": "momentum",
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
    flat = FlatModel(model, groups=2, hp=hp, decayed=decayed_weights(model))

    def mean_loss(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    @tf.function
    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        loss, grads, statistics = flat.loss_and_gradients(images, labels, mean_loss)
        flat.apply(grads, statistics, StepConfig(tf.constant(0.1), tf.constant(0.9)))
        return loss

    train = DIGITS.train_dataset("", batch_size=64, shard_index=0, num_shards=1, seed=0)
    losses = [float(train_step(images, labels)) for images, labels in train.take(200)]

    flat.to_template()  # evaluation reads the canonical per-variable form, as from a checkpoint
    correct = 0
    for images, labels in DIGITS.test_dataset("", batch_size=128):
        predictions = tf.argmax(model(images, training=False), axis=-1, output_type=tf.int32)
        correct += int(tf.reduce_sum(tf.cast(predictions == labels, tf.int32)))
    assert np.mean(losses[-20:]) < np.mean(losses[:20])
    assert correct / DIGITS.num_test_examples("") >= 0.95
