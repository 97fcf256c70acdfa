"""The OpenAI-compatible HTTP application, independent of Ray.

Decided here, for /v1/completions and /v1/chat/completions:

- The order of checks, cheapest first, each failing with an OpenAI-style
  error: JSON and field validation (400, :mod:`ferrox.cluster.protocol`),
  the model name (404), the chat template / tokenization, an empty prompt
  (400), token ids outside the vocabulary (400), and the length check
  (400) of prompt + output budget against both the model's context
  (``max_model_len``) and the largest replica's KV pool
  (``max_seatable_tokens``), the message giving both numbers as vLLM and
  OpenAI do. A request that fails any of these never reaches a replica.
- The output budget when the client gives none:
  ``min(default_max_tokens, max_model_len - prompt, max_seatable_tokens - prompt)``.
  The last term exists because replicas reserve prompt + budget at
  admission: an unbounded default would ask for more KV than any replica
  has and the request could never run.
- The request id (``cmpl-<hex>`` / ``chatcmpl-<hex>``, or the client's
  ``x-request-id``) and the prefix-page hashes the router reads
  (:func:`ferrox.scheduler.radix.page_hashes` at the backend's page size).
- How TokenChunks become responses: one JSON body, or Server-Sent Events
  (``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``) shaped like OpenAI's stream,
  with the include_usage final chunk. The first chunk is awaited *before*
  the response starts, so an error raised before any output (503
  overloaded, ...) is a real HTTP error and the ``x-ferrox-replica`` header
  can name the replica that took the request. An error after output has
  started becomes an ``{"error": ...}`` event followed by ``[DONE]``; the
  engine's "abort" finish reason is never shown to clients as a finish
  reason, only as an error.
- That the backend's stream is always closed (``aclose``), shielded from
  cancellation, whether the request finishes, fails, or the client goes
  away mid-stream, so the backend can abort the request and free its slot.

Deliberately not here: Ray. The app talks to a :class:`Backend`; the
cluster's ingress implements it over Serve handles, tests over an
in-process stand-in. Nor is admission control (queue limits) here: a
backend refuses by raising :class:`OpenAIError` (503) before its first chunk.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ferrox.cluster.errors import (
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    OpenAIError,
    install_error_handlers,
    response_headers,
    validation_error,
)
from ferrox.cluster.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chunk_dict,
)
from ferrox.replicas.types import GenerateRequest, SamplingParams, TokenChunk
from ferrox.scheduler.radix import page_hashes

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

_CLIENT_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces


class Backend(Protocol):
    """What the HTTP app needs from the serving cluster.

    - ``model_name``: the only name accepted in the ``model`` field.
    - ``max_model_len``: the context limit, tokens (prompt + output).
    - ``page_size``: KV page size, tokens; prefix hashes are taken per page.
    - ``tokenizer``: applies the chat template and tokenizes prompts.
    - ``default_max_tokens``: output budget when the client gives none;
      ``None`` means whatever context remains.
    - ``max_seatable_tokens()``: the largest replica's KV pool, tokens; a
      request needing more can never run.
    - ``generate(request)``: the request's TokenChunks. Raises
      :class:`OpenAIError` (e.g. 503 overloaded) before the first chunk to
      refuse it; ``TokenChunk.replica`` names the replica; a chunk with
      ``error`` set ends the stream with that error. Closing the iterator
      (``aclose``) before its end aborts the request. Declared as what an
      ``async def`` with ``yield`` is; an ``async def`` that returns an async
      iterator is accepted too (the app awaits it first).
    - ``healthy()`` / ``capacity()``: for /health and /v1/capacity
      (``capacity`` returns :meth:`CapacitySnapshot.to_dict` dicts).
    """

    model_name: str
    max_model_len: int
    page_size: int
    tokenizer: "transformers.PreTrainedTokenizerBase"
    default_max_tokens: int | None

    def max_seatable_tokens(self) -> int: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]: ...

    async def healthy(self) -> bool: ...

    async def capacity(self) -> list[dict]: ...


# ------------------------------------------------------------------------ utilities


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _parse_body(request: Request, model: type[Any]) -> Any:
    """The request body validated as ``model``; malformed JSON and invalid fields -> 400.

    The body is parsed whatever its content-type (``curl -d`` sends
    form-urlencoded), and NaN / Infinity are refused as the JSON spec does.
    """
    raw = await request.body()
    if not raw.strip():
        raise OpenAIError(400, "The request body is missing; send a JSON object", code="missing_body")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise OpenAIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def _token_list(encoded: Any) -> list[int]:
    """Token ids from whatever a tokenizer call returned (list, nested list, BatchEncoding)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], (list, tuple)):
        encoded = list(encoded[0])
    return [int(t) for t in encoded]


