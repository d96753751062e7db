"""User code for bench/bench_user_model.py: a CIFAR ResNet-20 written as a user would write it, as a
subclassed Keras model with a custom block layer, registered through the usr_dir mechanism. Same size
as the built-in ``resnet`` (0.27M weights), so the benchmark compares what the mechanism costs."""

from bench_models import resnet  # noqa: F401 - imported for its @register_* decorators
