"""The main job end to end: a real local Ray cluster, Serve, two replicas of the
embedded SmolLM2, the capacity router, and the real ``openai`` client over HTTP.

Nothing is mocked. One Serve application is shared by the module (model load
dominates the cost); tests that exhaust a replica on purpose clean up after
themselves and the last tests check that no page or slot leaked.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import openai
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MODEL = "SmolLM2-135M-Instruct"
# 2,048 KV tokens per replica: small enough that one long request visibly
# fills a replica, large enough for every other test.
KV_BYTES = 128 * 737280  # 128 pages of 16 tokens for SmolLM2 in fp32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from ferrox.cluster.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": MODEL,
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 0},
        # float32: the replies are compared token for token with the offline engine.
        "engine": {"kv_cache_bytes": KV_BYTES, "torch_threads": 1, "max_prefill_tokens": 256, "dtype": "float32"},
        "router": {"stats_period_s": 0.2},
        "ingress": {"max_waiting_requests": 24},
    }
    serve.run(build_app(args), name="ferrox", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_engine():
    from ferrox.replicas.config import EngineConfig
    from ferrox.replicas.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=MODEL, kv_cache_bytes=KV_BYTES, torch_threads=1, dtype="float32"))
    yield engine
    engine.shutdown()


def _capacity(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/capacity", timeout=30).json()


def _wait_idle(url: str, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    snaps: list[dict] = []
    while time.monotonic() < deadline:
        snaps = _capacity(url)
        if len(snaps) == 2 and all(
            s["free_slots"] == s["max_slots"] and s["kv_tokens_available"] == s["kv_tokens_total"] for s in snaps
        ):
            return snaps
        time.sleep(0.2)
    raise AssertionError(f"replicas did not return to idle: {snaps}")


def _chat_ids(engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def test_chat_completion_through_the_sdk_equals_the_offline_engine(client, offline_engine):
    from ferrox.replicas.types import SamplingParams

    question = "What is the capital of France?"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    reply = raw.parse()
    offline = offline_engine.generate(_chat_ids(offline_engine, question), SamplingParams(max_tokens=24, temperature=0))
    assert reply.choices[0].message.content == offline.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == offline.finish_reason
    assert reply.usage.prompt_tokens == offline.usage.prompt_tokens
    assert reply.usage.completion_tokens == offline.usage.completion_tokens
    assert reply.usage.total_tokens == offline.usage.prompt_tokens + offline.usage.completion_tokens
    # One request id, Serve's, which the app also uses as the completion id.
    assert raw.headers["x-request-id"] == reply.id
    assert raw.headers["x-ferrox-replica"]


def test_streamed_completion_carries_usage_in_its_last_chunk(client, offline_engine):
    from ferrox.replicas.types import SamplingParams

    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    offline = offline_engine.generate(offline_engine.tokenizer("Once upon a time").input_ids,
                                      SamplingParams(max_tokens=20, temperature=0))
    assert text == offline.text
    assert finish == [offline.finish_reason]
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (offline.usage.prompt_tokens, offline.usage.completion_tokens)


def test_streamed_chat_and_plain_completion_agree_on_text(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    parts = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    streamed = "".join((c.choices[0].delta.content or "") for c in parts if c.choices)
    assert streamed == whole.choices[0].message.content


def test_sixteen_concurrent_streams_across_two_replicas_all_finish_with_correct_usage(cluster):
    aclient = openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int):
        raw = await aclient.completions.with_raw_response.create(
            model=MODEL, prompt=f"Count with me: {i}, {i + 1},", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        replica = raw.headers["x-ferrox-replica"]
        pieces, usage = 0, None
        async for chunk in raw.parse():
            if chunk.usage:
                usage = chunk.usage
            pieces += bool(chunk.choices)
        return replica, usage

    async def main():
        return await asyncio.gather(*[one(i) for i in range(16)])

    results = asyncio.run(main())
    assert all(u.completion_tokens == 12 for _, u in results)
    assert all(u.prompt_tokens > 5 for _, u in results)
    assert len({r for r, _ in results}) == 2, "both replicas served part of the burst"
    _wait_idle(cluster)


def test_a_long_request_goes_to_the_replica_with_room(cluster, client):
    """Fill one replica's pool with a long reservation; the next long requests
    must land on the other (seen in x-ferrox-replica)."""
    _wait_idle(cluster)
    hog = httpx.Client(timeout=300)
    body = {"model": MODEL, "prompt": "Tell me everything about the sea.", "max_tokens": 1700,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with hog.stream("POST", f"{cluster}/v1/completions", json=body) as held:
        assert held.status_code == 200
        full = held.headers["x-ferrox-replica"]
        # Let the router see the reservation in a fresh snapshot.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snaps = {s["replica_id"]: s for s in _capacity(cluster)}
            if snaps[full]["kv_tokens_available"] < 600:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        other = [r for r in snaps if r != full]
        assert len(other) == 1
        for i in range(3):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"Long request {i}", max_tokens=800, temperature=0,
                extra_body={"ignore_eos": True}, timeout=300, stream=True,
            )
            assert raw.headers["x-ferrox-replica"] == other[0]
            raw.parse().close()
    hog.close()
    _wait_idle(cluster)


def test_a_repeated_long_prefix_goes_back_to_the_replica_that_cached_it(cluster, client):
    _wait_idle(cluster)
    document = " ".join(f"Fact {i}: the number {i} is followed by {i + 1}." for i in range(30))
    first = client.completions.with_raw_response.create(model=MODEL, prompt=document, max_tokens=4, temperature=0)
    home = first.headers["x-ferrox-replica"]
    assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
    prompt_tokens = first.parse().usage.prompt_tokens
    time.sleep(1.0)  # a routing-stats period or more, so the digest reaches the router
    for _ in range(3):
        again = client.completions.with_raw_response.create(model=MODEL, prompt=document, max_tokens=4, temperature=0)
        assert again.headers["x-ferrox-replica"] == home
        cached = again.parse().usage.prompt_tokens_details.cached_tokens
        assert cached == (prompt_tokens - 1) // 16 * 16
    _wait_idle(cluster)


# ------------------------------------------------------------------ errors
def _post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=60, **kwargs)


def test_malformed_json_is_a_400_in_openai_form(cluster):
    r = _post(cluster, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"


def test_missing_and_wrong_typed_fields_are_400_naming_the_field(cluster):
    r = _post(cluster, "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(cluster, "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = _post(cluster, "/v1/completions", json={"model": MODEL, "prompt": "hi", "top_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = _post(cluster, "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2})
    assert r.status_code == 400 and "n" == r.json()["error"]["param"]


def test_an_unknown_model_is_a_404(cluster):
    r = _post(cluster, "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404
    assert "gpt-9" in r.json()["error"]["message"]


def test_a_request_over_the_context_or_the_pool_is_a_400_with_both_numbers(cluster):
    r = _post(cluster, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 9000})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "8192" in message and "9001" in message or "9000" in message
    r = _post(cluster, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4000})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "2048" in message and "4001" in message


def test_waiting_work_over_the_bound_is_a_503_with_retry_after(cluster):
    """The ingress admits at most 24 requests in flight; the 25th and later get 503."""

    async def main():
        async with httpx.AsyncClient(base_url=cluster, timeout=300) as http:
            body = {"model": MODEL, "prompt": "Go on and on.", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(40)])

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 24
    busy = [r for r in responses if r.status_code == 503]
    assert busy, f"no request was refused: {codes}"
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert all(r.json()["error"]["type"] == "overloaded_error" for r in busy)
    assert set(codes) == {200, 503}
    _wait_idle(cluster)


def test_models_and_health_answer(cluster):
    models = httpx.get(f"{cluster}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = httpx.get(f"{cluster}/health")
    assert health.status_code == 200


def test_no_bad_request_leaked_a_page_or_a_slot(cluster):
    snaps = _wait_idle(cluster)
    assert [s["kv_tokens_total"] for s in snaps] == [2048, 2048]
    assert [s["free_slots"] for s in snaps] == [64, 64]
    assert [s["running_requests"] for s in snaps] == [0, 0]
    assert [s["waiting_requests"] for s in snaps] == [0, 0]


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event(cluster):
    """Kill the replica actor serving a stream (a real failure, not a mock):
    the client sees an error event and [DONE], not a hang."""
    import ray

    body = {"model": MODEL, "prompt": "Write forever.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        replica = r.headers["x-ferrox-replica"]
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                break
        victim = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].endswith(f"#{replica}") and a["name"].startswith("SERVE_REPLICA::")]
        assert len(victim) == 1
        ray.kill(ray.get_actor(victim[0]["name"], namespace=victim[0]["namespace"]), no_restart=True)
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]