async def _aclose(stream: Any) -> None:
    """Close a backend stream, even from a cancelled task (the backend must see it)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:  # a failing cleanup must not replace the response's own outcome
            logger.warning("closing the backend stream failed", exc_info=True)


def _sse(data: Mapping[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


def _chunk_failure(chunk: TokenChunk) -> OpenAIError | None:
    """The error a chunk ends its request with, if any ("abort" is an error, not a finish)."""
    if chunk.error is not None:
        return OpenAIError(
            500, f"The request failed during generation: {chunk.error}", type="server_error", code="generation_error"
        )
    if chunk.finish_reason == "abort":
        return OpenAIError(500, "The request was aborted by the server", type="server_error", code="aborted")
    return None


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that notices a departed client and always closes its body iterator.

    Starlette watches for ``http.disconnect`` only under ASGI spec < 2.4; under
    2.4 it waits for a failing ``send``, which never comes while the backend
    is still queueing or prefilling, and it then leaves the generator
    suspended until garbage collection. Here the watch is kept for every
    server (``receive`` reports ``http.disconnect`` in all spec versions) and
    the generator is closed at once, so its ``finally`` aborts the backend
    request.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.3"}}
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            # The client went away while we were sending; nobody is left to tell.
            logger.info("client disconnected during a streamed response")
        finally:
            await _aclose(self.body_iterator)


# ------------------------------------------------------------------------ the app


class _Frontend:
    """The request handling behind the routes; one per app."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # Tokenization runs in worker threads (long prompts would stall every
        # stream on the event loop); one at a time, because a fast tokenizer's
        # Rust object refuses concurrent use ("Already borrowed").
        self._tokenizer_lock = threading.Lock()

    # -- preparation ------------------------------------------------------------

    def _request_id(self, request: Request, prefix: str) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given and _CLIENT_REQUEST_ID.match(given):
            request_id = given
        else:
            request_id = f"{prefix}-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        return request_id

    def _check_model(self, model: str) -> None:
        if model != self.backend.model_name:
            raise OpenAIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.backend.model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            with self._tokenizer_lock:
                encoded = self.backend.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
        except jinja2.TemplateError as exc:
            # The template's raise_exception (e.g. "roles must alternate") is the client's problem.
            raise OpenAIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
        return _token_list(encoded)

    def _encode_text(self, prompt: str) -> list[int]:
        # The tokenizer's default special tokens: a BOS where the model wants one, none for SmolLM2.
        with self._tokenizer_lock:
            return _token_list(self.backend.tokenizer(prompt))

    def _check_vocab(self, token_ids: Sequence[int], param: str) -> None:
        vocab = len(self.backend.tokenizer)
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab:
            token = low if low < 0 else high
            raise OpenAIError(
                    400,
                f"Token id {token} in '{param}' is out of range: this model's vocabulary "
                f"has {vocab} tokens (ids 0 to {vocab - 1})",
                param=param,
                code="invalid_value",
            )

    def _output_budget(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int, where: str) -> int:
        """The request's max_tokens after the context and KV-pool checks (see module docstring)."""
        context = self.backend.max_model_len
        seatable = self.backend.max_seatable_tokens()
        requested = body.requested_max_tokens
        if requested is not None:
            total = prompt_len + requested
            param = where if prompt_len >= context else body.max_tokens_param
            if total > context:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{total} tokens ({prompt_len} in the {where}, {requested} in the completion). "
                    f"Please reduce the length of the {where} or completion.",
                    param=param,
                    code="context_length_exceeded",
                )
            if total > seatable:
                raise OpenAIError(
                    400,
                    f"This server's largest KV cache holds {seatable} tokens. However, you requested "
                    f"{total} tokens ({prompt_len} in the {where}, {requested} in the completion). "
                    f"Please reduce the length of the {where} or completion.",
                    param=where if prompt_len >= seatable else body.max_tokens_param,
                    code="context_length_exceeded",
                )
            return requested
        if prompt_len >= context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {context} tokens. However, your {where} "
                f"resulted in {prompt_len} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {where}.",
                param=where,
                code="context_length_exceeded",
            )
        if prompt_len >= seatable:
            raise OpenAIError(
                400,
                f"This server's largest KV cache holds {seatable} tokens. However, your {where} "
                f"resulted in {prompt_len} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {where}.",
                param=where,
                code="context_length_exceeded",
            )
        default = self.backend.default_max_tokens
        return int(min(math.inf if default is None else default, context - prompt_len, seatable - prompt_len))

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        try:
            return body.to_sampling_params(max_tokens)
        except ValueError as exc:
            # SamplingParams' messages start with the field's name.
            first = str(exc).split(" ", 1)[0]
            param = first if first.isidentifier() else None
            raise OpenAIError(400, str(exc), param=param, code="invalid_value") from None

    async def _prepare(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, request_id: str
    ) -> GenerateRequest:
        self._check_model(body.model)
        if isinstance(body, ChatCompletionRequest):
            where = "messages"
            token_ids = await run_in_threadpool(self._encode_chat, body.chat_messages())
        else:
            where = "prompt"
            if isinstance(body.prompt, str):
                token_ids = await run_in_threadpool(self._encode_text, body.prompt) if body.prompt else []
            else:
                token_ids = list(body.prompt)
        if not token_ids:
            raise OpenAIError(400, f"The {where} is empty", param=where, code="empty_prompt")
        self._check_vocab(token_ids, where)
        if body.stop_token_ids:
            self._check_vocab(body.stop_token_ids, "stop_token_ids")
        max_tokens = self._output_budget(body, len(token_ids), where)
        params = self._sampling_params(body, max_tokens)
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            params=params,
            stream=body.stream,
            prefix_hashes=tuple(page_hashes(token_ids, self.backend.page_size)),
        )

    # -- running ----------------------------------------------------------------

    async def _start(self, request: Request, gen_request: GenerateRequest) -> tuple[Any, TokenChunk]:
        """Start generation and wait for the first chunk (errors before it propagate as HTTP errors)."""
        stream: Any = self.backend.generate(gen_request)
        if inspect.isawaitable(stream):
            stream = await stream
        iterator = stream.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            await _aclose(iterator)
            raise OpenAIError(
                500, "The backend ended the request without any output", type="server_error", code="no_output"
            ) from None
        except BaseException:
            await _aclose(iterator)
            raise
        if first.replica:
            request.state.replica = first.replica
        failure = _chunk_failure(first)
        if failure is not None:
            await _aclose(iterator)
            raise failure
        return iterator, first

    async def handle(self, request: Request, chat: bool) -> Any:
        request_id = self._request_id(request, "chatcmpl" if chat else "cmpl")
        created = int(time.time())
        body = await _parse_body(request, ChatCompletionRequest if chat else CompletionRequest)
        gen_request = await self._prepare(request, body, request_id)
        iterator, first = await self._start(request, gen_request)
        headers = response_headers(request)
        if body.stream:
            events = self._events(iterator, first, body, gen_request, created, chat)
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return _ClosingStreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            text, finish_reason, usage = await self._collect(iterator, first, gen_request)
        finally:
            await _aclose(iterator)
        if chat:
            response: Any = ChatCompletionResponse(
                id=request_id,
                created=created,
                model=body.model,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)],
                usage=usage,
            )
        else:
            response = CompletionResponse(
                id=request_id,
                created=created,
                model=body.model,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
                usage=usage,
            )
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    @staticmethod
    def _usage(chunk: TokenChunk, gen_request: GenerateRequest, completion_tokens: int) -> UsageInfo:
        if chunk.usage is not None:
            return UsageInfo.of(chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.cached_tokens)
        return UsageInfo.of(gen_request.prompt_len, completion_tokens)

    async def _collect(
        self, iterator: Any, first: TokenChunk, gen_request: GenerateRequest
    ) -> tuple[str, str, UsageInfo]:
        pieces: list[str] = []
        completion_tokens = 0
        chunk = first
        while True:
            failure = _chunk_failure(chunk)
            if failure is not None:
                raise failure
            pieces.append(chunk.text)
            completion_tokens += len(chunk.token_ids)
            if chunk.finished:
                return "".join(pieces), str(chunk.finish_reason), self._usage(chunk, gen_request, completion_tokens)
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                raise OpenAIError(
                    500, "The backend ended the request without a finish reason", type="server_error", code="truncated"
                ) from None

    async def _events(
        self,
        iterator: Any,
        first: TokenChunk,
        body: CompletionRequest | ChatCompletionRequest,
        gen_request: GenerateRequest,
        created: int,
        chat: bool,
    ) -> AsyncIterator[str]:
        include_usage = body.include_usage
        rid, model = gen_request.request_id, body.model

        def chat_event(delta: DeltaMessage, finish_reason: str | None = None) -> str:
            chunk = ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
            )
            return _sse(chunk_dict(chunk, include_usage))

        def text_event(text: str, finish_reason: str | None = None) -> str:
            chunk = CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
            )
            return _sse(chunk_dict(chunk, include_usage))

        try:
            completion_tokens = 0
            chunk = first
            if chat:
                yield chat_event(DeltaMessage(role="assistant", content=""))
            while True:
                failure = _chunk_failure(chunk)
                if failure is not None:
                    yield _sse(failure.body())
                    break
                completion_tokens += len(chunk.token_ids)
                if chat:
                    if chunk.text:
                        yield chat_event(DeltaMessage(content=chunk.text))
                    if chunk.finished:
                        yield chat_event(DeltaMessage(), chunk.finish_reason)
                elif chunk.text or chunk.finished:
                    yield text_event(chunk.text, chunk.finish_reason)
                if chunk.finished:
                    if include_usage:
                        usage = self._usage(chunk, gen_request, completion_tokens)
                        final: Any
                        if chat:
                            final = ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage)
                        else:
                            final = CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage)
                        yield _sse(chunk_dict(final, include_usage))
                    break
                try:
                    chunk = await iterator.__anext__()
                except StopAsyncIteration:
                    error = OpenAIError(
                        500,
                        "The backend ended the request without a finish reason",
                        type="server_error",
                        code="truncated",
                    )
                    yield _sse(error.body())
                    break
                except OpenAIError as exc:
                    yield _sse(exc.body())
                    break
                except Exception:
                    logger.exception("backend stream of %s failed", rid)
                    error = OpenAIError(
                        500,
                        f"The server had an error while processing your request (request id {rid})",
                        type="server_error",
                        code="internal_error",
                    )
                    yield _sse(error.body())
                    break
            yield _sse("[DONE]")
        finally:
            await _aclose(iterator)

    # -- other routes -----------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.backend.model_name, max_model_len=self.backend.max_model_len)])


