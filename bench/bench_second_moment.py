"""How much larger is Adam's second moment for an ASP worker's batch than for BSP's global batch?
E[g^2] per element of 32-example gradients against 512-example ones, on the MNIST-1D example's CNN
after 75 steps of Adam at 0.03 with batches of 512 (a 12.5% BSP share of a 600-step job of 16 workers):
the factor by which the second moment carried over from BSP is too small for ASP
(spec.second_moment_scale).

    .venv/bin/python bench/bench_second_moment.py [--steps 75] [--small 32] [--big 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "mnist1d"


def mean_square_gradient(model: Any, loss_of: Any, batches: Any, count: int) -> Any:
    """Per-element mean of g^2 over ``count`` batches' gradients of the mean loss."""
    import tensorflow as tf

    total = None
    for _ in range(count):
        x, y = next(batches)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_of(model(x, training=True), y))
        flat = tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(loss, model.trainable_variables)], 0)
        total = flat * flat if total is None else total + flat * flat
    return total / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=75)
    p.add_argument("--small", type=int, default=32)
    p.add_argument("--big", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=0.03)
    args = p.parse_args(argv)
    sys.path.insert(0, str(EXAMPLES))
    import keras
    import mnist1d_example  # noqa: F401 - registers the problem and the model
    import numpy as np
    import tensorflow as tf
    from syncswitch.hparams import get_hparams
    from syncswitch.models import build_model, example_loss
    from syncswitch.problems import get_problem

    keras.utils.set_random_seed(0)
    problem = get_problem("mnist1d")
    data = problem.prepare("", tempfile.mkdtemp(prefix="second-moment-"))
    model = build_model(get_hparams("mnist1d_cnn"), problem)
    loss_of = example_loss(problem, model)
    optimizer = keras.optimizers.Adam(args.learning_rate)
    big = iter(problem.train_dataset(data, batch_size=args.big, shard_index=0, num_shards=1, seed=0))
    for _ in range(args.steps):
        x, y = next(big)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_of(model(x, training=True), y))
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
        )
    small = iter(problem.train_dataset(data, batch_size=args.small, shard_index=0, num_shards=1, seed=1))
    ratio = (
        mean_square_gradient(model, loss_of, small, 200)
        / tf.maximum(mean_square_gradient(model, loss_of, big, 40), 1e-20)
    ).numpy()
    low, median, high = np.quantile(ratio, [0.25, 0.5, 0.75])
    print(
        f"after {args.steps} steps: E[g^2] of {args.small}-example / {args.big}-example gradients per "
        f"element: median {median:.2f}, quartiles {low:.2f}-{high:.2f} "
        f"(noise alone: {args.big / args.small:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
