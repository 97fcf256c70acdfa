"""The Grafana dashboard (deploy/grafana/ferrox.json) and the Prometheus config, checked offline.

What a Grafana would refuse or show broken, without a Grafana: the
dashboard's shape (schemaVersion, unique panel ids, the 24-column grid), a
data source and targets on every panel through the ``$datasource``
variable, model and replica filters on every query, and every query parsed
as PromQL by the real ``promtool`` (Debian's ``prometheus`` package). The
queries are also checked against the metrics ferrox actually defines, both
ways, so a renamed metric breaks this test rather than a panel.
That each query returns data from a live cluster is
tests/cluster/test_metrics_prometheus.py's job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ferrox.cluster.metrics import CLUSTER_METRICS
from ferrox.replicas.metrics import ENGINE_METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ferrox.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
DS = {"type": "prometheus", "uid": "${datasource}"}
LATENCY = (
    "ray_ferrox_time_to_first_token_seconds",
    "ray_ferrox_inter_token_latency_seconds",
    "ray_ferrox_e2e_request_latency_seconds",
    "ray_ferrox_request_queue_time_seconds",
)


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def graph_panels(board: dict) -> list[dict]:
    return [p for p in all_panels(board) if p["type"] != "row"]


def exprs(board: dict) -> list[str]:
    return [t["expr"] for p in graph_panels(board) for t in p["targets"]]


def substitute(expr: str) -> str:
    """The query as Grafana sends it with "All" selected and a 1 h range."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
            .replace("$model", ".*").replace("$replica", ".*"))


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (scripts/test-tools.sh does)"
    return path


def test_the_dashboard_is_grafana_dashboard_json(board):
    assert (board["title"], board["uid"]) == ("ferrox", "ferrox")
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 39
    assert isinstance(board["version"], int)
    assert board["time"] == {"from": "now-1h", "to": "now"}
    assert isinstance(board["panels"], list) and board["panels"]
    assert isinstance(board["templating"]["list"], list)
    assert isinstance(board["annotations"]["list"], list)
    for p in all_panels(board):
        assert isinstance(p["id"], int), p
        assert p["type"] in ("row", "timeseries", "stat"), p["type"]
        assert p["title"], p


def test_panel_ids_are_unique(board):
    ids = [p["id"] for p in all_panels(board)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_every_panel_has_the_datasource_variable_and_targets(board):
    for p in graph_panels(board):
        assert p["datasource"] == DS, p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, p["title"]
            assert t["expr"].strip(), p["title"]
            assert "legendFormat" in t, p["title"]


def test_panels_tile_the_24_column_grid_without_overlap(board):
    taken: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


def test_the_rows_are_traffic_latency_capacity_scheduler_router(board):
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "Capacity per replica", "Scheduler", "Router"]
    # Every row holds panels: they follow it at the top level (rows are open).
    kinds = [p["type"] for p in board["panels"]]
    for i, kind in enumerate(kinds):
        if kind == "row":
            assert i + 1 < len(kinds) and kinds[i + 1] != "row"
            assert board["panels"][i]["collapsed"] is False


def test_the_latency_row_shows_p50_p90_p99_of_each_latency(board):
    queries = exprs(board)
    for metric in LATENCY:
        for q in ("0.5", "0.9", "0.99"):
            want = f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{"
            assert any(e.startswith(want) for e in queries), (metric, q)


def test_the_variables_are_datasource_model_and_replica(board):
    v = {x["name"]: x for x in board["templating"]["list"]}
    assert list(v) == ["datasource", "model", "replica"]
    assert (v["datasource"]["type"], v["datasource"]["query"]) == ("datasource", "prometheus")
    for name in ("model", "replica"):
        assert v[name]["type"] == "query"
        assert v[name]["datasource"] == DS
        assert (v[name]["includeAll"], v[name]["allValue"], v[name]["multi"]) == (True, ".*", True)
        assert v[name]["query"]["query"] == v[name]["definition"]
    assert v["model"]["definition"] == "label_values(ray_ferrox_running_requests, model)"
    assert v["replica"]["definition"] == 'label_values(ray_ferrox_running_requests{model=~"$model"}, replica)'


def test_every_query_filters_by_model_and_engine_queries_by_replica(board):
    for e in exprs(board):
        for selector in re.findall(r"ray_ferrox_[a-z0-9_]+\{([^}]*)\}", e):
            assert 'model=~"$model"' in selector, e
            if "ray_ferrox_http_requests" not in e:  # the ingress's replicas are not engine replicas
                assert 'replica=~"$replica"' in selector, e


def _referenced(board: dict) -> set[str]:
    names = set()
    for e in exprs(board):
        names |= set(re.findall(r"\b(ray_ferrox_[a-z0-9_]+)\b", e))
    for v in board["templating"]["list"]:
        names |= set(re.findall(r"\b(ray_ferrox_[a-z0-9_]+)\b", v.get("definition", "")))
    return names


def test_the_dashboard_reads_every_ferrox_metric_and_only_those(board):
    specs = ENGINE_METRICS + CLUSTER_METRICS
    series: dict[str, str] = {}
    for s in specs:
        if s.kind == "histogram":
            for suffix in ("_bucket", "_count", "_sum"):
                series[s.prometheus_name + suffix] = s.name
        else:
            series[s.prometheus_name] = s.name
    referenced = _referenced(board)
    assert referenced <= set(series), f"unknown metrics in the dashboard: {sorted(referenced - set(series))}"
    assert {series[n] for n in referenced} == {s.name for s in specs}, (
        f"metrics no panel shows: {sorted({s.name for s in specs} - {series[n] for n in referenced})}")


def test_every_query_parses_as_promql(board, tmp_path):
    rules = {"groups": [{"name": "ferrox-dashboard", "rules": [
        {"record": f"ferrox:dashboard_query_{i}", "expr": substitute(e)} for i, e in enumerate(exprs(board))
    ]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules['groups'][0]['rules'])} rules found" in proc.stdout + proc.stderr


def test_the_prometheus_config_scrapes_rays_service_discovery_file():
    proc = subprocess.run([promtool(), "check", "config", str(PROMETHEUS_YML)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "ray"
    assert job["file_sd_configs"] == [{"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}]
