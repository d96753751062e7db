"""Example downstream DAG: runs whenever a Sync-Switch job has a newly trained model.

It is scheduled on the ``syncswitch-models`` asset alias (every job's model; use
``model_asset("<job>")`` for one job's) and paused when created: unpause it to try it. Its one task
reads the triggering asset events and checks that each exported model is complete in the bucket,
where a real pipeline would evaluate, promote or deploy it. See syncswitch_airflow.assets.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import DAG, task
from syncswitch import storage
from syncswitch_airflow.assets import MODELS

log = logging.getLogger(__name__)

with DAG(
    dag_id="on_new_model",
    schedule=[MODELS],
    is_paused_upon_creation=True,
    tags=["syncswitch", "example"],
    doc_md=__doc__,
    default_args={"owner": "syncswitch"},
):

    @task
    def check_new_models(*, triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        """One entry per new model: the job's run, its accuracy and its files, which must exist."""
        from syncswitch_airflow.hooks.bucket import BucketHook

        models, bucket = [], BucketHook()  # the bucket with [syncswitch] gcp_conn_id's credentials
        for event in triggering_asset_events[MODELS]:
            extra = dict(event.extra)
            files = (f"{extra['saved_model']}/saved_model.pb", extra["keras"])
            with bucket.credentials():
                missing = [f for f in files if not storage.exists(f)]
            if missing:
                raise FileNotFoundError(f"{event.asset.uri}: run {extra['run_id']} has no {missing}")
            log.info(
                "new model %s: run %s, accuracy %s", event.asset.uri, extra["run_id"], extra["test_accuracy"]
            )
            models.append({"asset": event.asset.uri, **extra})
        return models

    check_new_models()
