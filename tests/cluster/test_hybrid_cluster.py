"""The window (Qwen3 sliding/full layers) and Mamba2 hybrid (Bamba) families
served through the whole cluster: real Ray, Serve, the router and the
``openai`` client, on tiny random-weight models written as Hugging Face
directories (the same ones ``ferrox bench offline --tiny`` uses).

Their capacity snapshots carry the window pool and the recurrent pool, and
both pools come back whole once the traffic is done.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import openai
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    import ray
    from ray import serve

    from ferrox.bench import write_tiny_model
    from ferrox.cluster.app import build_app

    window = write_tiny_model("window", tmp_path_factory.mktemp("tiny-window"))
    hybrid = write_tiny_model("hybrid", tmp_path_factory.mktemp("tiny-hybrid"))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "router": {"stats_period_s": 0.2}}
    serve.run(build_app({**common, "model": window, "served_model_name": "tiny-window",
                         "engine": {"kv_cache_bytes": 8 << 20, "torch_threads": 1, "max_prefill_tokens": 64}}),
              name="window", route_prefix="/window")
    serve.run(build_app({**common, "model": hybrid, "served_model_name": "tiny-hybrid",
                         "engine": {"kv_cache_bytes": 8 << 20, "torch_threads": 1, "max_prefill_tokens": 64,
                                    "num_recurrent_slots": 6}}),
              name="hybrid", route_prefix="/hybrid")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _idle(url: str, prefix: str) -> dict:
    deadline = time.monotonic() + 30
    snap: dict = {}
    while time.monotonic() < deadline:
        [snap] = httpx.get(f"{url}/{prefix}/v1/capacity", timeout=30).json()
        if snap["running_requests"] == 0 and snap["free_slots"] == snap["max_slots"]:
            return snap
        time.sleep(0.2)
    raise AssertionError(f"{prefix} did not return to idle: {snap}")


@pytest.mark.parametrize("prefix", ["window", "hybrid"])
def test_each_family_answers_the_openai_client_with_exact_usage(apps, prefix):
    client = openai.OpenAI(base_url=f"{apps}/{prefix}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "A long prompt that crosses the window edge: " + " ".join(str(i) for i in range(60))
    reply = client.completions.create(model=f"tiny-{prefix}", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    again = client.completions.create(model=f"tiny-{prefix}", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True}, stream=True)
    streamed = "".join(c.choices[0].text for c in again if c.choices)
    assert reply.usage.completion_tokens == 20
    assert reply.choices[0].finish_reason == "length"
    assert streamed == reply.choices[0].text, "greedy output is the same streamed or not"


def test_the_window_replica_reports_its_window_pool_and_gets_it_all_back(apps):
    snap = _idle(apps, "window")
    assert snap["swa_tokens_available"] is not None and snap["swa_tokens_available"] > 0
    assert snap["recurrent_slots_available"] is None
    assert snap["kv_tokens_available"] == snap["kv_tokens_total"]


def test_the_hybrid_replica_reports_its_recurrent_slots_and_gets_them_all_back(apps):
    snap = _idle(apps, "hybrid")
    assert snap["recurrent_slots_available"] == 6
    assert snap["swa_tokens_available"] is None
    assert snap["kv_tokens_available"] == snap["kv_tokens_total"]
