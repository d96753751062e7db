"""MNIST-1D as user code: importing the package registers its problem, model and hparam set."""

from mnist1d_example import model, problem  # noqa: F401 - imported for their @register_* decorators
