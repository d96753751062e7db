"""A keras.applications model on image TFRecords: importing the package registers its problem, model
and hparam set (the generic reader is ``syncswitch.tfrecords.TFRecordImageProblem``)."""

from tfrecord_example import model, synthetic  # noqa: F401 - imported for their @register_* decorators
