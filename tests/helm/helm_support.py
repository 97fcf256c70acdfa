"""Support for the Helm chart tests: the real helm binary, rendering, and validators.

Decided here: where helm comes from (scripts/fetch-helm.sh, once per session,
only when .tools/bin/helm is missing), how a render is run and parsed (cached
per distinct argument list, so each values file renders once per session),
and how rendered objects are validated without a cluster:

- RayService and RayCluster against the ``openAPIV3Schema`` of the KubeRay
  CRDs in ``shared/schemas/``, PodMonitor against its JSON Schema there. The
  API server prunes or (with kubectl's default ``--validate=strict``) refuses
  fields a structural schema does not declare; JSON Schema would let them
  through, so every object schema that lists ``properties`` and says nothing
  of ``additionalProperties`` is closed before validating. ``nullable`` becomes
  a null type, and ``format: int32/int64`` are range-checked.
- Core kinds (and the pod templates inside the RayService) with the
  ``kubernetes-validate`` package in strict mode.

Deliberately not here: the CRDs' three CEL rules. Two are immutability rules
(``self == oldSelf``) that only apply to updates; the third restricts
``managedBy``, which the chart never renders (a test asserts that).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "helm" / "ferrox"
EXAMPLES = CHART / "examples"
SCHEMAS = REPO_ROOT.parent / "shared" / "schemas"
TOOLS_BIN = REPO_ROOT / ".tools" / "bin"
FETCH_HELM = REPO_ROOT / "scripts" / "fetch-helm.sh"

# The example values files the issue names; "defaults" is values.yaml alone.
VALUES_CASES = ["defaults", "cpu-small", "gpu-autoscale", "monitoring"]

try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # PyYAML without libyaml: slower, same result
    _Loader = yaml.SafeLoader


def values_args(case: str) -> list[str]:
    """helm arguments selecting one VALUES_CASES entry."""
    return [] if case == "defaults" else ["-f", str(EXAMPLES / f"{case}.yaml")]


class Helm:
    """The real helm binary, run against helm/ferrox."""

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        self._renders: dict[tuple[str, ...], list[dict[str, Any]]] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HELM_CACHE_HOME": str(TOOLS_BIN.parent / "helm-cache"),
               "HELM_CONFIG_HOME": str(TOOLS_BIN.parent / "helm-config"),
               "HELM_DATA_HOME": str(TOOLS_BIN.parent / "helm-data")}
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              env=env, timeout=60, check=False)

    def template(self, *args: str, release: str = "ferrox") -> list[dict[str, Any]]:
        """Render the chart; returns the objects (copies, safe to mutate)."""
        key = (release, *args)
        if key not in self._renders:
            proc = self.run("template", release, str(CHART), "--namespace", "serving", *args)
            if proc.returncode != 0:
                raise AssertionError(
                    f"helm template {shlex.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
            self._renders[key] = [d for d in yaml.load_all(proc.stdout, Loader=_Loader) if d]
        return copy.deepcopy(self._renders[key])

    def template_error(self, *args: str) -> str:
        """Render expecting failure; returns helm's stderr."""
        proc = self.run("template", "ferrox", str(CHART), *args)
        assert proc.returncode != 0, f"helm template {shlex.join(args)} unexpectedly succeeded"
        return proc.stderr



# --- schema validation ------------------------------------------------------


def _structural(schema: Any) -> Any:
    """An OpenAPI v3 (CRD) schema as a closed JSON Schema, see the module docstring."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema and "type" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def _crd_validator(filename: str, version: str = "v1") -> jsonschema.Draft7Validator:
    crd = yaml.load((SCHEMAS / filename).read_text(), Loader=_Loader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _structural(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema, format_checker=_FORMATS)


class Validators:
    """Validators for every kind the chart renders."""

    def __init__(self) -> None:
        self.rayservice = _crd_validator("ray.io_rayservices.yaml")
        self.raycluster = _crd_validator("ray.io_rayclusters.yaml")
        podmonitor = json.loads((SCHEMAS / "monitoring.coreos.com_podmonitor_v1.json").read_text())
        self.podmonitor = jsonschema.Draft7Validator(_structural(podmonitor), format_checker=_FORMATS)

    @staticmethod
    def errors(validator: jsonschema.Draft7Validator, obj: dict[str, Any]) -> list[str]:
        return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))]