def create_app(backend: Backend) -> FastAPI:
    """The OpenAI-compatible FastAPI app over ``backend``.

    Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
    GET /v1/models, GET /v1/models/{model}, GET /health (200
    ``{"status": "ok"}`` or 503), GET /v1/capacity (the replicas' capacity
    snapshots as a JSON list). Every error is an OpenAI-style body
    (:func:`ferrox.cluster.errors.install_error_handlers`); completion
    responses carry ``x-request-id`` and ``x-ferrox-replica``.
    """
    frontend = _Frontend(backend)
    app = FastAPI(title="ferrox", description="OpenAI-compatible LLM serving", version="0.1.0")
    app.state.backend = backend
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await frontend.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await frontend.handle(request, chat=True)

    @app.get("/v1/models")
    async def list_models() -> Any:
        return JSONResponse(frontend.models().model_dump(mode="json"))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Any:
        frontend._check_model(model)
        return JSONResponse(frontend.models().data[0].model_dump(mode="json"))

    @app.get("/health")
    async def health() -> Any:
        try:
            ok = bool(await backend.healthy())
        except Exception:
            logger.warning("health check failed", exc_info=True)
            ok = False
        if not ok:
            raise OpenAIError(503, "The model backend is not healthy", type="server_error", code="unhealthy")
        return {"status": "ok"}

    @app.get("/v1/capacity")
    async def capacity() -> Any:
        snapshots = await backend.capacity()
        return JSONResponse([s.to_dict() if hasattr(s, "to_dict") else dict(s) for s in snapshots])

    return app


__all__ = ["Backend", "create_app", "REQUEST_ID_HEADER", "REPLICA_HEADER"]
