"""ferrox's metrics end to end: a live Serve app, real traffic, a real Prometheus.

A local Ray cluster exports its metrics on a known port; Debian's
``prometheus`` (started here, on a free loopback port, with the scrape job
of deploy/prometheus.yml pointed at that port through a service-discovery
file like the one Ray's head writes) scrapes it every second. One replica
of the embedded SmolLM2 with two request slots serves a known load: two
warm-up completions, then five at once, each of exactly 8 tokens
(``ignore_eos``), all with one prompt so the later ones hit the prefix
cache and the full replica refuses admissions for lack of a slot.

Then, through Prometheus's query API: the counters equal the traffic
exactly (requests, prompt / cached / generated tokens, histogram counts,
HTTP responses, routing decisions), the gauges settle to an idle replica,
and every query of deploy/grafana/ferrox.json returns at least one series
with finite values. Nothing is mocked.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ferrox.json"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
MODEL = "SmolLM2-135M-Instruct"
KV_BYTES = 128 * 737280  # 128 pages of 16 tokens for SmolLM2 in fp32: 2,048 KV tokens
KV_TOKENS = 2048
MAX_TOKENS = 8
BURST = 5
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill "
          "and the rain taps softly on the old tin roof of the barn.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Unequal(dict):
    """A falsy dict: what a poll saw, kept for the timeout message."""

    def __bool__(self) -> bool:
        return False


def _until(check, timeout: float, what: str, interval: float = 0.5):
    """Poll ``check()`` until it returns a truthy value; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


class Prometheus:
    """A real Prometheus server scraping ``target`` every second, with deploy/prometheus.yml's job."""

    def __init__(self, tmp: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus not found: install Debian's prometheus package (scripts/test-tools.sh does)"
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        [job] = config["scrape_configs"]
        discovery = tmp / "prom_metrics_service_discovery.json"
        # The format Ray's head writes (ray._private.metrics_agent.PrometheusServiceDiscoveryWriter).
        discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [target]}]))
        job["file_sd_configs"] = [{"files": [str(discovery)]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        def ready():
            assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}"
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        _until(ready, 60, "prometheus to be ready", 0.2)

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The single value of ``promql`` (e.g. a ``sum(...)``), ``None`` if it has no series."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray
    from ray import serve

    from ferrox.cluster.app import build_app

    metrics_port = _free_port()
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{metrics_port}")
    # Ray's workers report metrics to the node's agent every
    # metrics_report_interval_ms (floored at 1 s), 10 s by default.
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    http_port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = {
        "model": MODEL,
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "engine": {"kv_cache_bytes": KV_BYTES, "torch_threads": 1, "max_prefill_tokens": 256, "max_num_seqs": 2,
                   "dtype": "float32"},  # KV_BYTES is sized in fp32 pages
        "router": {"stats_period_s": 0.2},
        "ingress": {"max_waiting_requests": 24},
    }
    try:
        serve.run(build_app(args), name="ferrox", route_prefix="/")
        prom.wait_ready()
        yield prom, f"http://127.0.0.1:{http_port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        prom.close()


def _complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def traffic(stack):
    """The load, and what the clients saw: replica id and the usage of each completion."""
    prom, url = stack
    replica = httpx.get(f"{url}/v1/capacity", timeout=30).json()[0]["replica_id"]
    # Two warm-ups, so that every series the burst adds to exists in
    # Prometheus before it (rates over a window holding the burst then see
    # it): the second finds the first's prompt pages cached (prefix_hit).
    replies = [_complete(url)]
    _until(lambda: prom.value("sum(ray_ferrox_requests_total)") == 1, 60, "the first warm-up in Prometheus")
    replies.append(_complete(url))
    _until(lambda: prom.value("sum(ray_ferrox_requests_total)") == 2, 60, "the second warm-up in Prometheus")
    with ThreadPoolExecutor(BURST) as pool:
        replies += list(pool.map(lambda _: _complete(url), range(BURST)))
    n = len(replies)
    want = {"ray_ferrox_requests_total": n, "ray_ferrox_generation_tokens_total": n * MAX_TOKENS,
            'ray_ferrox_http_requests_total{endpoint="/v1/completions"}': n}

    def counted():
        got = {k: prom.value(f"sum({k})") for k in want}
        return got == want or _Unequal(got)
    _until(counted, 60, f"the burst's counters in Prometheus to reach {want}")
    return {
        "replica": replica,
        "requests": n,
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in replies),
        "cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in replies),
        "ids": {r["id"]: r["usage"] for r in replies},
    }


