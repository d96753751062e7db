"""TensorBoard scalars of the whole logical run, written by each segment's chief.

Every segment adds its own event file to the run folder's ``tensorboard/``; TensorBoard merges the
files of one folder into one run keyed by global step, so BSP and ASP segments form one curve. Each
scalar is written twice: plain (``loss``) for the continuous curve, and tagged with the protocol
(``loss/bsp``, ``loss/asp``) to tell the protocols apart.

TF's own ``gs://`` support cannot be pointed at an emulator, so for ``gs://`` run folders the file is
written locally and uploaded through syncswitch.storage every ``upload_seconds`` and at the end.

``tf.summary.scalar`` needs the tensorboard package, which TF 2.21 no longer installs; writing the
value with the scalars plugin's metadata yields the same records without it on cluster nodes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from syncswitch import storage
from syncswitch.layout import RunLayout


class TensorBoardWriter:
    def __init__(self, layout: RunLayout, protocol: str, upload_seconds: float = 30.0) -> None:
        import tensorflow as tf

        self.protocol = protocol
        self.remote_dir = layout.tensorboard if storage.is_remote(layout.tensorboard) else None
        self.local_dir = tempfile.mkdtemp(prefix="tb-") if self.remote_dir else layout.tensorboard
        os.makedirs(self.local_dir, exist_ok=True)
        self._writer = tf.summary.create_file_writer(self.local_dir)
        self._upload_seconds = upload_seconds
        self._last_upload = time.monotonic()

    def scalars(self, global_step: float, **values: float) -> None:
        import tensorflow as tf

        metadata = tf.compat.v1.SummaryMetadata(
            plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        with self._writer.as_default(step=int(global_step)):
            for name, value in values.items():
                for tag in (name, f"{name}/{self.protocol}"):
                    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=metadata)
        if self.remote_dir and time.monotonic() - self._last_upload >= self._upload_seconds:
            try:  # never hold up training for the bucket: the file stays local until the next try
                self.upload(retry_seconds=0)
            except storage.BucketUnavailable:
                self._last_upload = time.monotonic()

    def upload(self, retry_seconds: float | None = None) -> None:
        self._writer.flush()
        if self.remote_dir:
            storage.upload_dir(self.local_dir, self.remote_dir, retry_seconds=retry_seconds)
        self._last_upload = time.monotonic()

    def close(self) -> None:
        self.upload()
        self._writer.close()
        if self.remote_dir:
            shutil.rmtree(self.local_dir, ignore_errors=True)
