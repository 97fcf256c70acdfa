"""helm refuses bad values before anything renders, and the chart's schema tracks AppArgs.

values.schema.json rejects what one value can get wrong (a negative replica
count, an unknown attention backend, a missing model, an unknown key);
templates/_helpers.tpl stops the render for what needs two values compared
(minReplicas above maxReplicas), which JSON Schema cannot express. Both come
back as helm's own error from `helm template`, `helm lint` and `helm install`.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from helm_support import CHART, EXAMPLES

SCHEMA = json.loads((CHART / "values.schema.json").read_text())

SCHEMA_ERROR = "values don't meet the specifications of the schema(s) in the following chart(s):"


def write_values(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def gpu_group(**overrides: Any) -> dict[str, Any]:
    return {"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 4, "gpus": 1, **overrides}


def test_the_values_schema_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", ["values.yaml", "cpu-small.yaml", "gpu-autoscale.yaml", "monitoring.yaml"])
def test_every_shipped_values_file_meets_the_schema(name):
    path = CHART / name if name == "values.yaml" else EXAMPLES / name
    values = yaml.safe_load(path.read_text())
    if name != "values.yaml":  # an override file is merged over the defaults
        values = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), values)
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(values)) == []


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def test_a_negative_worker_replica_count_is_refused(helm, tmp_path):
    err = helm.template_error("-f", write_values(tmp_path, {"workerGroups": [gpu_group(replicas=-1)]}))
    assert SCHEMA_ERROR in err
    assert "- at '/workerGroups/0/replicas': minimum: got -1, want 0" in err


def test_a_negative_min_replicas_is_refused(helm, tmp_path):
    err = helm.template_error("-f", write_values(tmp_path, {"workerGroups": [gpu_group(minReplicas=-2)]}))
    assert "- at '/workerGroups/0/minReplicas': minimum: got -2, want 0" in err


def test_a_negative_serve_replica_count_is_refused(helm):
    err = helm.template_error("--set", "serve.numReplicas=-1")
    assert SCHEMA_ERROR in err
    assert "- at '/serve/numReplicas': minimum: got -1, want 1" in err


def test_worker_min_replicas_above_max_replicas_is_refused(helm, tmp_path):
    err = helm.template_error("-f", write_values(tmp_path, {"workerGroups": [gpu_group(minReplicas=5, maxReplicas=2, replicas=2)]}))
    assert "execution error at (ferrox/templates/rayservice.yaml" in err
    assert "workerGroups[gpu]: minReplicas (5) must not exceed maxReplicas (2)" in err


def test_serve_min_replicas_above_max_replicas_is_refused(helm):
    err = helm.template_error("--set", "serve.autoscaling.enabled=true",
                              "--set", "serve.autoscaling.minReplicas=6",
                              "--set", "serve.autoscaling.maxReplicas=3")
    assert "serve.autoscaling.minReplicas (6) must not exceed serve.autoscaling.maxReplicas (3)" in err


def test_an_unknown_attention_backend_is_refused(helm):
    err = helm.template_error("--set", "engine.attention_backend=xformers")
    assert SCHEMA_ERROR in err
    assert "- at '/engine/attention_backend': value must be one of 'auto', 'sdpa', 'flash'" in err


def test_a_missing_model_is_refused(helm):
    err = helm.template_error("--set", "model.name=null")
    assert SCHEMA_ERROR in err
    assert "- at '/model': missing property 'name'" in err


def test_an_empty_model_name_is_refused(helm):
    err = helm.template_error("--set", "model.name=")
    assert "- at '/model/name': minLength: got 0, want 1" in err


def test_an_unknown_engine_key_is_refused(helm):
    err = helm.template_error("--set", "engine.page_sz=32")
    assert "- at '/engine': additional properties 'page_sz' not allowed" in err


def test_an_unknown_upgrade_strategy_is_refused(helm):
    err = helm.template_error("--set", "upgradeStrategy.type=Recreate")
    assert "- at '/upgradeStrategy/type': value must be one of 'NewCluster', 'None', " \
           "'NewClusterWithIncrementalUpgrade'" in err


def test_an_incremental_upgrade_without_options_is_refused(helm):
    err = helm.template_error("--set", "upgradeStrategy.type=NewClusterWithIncrementalUpgrade")
    assert "- at '/upgradeStrategy/clusterUpgradeOptions': missing properties 'gatewayClassName', " \
           "'stepSizePercent', 'intervalSeconds'" in err


def test_more_gpu_replicas_than_gpus_is_refused(helm):
    err = helm.template_error("--set", "serve.numReplicas=5")
    assert "the Serve application needs 5 GPUs (one per replica) but the worker groups hold " \
           "at most 4 (gpus x maxReplicas)" in err


def test_without_the_ray_autoscaler_only_the_started_pods_count(helm):
    err = helm.template_error("--set", "serve.numReplicas=2", "--set", "rayAutoscaler.enabled=false")
    assert "the Serve application needs 2 GPUs (one per replica) but the worker groups hold " \
           "at most 1 (gpus x replicas, as the Ray autoscaler is off)" in err


def test_duplicate_worker_group_names_are_refused(helm, tmp_path):
    err = helm.template_error("-f", write_values(tmp_path, {"workerGroups": [gpu_group(), gpu_group()]}))
    assert 'workerGroups: the name "gpu" is used twice' in err


def test_helm_lint_reports_the_same_refusal(helm):
    proc = helm.run("lint", "--strict", str(CHART), "--set", "engine.attention_backend=xformers")
    assert proc.returncode == 1
    assert "at '/engine/attention_backend': value must be one of 'auto', 'sdpa', 'flash'" in proc.stdout + proc.stderr


# --- the schema follows AppArgs -------------------------------------------------


def _field_constraints(annotation: Any, field: Any) -> dict[str, Any]:
    """The JSON-Schema keywords one pydantic field implies, as values.schema.json writes them."""
    out: dict[str, Any] = {}
    args = typing.get_args(annotation)
    nullable = type(None) in args
    inner = [a for a in args if a is not type(None)] if isinstance(annotation, types.UnionType) else [annotation]
    (base,) = inner
    if typing.get_origin(base) is typing.Literal:
        out["enum"] = list(typing.get_args(base))
        out["type"] = "string"
    else:
        out["type"] = {int: "integer", float: "number", bool: "boolean", str: "string"}[base]
    if nullable:
        out["type"] = [out["type"], "null"]
    for m in field.metadata:
        for attr, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum")):
            if getattr(m, attr, None) is not None:
                out[key] = getattr(m, attr)
    return out


@pytest.mark.parametrize("section, model_name", [
    ("engine", "EngineArgs"), ("router", "RouterArgs"), ("ingress", "IngressArgs")])
def test_the_values_schema_mirrors_app_args(section, model_name):
    from ferrox.cluster import config

    model = getattr(config, model_name)
    props = SCHEMA["properties"][section]["properties"]
    assert sorted(props) == sorted(model.model_fields), f"values.schema.json {section} drifted from {model_name}"
    assert SCHEMA["properties"][section]["additionalProperties"] is False
    for name, field in model.model_fields.items():
        expected = _field_constraints(field.annotation, field)
        actual = {k: v for k, v in props[name].items() if k != "description"}
        assert actual == expected, f"{section}.{name}"


def test_the_values_defaults_are_app_args_defaults():
    # values.yaml spells out some engine settings; they must not quietly
    # differ from what AppArgs would pick without them.
    from ferrox.cluster.config import EngineArgs, RouterArgs, IngressArgs

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for section, model in (("engine", EngineArgs), ("router", RouterArgs), ("ingress", IngressArgs)):
        for key, value in (values[section] or {}).items():
            assert value == model.model_fields[key].default, f"{section}.{key}"