def _by(prom: Prometheus, promql: str, *labels: str) -> dict:
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in prom.query(promql)}


def test_the_request_and_token_counters_equal_the_traffic(stack, traffic):
    prom, _ = stack
    n = traffic["requests"]
    assert traffic["completion_tokens"] == n * MAX_TOKENS
    assert traffic["cached_tokens"] > 0  # the burst found the warm-up's prompt pages cached
    assert _by(prom, "sum by (finish_reason, status) (ray_ferrox_requests_total)", "finish_reason", "status") == {
        ("length", "ok"): n}
    assert prom.value("sum(ray_ferrox_generation_tokens_total)") == n * MAX_TOKENS
    assert prom.value("sum(ray_ferrox_prompt_tokens_total)") == traffic["prompt_tokens"]
    assert prom.value("sum(ray_ferrox_cached_prompt_tokens_total)") == traffic["cached_tokens"]
    # Tokens the forward passes computed: the uncached prompt, then one per decode.
    assert _by(prom, "sum by (kind) (ray_ferrox_step_tokens_total)", "kind") == {
        ("prefill",): traffic["prompt_tokens"] - traffic["cached_tokens"],
        ("decode",): n * (MAX_TOKENS - 1)}
    assert _by(prom, "sum by (endpoint, status) (ray_ferrox_http_requests_total)", "endpoint", "status") == {
        ("/v1/completions", "200"): n, ("/v1/capacity", "200"): 1}


def test_each_request_is_observed_once_in_every_latency_histogram(stack, traffic):
    prom, _ = stack
    n = traffic["requests"]
    for metric in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens"):
        assert prom.value(f"sum(ray_ferrox_{metric}_count)") == n, metric
    # Every token after a request's first has an inter-token latency.
    assert prom.value("sum(ray_ferrox_inter_token_latency_seconds_count)") == n * (MAX_TOKENS - 1)
    # The +Inf bucket holds every observation.
    assert prom.value('sum(ray_ferrox_time_to_first_token_seconds_bucket{le="+Inf"})') == n


def test_the_router_counts_one_decision_per_request_with_its_snapshot_age(stack, traffic):
    prom, _ = stack
    n = traffic["requests"]
    decisions = _by(prom, "sum by (outcome, replica) (ray_ferrox_router_decisions_total)", "outcome", "replica")
    assert sum(decisions.values()) == n
    assert {replica for _, replica in decisions} == {traffic["replica"]}
    assert {outcome for outcome, _ in decisions} <= {"seat_fit", "prefix_hit", "wait", "fallback"}
    # After the warm-up, the replica's snapshot holds the prompt's pages.
    assert decisions.get(("prefix_hit", traffic["replica"]), 0) >= 1
    ages = prom.value("sum(ray_ferrox_router_snapshot_age_seconds_count)")
    fallbacks = decisions.get(("fallback", traffic["replica"]), 0)
    assert n - fallbacks <= ages <= n


def test_a_full_replica_counts_refusals_for_want_of_a_request_slot(stack, traffic):
    prom, _ = stack
    # Five requests at once on two slots: steps ran while some waited.
    refusals = _by(prom, "sum by (reason) (ray_ferrox_admission_refusals_total)", "reason")
    assert refusals.get(("no_request_slot",), 0) >= 1
    assert set(refusals) <= {("no_request_slot",), ("kv_budget",), ("budget_spent",), ("no_whole_page",)}


