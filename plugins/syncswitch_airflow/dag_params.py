"""The ``sync_switch`` DAG's params: one Airflow Param per job field, from the field table.

The schema (``syncswitch.fields``: types, bounds, accepted values, titles) renders the Trigger form
(selects for enums, number fields with minimums) and rejects malformed conf before a run is created
(REST answers 400 naming the param). Cross-field rules (e.g. three switch-order digits but two step
counts) need the whole job; ``JobSpec.from_params`` checks them in the DAG's validate task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk import Param
from syncswitch.fields import FIELDS, Field, default_job_name
from syncswitch.registry import REGISTRY
from syncswitch.spec import JobSpec

from syncswitch_airflow import settings


def default_bucket_dir(project_dir: str | Path) -> str:
    """``[syncswitch] bucket_dir``, else ``<project>/runs``."""
    return settings.get("bucket_dir") or str(Path(project_dir).resolve() / "runs")


class DefaultParamsError(ValueError):
    """``[syncswitch] default_params`` names a file that is not a valid set of job params; the message
    names the file and the field (the DAG's import error)."""


def deployment_defaults(path: str | None = None) -> dict[str, Any]:
    """The deployment's default job params (``[syncswitch] default_params``: a YAML mapping of JobSpec
    fields, checked as a whole job), under every run's own: the ad-hoc DAG's and each job file's. Empty
    where unset. A ``usr_dir`` in it is relative to the file."""
    import yaml
    from syncswitch import usercode
    from syncswitch.spec import SpecError

    path = path or settings.get("default_params")
    if not path:
        return {}
    try:
        params = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise DefaultParamsError(f"[syncswitch] default_params {path}: not readable YAML: {exc}") from None
    if not isinstance(params, dict):
        raise DefaultParamsError(f"[syncswitch] default_params {path}: must be a mapping of job params")
    params = usercode.beside(params, str(Path(path).parent))
    try:
        JobSpec.from_params(with_deployment_bucket(params))
    except SpecError as err:
        raise DefaultParamsError(f"[syncswitch] default_params {path}: {err}") from None
    return params


def default_job() -> JobSpec | None:
    """The ad-hoc DAG's defaults: the deployment's (:func:`deployment_defaults`), or None."""
    defaults = deployment_defaults()
    return JobSpec.from_params(with_deployment_bucket(defaults)) if defaults else None


def with_deployment_bucket(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the deployment's bucket folder (``[syncswitch] bucket_dir``) where they name none."""
    bucket_dir = settings.get("bucket_dir")
    return {"bucket_dir": bucket_dir, **params} if bucket_dir else params


def build_params(bucket_dir: str, defaults: JobSpec | None = None) -> dict[str, Param]:
    """One Param per job field, in the table's order, defaulting to ``defaults`` (a recurring job's
    settings, a deployment's default params) or to JobSpec() (the embedded digits demo), with
    ``bucket_dir`` as the bucket folder unless ``defaults`` names one."""
    values = {"bucket_dir": bucket_dir}
    if defaults is not None and defaults.bucket_dir != JobSpec().bucket_dir:
        values = {}
    values = {**(defaults or JobSpec()).to_params(), **values}
    if values["job_name"] == default_job_name(values["model"], values["problem"], values["usr_dir"]):
        # Shown empty: the run names itself after the model and problem the form ends up with.
        values["job_name"] = ""
    return {field.name: field_param(field, values[field.name]) for field in FIELDS}


# Airflow checks a Param's schema against its metaschema each time it resolves the Param, and
# serializing a DAG resolves every task's params twice: draft 7's metaschema checks much faster than
# the default draft 2020-12's (vocabularies, dynamic references), and every keyword used here (type,
# bounds, enum, pattern, items, minLength, examples) means the same in both.
SCHEMA_DIALECT = "http://json-schema.org/draft-07/schema#"


def field_param(field: Field, default: Any) -> Param:
    """The Param of one field: its JSON schema, title and description."""
    schema: dict[str, Any] = {
        "$schema": SCHEMA_DIALECT,
        "type": ["null", field.type] if field.nullable else field.type,
    }
    if field.nullable:
        default = default or None  # an empty required string would keep the form from submitting
    if field.type == "array":
        schema["items"] = _item_schema(field)
    else:
        schema.update(_bounds(field))
        if field.pattern:
            # A field that may be left empty takes "" as REST conf sends it: its default applies.
            schema["pattern"] = f"^$|{field.pattern}" if field.nullable else field.pattern
    if field.choices:
        schema["enum"] = list(field.choices)
    elif field.registry == "backend":
        schema["enum"] = REGISTRY.names("backend")  # a closed set: the backends installed here
    elif field.registry and field.type == "string":
        schema.update(_registered(field.registry, default))
    elif field.type == "string" and not field.nullable and not field.pattern:
        schema["minLength"] = 1
    return Param(default, title=field.title, description=field.description, **schema)


def _item_schema(field: Field) -> dict[str, Any]:
    items: dict[str, Any] = {"type": field.items, **_bounds(field)}
    if field.pattern:
        items["pattern"] = field.pattern
    elif field.repeat_flag and field.items == "string":
        items["minLength"] = 1
    return items


def _bounds(field: Field) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    if field.minimum is not None:
        bounds["exclusiveMinimum" if field.exclusive_minimum else "minimum"] = field.minimum
    if field.maximum is not None:
        bounds["maximum"] = field.maximum
    return bounds


def _registered(kind: str, value: str) -> dict[str, Any]:
    """A registered name: the form proposes every name the registry knows here (built-ins, entry
    points, and a job file's usr_dir once loaded) and accepts others, since a run's usr_dir may
    register names this process has never imported; the validate task checks them."""
    names = REGISTRY.names(kind)
    return {"minLength": 1, "examples": names if value in names else [value, *names]}
