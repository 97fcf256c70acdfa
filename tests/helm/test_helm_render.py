"""What helm/ferrox renders: lint-clean, schema-valid, and the values it promises.

Every object `helm template` renders is validated as the API server and the
KubeRay operator would see it (see conftest.py for how), and the Serve config
inside the RayService is validated by Ray's own ServeDeploySchema and by
ferrox's AppArgs. Exact values are asserted for each example values file.
Nothing here talks to a cluster.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import tomllib
from typing import Any

import kubernetes_validate
import pytest
import yaml

from helm_support import CHART, EXAMPLES, FETCH_HELM, REPO_ROOT, VALUES_CASES, values_args

K8S_VERSIONS = sorted({"1.30", kubernetes_validate.latest_version()})


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def app_args(rayservice: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config(rayservice)["applications"]
    return app["args"]


def cluster(rayservice: dict[str, Any]) -> dict[str, Any]:
    return rayservice["spec"]["rayClusterConfig"]


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# --- KubeRay's own admission rules -------------------------------------------

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _label_errors(where: str, labels: dict[str, str]) -> list[str]:
    errors = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or not _LABEL_NAME.match(name) or len(prefix) > 253:
            errors.append(f"{where}: bad label key {key!r}")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(f"{where}: bad label value {key}={value!r}")
    return errors


def kuberay_rule_errors(rs: dict[str, Any]) -> list[str]:
    """The checks KubeRay's operator applies to a RayService beyond its CRD schema.

    Transcribed from ray-operator/controllers/ray/utils/validation.go
    (ValidateRayServiceMetadata, ValidateRayServiceSpec, ValidateRayClusterSpec,
    ValidateClusterUpgradeOptions): the parts a chart can get wrong.
    """
    errors = []
    name = rs["metadata"]["name"]
    if len(name) > 47 or not _DNS1035.match(name):
        errors.append(f"RayService name {name!r} must be a DNS-1035 label of at most 47 characters")
    errors += _label_errors("RayService", rs["metadata"].get("labels", {}))
    spec = rs["spec"]
    if "managedBy" in spec or "managedBy" in spec["rayClusterConfig"]:
        errors.append("managedBy is set (a CEL rule restricts it)")
    rc = spec["rayClusterConfig"]
    autoscaling = rc.get("enableInTreeAutoscaling", False)
    groups = [("Head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc.get("workerGroupSpecs", [])]
    for group_name, g in groups:
        if not g["template"]["spec"].get("containers"):
            errors.append(f"{group_name}: no container")
        params = g.get("rayStartParams", {})
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and g.get("resources"):
            errors.append(f"{group_name}: resources in both rayStartParams and resources")
        if "labels" in params:
            errors.append(f"{group_name}: rayStartParams['labels'] is not supported")
        errors += _label_errors(f"{group_name} pod", g["template"].get("metadata", {}).get("labels", {}))
    for g in rc.get("workerGroupSpecs", []):
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            errors.append(f"{g['groupName']}: min/maxReplicas required without autoscaling")
        if lo is not None and hi is not None and lo > hi:
            errors.append(f"{g['groupName']}: minReplicas {lo} > maxReplicas {hi}")
        if min(lo or 0, hi or 0) < 0:
            errors.append(f"{g['groupName']}: negative replicas")
    if autoscaling and rc.get("autoscalerOptions", {}).get("idleTimeoutSeconds", 0) < 0:
        errors.append("autoscalerOptions.idleTimeoutSeconds negative")
    upgrade = spec.get("upgradeStrategy", {})
    kind = upgrade.get("type")
    if kind not in (None, "None", "NewCluster", "NewClusterWithIncrementalUpgrade"):
        errors.append(f"upgradeStrategy.type {kind!r} is invalid")
    if kind == "NewClusterWithIncrementalUpgrade":
        o = upgrade.get("clusterUpgradeOptions")
        if not autoscaling:
            errors.append("incremental upgrade needs the Ray autoscaler")
        elif o is None:
            errors.append("incremental upgrade needs clusterUpgradeOptions")
        else:
            surge, step = o.get("maxSurgePercent", 100), o.get("stepSizePercent")
            if not 0 <= surge <= 100 or step is None or not 0 <= step <= surge:
                errors.append("stepSizePercent/maxSurgePercent out of range")
            if o.get("intervalSeconds", 0) <= 0 or not o.get("gatewayClassName"):
                errors.append("intervalSeconds/gatewayClassName missing")
    return errors


def validate_object(obj: dict[str, Any], validators) -> list[str]:
    """All validation errors for one rendered object (empty when valid)."""
    kind = obj["kind"]
    if kind == "RayService":
        errors = validators.errors(validators.rayservice, obj)
        as_cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                      "metadata": {"name": obj["metadata"]["name"]}, "spec": cluster(obj)}
        errors += [f"as RayCluster: {e}" for e in validators.errors(validators.raycluster, as_cluster)]
        errors += kuberay_rule_errors(obj)
        # The pod templates once more, by Kubernetes' own schema.
        rc = cluster(obj)
        for g in [rc["headGroupSpec"], *rc.get("workerGroupSpecs", [])]:
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                        "template": g["template"]}
            errors += _k8s_errors(template)
        return errors
    if kind == "PodMonitor":
        return (validators.errors(validators.podmonitor, obj)
                + _label_errors("PodMonitor", obj["metadata"].get("labels", {})))
    return _k8s_errors(obj) + _label_errors(kind, obj["metadata"].get("labels", {}))


def _k8s_errors(obj: dict[str, Any]) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']} (k8s {version}) {'/'.join(map(str, e.path))}: {e.message}")
    return errors


# --- the chart as a whole -----------------------------------------------------


def test_the_chart_app_version_is_the_ferrox_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]


def test_fetch_helm_is_idempotent_once_helm_is_there(helm):
    proc = subprocess.run(["bash", str(FETCH_HELM)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "already in" in proc.stdout
    assert helm.run("version", "--short").stdout.startswith("v4.")


@pytest.mark.parametrize("case", VALUES_CASES)
def test_helm_lint_strict_passes(helm, case):
    proc = helm.run("lint", "--strict", str(CHART), *values_args(case))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.parametrize("case, kinds", [
    ("defaults", ["RayService"]),
    ("cpu-small", ["RayService"]),
    ("gpu-autoscale", ["PersistentVolumeClaim", "RayService"]),
    ("monitoring", ["ConfigMap", "PodMonitor", "RayService"]),
])
def test_every_rendered_object_validates_against_its_schema(helm, validators, case, kinds):
    objs = helm.template(*values_args(case))
    assert sorted(o["kind"] for o in objs) == kinds
    for obj in objs:
        assert validate_object(obj, validators) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_the_validators_catch_what_the_api_server_would_refuse(helm, validators):
    # A check that cannot fail proves nothing: break the default render in
    # ways a real API server or the operator would refuse, one at a time.
    rs = only(helm.template(), "RayService")
    typo = json.loads(json.dumps(rs))
    cluster(typo)["workerGroupSpecs"][0]["maxReplica"] = 4
    assert any("maxReplica" in e for e in validate_object(typo, validators))
    inverted = json.loads(json.dumps(rs))
    cluster(inverted)["workerGroupSpecs"][0]["minReplicas"] = 9
    assert "gpu: minReplicas 9 > maxReplicas 4" in validate_object(inverted, validators)
    bad_port = json.loads(json.dumps(rs))
    container(cluster(bad_port)["headGroupSpec"])["ports"][0]["containerPort"] = "6379"
    assert any("containerPort" in e for e in validate_object(bad_port, validators))
    bad_quantity = json.loads(json.dumps(rs))
    container(cluster(bad_quantity)["workerGroupSpecs"][0])["resources"]["limits"]["memory"] = "32 GB"
    assert validate_object(bad_quantity, validators) != []


@pytest.mark.parametrize("case", VALUES_CASES)
def test_the_serve_config_validates_under_serve_and_ferrox_schemas(helm, case):
    from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

    from ferrox.cluster.config import AppArgs

    rs = only(helm.template(*values_args(case)), "RayService")
    config = ServeDeploySchema.model_validate(serve_config(rs))
    (app,) = config.applications
    assert app.import_path == "ferrox.cluster.app:build_app"
    assert app.route_prefix == "/"
    assert app.name == "ferrox"
    assert config.http_options.port == 8000
    args = AppArgs.model_validate(app.args)
    RayActorOptionsSchema.model_validate(args.ray_actor_options)


def test_the_import_path_imports():
    module_name, _, attr = "ferrox.cluster.app:build_app".partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr))


@pytest.mark.parametrize("case", VALUES_CASES)
def test_build_app_accepts_the_rendered_args(helm, case):
    # Builds the application graph only: no Ray cluster starts, no model loads.
    from ray.serve import Application

    from ferrox.cluster.app import build_app

    rs = only(helm.template(*values_args(case)), "RayService")
    assert isinstance(build_app(app_args(rs)), Application)


# --- exact values per example -----------------------------------------------


def test_defaults_render_one_gpu_replica_on_a_gpu_worker_group(helm):
    rs = only(helm.template(), "RayService")
    args = app_args(rs)
    assert args["model"] == "SmolLM2-135M-Instruct"
    assert args["num_replicas"] == 1
    assert "autoscaling_config" not in args
    assert args["ray_actor_options"] == {"num_gpus": 1}
    rc = cluster(rs)
    assert rc["rayVersion"] == "2.60.0"
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    head = rc["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0", "num-gpus": "0",
                                      "metrics-export-port": "8080"}
    assert "nvidia.com/gpu" not in json.dumps(head)
    (gpu,) = rc["workerGroupSpecs"]
    assert (gpu["groupName"], gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == ("gpu", 1, 1, 4)
    assert gpu["rayStartParams"] == {"num-gpus": "1", "metrics-export-port": "8080"}
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(gpu)["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container(gpu)["image"] == "ghcr.io/ferrox/ferrox:0.1.0"
    assert gpu["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    for group in (head, gpu):
        assert {"name": "metrics", "containerPort": 8080} in container(group)["ports"]
        assert "volumes" not in group["template"]["spec"]
        assert "env" not in container(group)


def test_cpu_small_renders_two_cpu_replicas_on_a_fixed_cpu_cluster(helm):
    rs = only(helm.template(*values_args("cpu-small")), "RayService")
    args = app_args(rs)
    assert args["num_replicas"] == 2
    assert args["ray_actor_options"] == {"num_cpus": 1}
    assert args["engine"] == {"device": "cpu", "dtype": "float32", "attention_backend": "sdpa",
                              "page_size": 16, "max_num_seqs": 16, "max_prefill_tokens": 512,
                              "gpu_memory_utilization": 0.9, "enable_prefix_caching": True,
                              "kv_cache_bytes": 268435456, "torch_threads": 1}
    rc = cluster(rs)
    assert rc["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in rc
    (cpu,) = rc["workerGroupSpecs"]
    assert (cpu["groupName"], cpu["replicas"], cpu["minReplicas"], cpu["maxReplicas"]) == ("cpu", 1, 1, 1)
    assert cpu["rayStartParams"]["num-gpus"] == "0"
    assert container(cpu)["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"},
                                           "limits": {"cpu": "2", "memory": "4Gi"}}
    assert "nvidia.com/gpu" not in json.dumps(rs)


def test_gpu_autoscale_renders_serve_autoscaling_and_an_l4_group(helm):
    objs = helm.template(*values_args("gpu-autoscale"))
    rs = only(objs, "RayService")
    args = app_args(rs)
    assert "num_replicas" not in args
    assert args["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8,
                                          "target_ongoing_requests": 48, "initial_replicas": 2}
    assert args["ray_actor_options"] == {"num_gpus": 1, "accelerator_type": "L4"}
    assert args["served_model_name"] == "qwen2.5-7b"
    assert args["engine"]["attention_backend"] == "flash"
    assert args["engine"]["max_model_len"] == 16384
    assert args["router"] == {"stats_period_s": 0.25, "stale_after_s": 3.0}
    assert args["ingress"] == {"num_replicas": 2}
    (group,) = cluster(rs)["workerGroupSpecs"]
    assert group["idleTimeoutSeconds"] == 300
    assert group["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    for c in (container(cluster(rs)["headGroupSpec"]), container(group)):
        env = env_of(c)
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert env["HF_HOME"] == "/models/huggingface"
        assert c["volumeMounts"] == [{"name": "model-cache", "mountPath": "/models"}]
    pvc = only(objs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "ferrox-model-cache"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert group["template"]["spec"]["volumes"] == [
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "ferrox-model-cache"}}]


def test_the_ray_autoscaler_reads_the_groups_as_intended(helm):
    # Ray's own translation of a RayCluster CR into autoscaler node types
    # (a private function of ray 2.60, the real parser the sidecar runs).
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    rs = only(helm.template(*values_args("gpu-autoscale")), "RayService")
    config = _derive_autoscaling_config_from_ray_cr(
        {"metadata": {"name": "ferrox", "namespace": "serving"}, "spec": cluster(rs)})
    types = config["available_node_types"]
    assert types["headgroup"]["resources"] == {"CPU": 2, "GPU": 0, "memory": 8 * 2**30}
    assert types["gpu-l4"]["resources"] == {"CPU": 8, "GPU": 1, "memory": 48 * 2**30,
                                            "accelerator_type:L4": 1}
    assert (types["gpu-l4"]["min_workers"], types["gpu-l4"]["max_workers"]) == (1, 8)
    assert types["gpu-l4"]["idle_timeout_s"] == 300.0
    assert config["idle_timeout_minutes"] == 2.0


def test_monitoring_renders_a_pod_monitor_a_dashboard_and_grafana_env(helm):
    objs = helm.template(*values_args("monitoring"))
    rs = only(objs, "RayService")
    rc = cluster(rs)
    head_env = env_of(container(rc["headGroupSpec"]))
    assert head_env == {
        "RAY_GRAFANA_HOST": "http://prometheus-grafana.prometheus-system.svc:80",
        "RAY_GRAFANA_IFRAME_HOST": "http://127.0.0.1:3000",
        "RAY_PROMETHEUS_HOST": "http://prometheus-kube-prometheus-prometheus.prometheus-system.svc:9090",
        "RAY_PROMETHEUS_NAME": "Prometheus",
    }
    for group in rc["workerGroupSpecs"]:
        assert "env" not in container(group)

    monitor = only(objs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert sorted(endpoints) == ["as-metrics", "dash-metrics", "metrics"]
    assert endpoints["metrics"]["interval"] == "15s"
    head_ports = {p["name"]: p["containerPort"] for p in container(rc["headGroupSpec"])["ports"]}
    assert (head_ports["metrics"], head_ports["as-metrics"], head_ports["dash-metrics"]) == (8080, 44217, 44227)
    for group in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), "the PodMonitor must select every Ray pod"
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        assert {"name": "metrics", "containerPort": 8080} in container(group)["ports"]

    dashboard = only(objs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "ferrox"}
    assert dashboard["data"]["ferrox.json"] == (CHART / "dashboards" / "ferrox.json").read_text().rstrip("\n")
    assert json.loads(dashboard["data"]["ferrox.json"])["uid"] == "ferrox"


def test_the_chart_dashboard_is_a_grafana_dashboard():
    board = json.loads((CHART / "dashboards" / "ferrox.json").read_text())
    assert (board["title"], board["uid"]) == ("ferrox", "ferrox")
    assert board["schemaVersion"] >= 39
    assert isinstance(board["panels"], list)


def test_the_chart_dashboard_is_a_copy_of_deploy_grafana():
    source = REPO_ROOT / "deploy" / "grafana" / "ferrox.json"
    if not source.exists():
        pytest.skip("deploy/grafana/ferrox.json is not written yet; the chart carries a minimal "
                    "dashboard until then, and must then be a byte-for-byte copy of it")
    assert (CHART / "dashboards" / "ferrox.json").read_bytes() == source.read_bytes(), (
        "copy deploy/grafana/ferrox.json to helm/ferrox/dashboards/ferrox.json")


# --- the model cache ----------------------------------------------------------


@pytest.mark.parametrize("sets, claims, volume", [
    ([], 0, None),
    (["model.cache.enabled=true"], 0, {"name": "model-cache", "emptyDir": {}}),
    (["model.cache.enabled=true", "model.cache.emptyDirSizeLimit=50Gi"], 0,
     {"name": "model-cache", "emptyDir": {"sizeLimit": "50Gi"}}),
    (["model.cache.enabled=true", "model.cache.existingClaim=weights"], 0,
     {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}}),
    (["model.cache.enabled=true", "model.cache.create=true"], 1,
     {"name": "model-cache", "persistentVolumeClaim": {"claimName": "ferrox-model-cache"}}),
    (["model.cache.create=true"], 0, None),
], ids=["off", "empty-dir", "empty-dir-limit", "existing-claim", "create", "create-but-disabled"])
def test_the_model_cache_creates_a_claim_only_when_asked(helm, validators, sets, claims, volume):
    args = [a for s in sets for a in ("--set", s)]
    objs = helm.template(*args)
    pvcs = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    assert len(pvcs) == claims
    for obj in objs:
        assert validate_object(obj, validators) == []
    rc = cluster(only(objs, "RayService"))
    for group in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]:
        assert group["template"]["spec"].get("volumes") == (None if volume is None else [volume])
    if claims:
        assert pvcs[0]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert pvcs[0]["spec"]["accessModes"] == ["ReadWriteMany"]
        assert "storageClassName" not in pvcs[0]["spec"]


# --- other renderings ---------------------------------------------------------


def test_incremental_upgrade_renders_its_options_and_validates(helm, validators):
    objs = helm.template(
        "--set", "upgradeStrategy.type=NewClusterWithIncrementalUpgrade",
        "--set", "upgradeStrategy.clusterUpgradeOptions.gatewayClassName=istio",
        "--set", "upgradeStrategy.clusterUpgradeOptions.stepSizePercent=25",
        "--set", "upgradeStrategy.clusterUpgradeOptions.intervalSeconds=30",
        "--set", "rayAutoscaler.version=v2")
    rs = only(objs, "RayService")
    assert rs["spec"]["upgradeStrategy"] == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 25, "intervalSeconds": 30}}
    assert cluster(rs)["autoscalerOptions"]["version"] == "v2"
    assert validate_object(rs, validators) == []


def test_explicit_actor_options_and_extra_params_pass_through(helm, validators):
    objs = helm.template(
        "--set", "serve.rayActorOptions.num_gpus=2", "--set", "serve.rayActorOptions.num_cpus=4",
        "--set", "workerGroups[0].name=gpu", "--set", "workerGroups[0].minReplicas=0",
        "--set", "workerGroups[0].maxReplicas=2", "--set", "workerGroups[0].gpus=4",
        "--set", "workerGroups[0].acceleratorType=H100",
        "--set-string", "workerGroups[0].rayStartParams.object-store-memory=1000000000",
        "--set", "imagePullSecrets[0].name=regcred", "--set", "image.tag=dev")
    rs = only(objs, "RayService")
    assert app_args(rs)["ray_actor_options"] == {"num_gpus": 2, "num_cpus": 4}
    (group,) = cluster(rs)["workerGroupSpecs"]
    assert group["replicas"] == 0  # null replicas start at minReplicas
    assert group["rayStartParams"] == {"num-gpus": "4", "metrics-export-port": "8080",
                                       "object-store-memory": "1000000000",
                                       "resources": '"{\\"accelerator_type:H100\\":1}"'}
    assert container(group)["resources"] == {"limits": {"nvidia.com/gpu": 4},
                                             "requests": {"nvidia.com/gpu": 4}}
    assert container(group)["image"] == "ghcr.io/ferrox/ferrox:dev"
    assert group["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert validate_object(rs, validators) == []


def test_a_long_release_name_still_makes_a_valid_rayservice_name(helm, validators):
    release = "a-release-name-that-is-long-enough-to-overflow-47"
    rs = only(helm.template(release=release), "RayService")
    name = rs["metadata"]["name"]
    assert len(name) <= 47
    assert name == f"{release}-ferrox"[:47].rstrip("-")
    assert kuberay_rule_errors(rs) == []


def test_the_examples_named_in_the_docs_exist():
    docs = (REPO_ROOT / "docs" / "helm.md").read_text()
    for case in VALUES_CASES[1:]:
        assert (EXAMPLES / f"{case}.yaml").exists()
        assert f"examples/{case}.yaml" in docs


def test_the_install_notes_name_the_services_and_the_model(helm):
    proc = helm.run("install", "ferrox", str(CHART), "--dry-run=client", "--namespace", "serving",
                    *values_args("gpu-autoscale"))
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:\n", 1)[1]
    assert "kubectl -n serving port-forward svc/ferrox-serve-svc 8000:8000" in notes
    assert "kubectl -n serving port-forward svc/ferrox-head-svc 8265:8265" in notes
    assert "Model: Qwen/Qwen2.5-7B-Instruct (served as qwen2.5-7b)" in notes
    assert 'each with ray_actor_options {"accelerator_type":"L4","num_gpus":1}' in notes
    assert "emptyDir" not in notes  # this example asks for a claim