def test_the_gauges_settle_to_an_idle_replica(stack, traffic):
    prom, _ = stack
    replica = traffic["replica"]

    def settled():
        return (prom.value("sum(ray_ferrox_running_requests)") == 0
                and prom.value("sum(ray_ferrox_waiting_requests)") == 0
                and prom.value('sum(ray_ferrox_pool_used{pool="kv"})') == 0)
    _until(settled, 30, "running, waiting and KV use back to 0")
    assert _by(prom, "ray_ferrox_pool_capacity", "replica", "pool") == {(replica, "kv"): KV_TOKENS}
    assert _by(prom, "ray_ferrox_pool_usage_ratio", "replica", "pool") == {(replica, "kv"): 0.0}
    cached = prom.value("sum(ray_ferrox_prefix_cache_tokens)")
    assert cached > 0 and cached % 16 == 0  # whole pages of the shared prompt
    ratio = prom.value("sum(ray_ferrox_prefix_cache_hit_ratio)")
    assert ratio == pytest.approx(traffic["cached_tokens"] / traffic["prompt_tokens"])


def test_every_series_is_tagged_with_the_model_and_its_replica(stack, traffic):
    prom, _ = stack
    series = prom.query('{__name__=~"ray_ferrox_.+"}')
    assert len(series) > 50
    for s in series:
        m = s["metric"]
        assert m["model"] == MODEL, m
        if m["__name__"].startswith("ray_ferrox_http_requests"):
            assert m["replica"], m  # the ingress replica
        else:
            assert m["replica"] == traffic["replica"], m


def _promql_regex(value: str) -> str:
    """``value`` as a regex matching only itself, inside a PromQL string (as Grafana escapes it)."""
    return re.escape(value).replace("\\", "\\\\")


def _dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for p in board["panels"]:
        for inner in [p, *p.get("panels", [])]:
            for t in inner.get("targets", []):
                out.append((f"{inner['title']} [{t['refId']}]", t["expr"]))
    return out


def test_every_dashboard_query_returns_data(stack, traffic):
    prom, _ = stack
    model, replica = _promql_regex(MODEL), _promql_regex(traffic["replica"])
    empty, not_finite = [], []
    queries = _dashboard_queries()
    for title, expr in queries:
        promql = (expr.replace("$__rate_interval", "5m").replace("$__range", "10m")
                  .replace("$model", model).replace("$replica", replica))
        result = prom.query(promql)
        if not result:
            empty.append((title, promql))
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            not_finite.append((title, promql, result))
    assert len(queries) >= 40
    assert empty == [], f"queries with no series: {empty}"
    assert not_finite == [], f"queries with no finite value: {not_finite}"


def test_the_dashboard_variables_list_the_model_and_the_replica(stack, traffic):
    prom, _ = stack
    board = json.loads(DASHBOARD.read_text())
    found = {}
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
        assert m, v["definition"]
        selector = m.group(1).replace("$model", _promql_regex(MODEL))
        found[v["name"]] = {s["metric"][m.group(2)] for s in prom.query(selector)}
    assert found == {"model": {MODEL}, "replica": {traffic["replica"]}}


def test_each_request_leaves_one_structured_line_in_its_replicas_serve_log(stack, traffic):
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    [path] = logs.glob(f"replica_ferrox_FerroxReplica_{traffic['replica']}*.log")

    def lines():
        found = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in path.read_text().splitlines()
                 if "request_id=" in line]
        return found if len(found) >= traffic["requests"] else None
    found = _until(lines, 30, f"{traffic['requests']} request lines in {path}")
    assert {f["request_id"] for f in found} == set(traffic["ids"])
    assert len(found) == traffic["requests"]
    for f in found:
        usage = traffic["ids"][f["request_id"]]
        assert (f["replica"], f["finish_reason"], f["status"]) == (traffic["replica"], "length", "ok")
        assert int(f["prompt_tokens"]) == usage["prompt_tokens"]
        assert int(f["cached_tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
        assert int(f["completion_tokens"]) == MAX_TOKENS
        assert 0 <= float(f["queue_s"]) <= float(f["ttft_s"]) <= float(f["e2e_s"])
