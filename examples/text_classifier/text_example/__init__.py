"""A text classifier as user code: importing the package registers its problem, model and hparams."""

from text_example import model, problem  # noqa: F401 - imported for their @register_* decorators
