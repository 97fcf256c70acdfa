"""The OpenAI-compatible HTTP application, independent of Ray.

Decided here, for /v1/completions and /v1/chat/completions:

- The order of checks, cheapest first, each failing with an OpenAI-style
  error: the body's size (413 ``request_too_large`` past
  ``max_request_bytes``, from ``Content-Length`` before reading and from
  the bytes read), JSON, valid Unicode in every string (400 naming the
  field, :func:`ferrox.cluster.protocol.lone_surrogate`) and field
  validation (400, :mod:`ferrox.cluster.protocol`), the model name (404),
  the chat template, a lower bound on the prompt's tokens (below), the
  tokenization, an empty prompt (400), token ids outside the vocabulary
  (400), and the length check (400) of prompt + output budget against both
  the model's context (``max_model_len``) and the largest replica's KV pool
  (``max_seatable_tokens``), the message giving both numbers as vLLM and
  OpenAI do. A request that fails any of these never reaches a replica.
- Tokenization is serialized (one tokenizer, one lock), so a prompt that
  takes seconds to tokenize would hold up every other request. Before
  tokenizing, a text's token count is bounded from below by
  ``ceil(chars / L)``, ``L`` the longest vocabulary entry in characters
  (computed once per tokenizer, :func:`_longest_token`), ``chars`` the
  text's length after the tokenizer's normalizer; when that bound already
  fails the length check the request is refused with the same message
  saying "at least N tokens", untokenized. The bound is exact only where
  each token covers at most ``L`` characters of the normalized text, so it
  is used only for fast BPE tokenizers that are byte-level or byte-fallback
  (no unknown-character token that swallows a run of text), whose
  pre-tokenizer drops no text and whose added tokens strip no whitespace
  (byte-level BPE as in GPT-2, Llama 3, Qwen and SmolLM2 qualifies); with
  other tokenizers every prompt is tokenized. A prompt under the bound is
  still tokenized under the lock, however long: the body limit is what
  keeps that wait finite. The chat template is rendered outside the lock
  (it needs no tokenizer state) and its text tokenized as
  ``apply_chat_template(tokenize=True)`` would (``add_special_tokens=False``).
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
- That a cancelled request (:func:`ferrox.cluster.errors.is_cancellation`:
  the client went away and Serve cancelled the calls made for it) is
  logged at INFO without a traceback and answered 499, or ends a stream
  with an error event; never logged as an unhandled error.
- HEAD is answered wherever GET is (/health, /v1/models), as load
  balancers' health probes use it.

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
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ferrox.cluster.errors import (
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    OpenAIError,
    cancelled_error,
    error_response,
    install_error_handlers,
    is_cancellation,
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
    lone_surrogate,
)
from ferrox.replicas.types import GenerateRequest, SamplingParams, TokenChunk
from ferrox.scheduler.radix import page_hashes

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

_CLIENT_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""The request body limit when none is given (``IngressArgs.max_request_bytes``'s default)."""


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


def _too_large(limit: int, size: int | None) -> OpenAIError:
    told = f"is {size} bytes" if size is not None else "is larger than that"
    return OpenAIError(
        413,
        f"This server accepts request bodies of at most {limit} bytes; yours {told}",
        code="request_too_large",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes: by its
    ``Content-Length`` before reading, and by the bytes read (a chunked body
    or a wrong header)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)


def _unicode_error(data: Any) -> OpenAIError | None:
    """The 400 for a string in the parsed body that is not valid Unicode, if there is one."""
    found = lone_surrogate(data)
    if found is None:
        return None
    path, is_key = found
    where = f"'{path}'" if path is not None else "the request body"
    if is_key:
        message = f"A key in {where} contains a lone UTF-16 surrogate and is not valid Unicode"
    else:
        message = f"Invalid value for {where}: the string contains a lone UTF-16 surrogate and is not valid Unicode"
    return OpenAIError(400, message, param=path, code="invalid_unicode")


async def _parse_body(request: Request, model: type[Any], limit: int) -> Any:
    """The request body validated as ``model``; too large -> 413, malformed JSON,
    invalid Unicode and invalid fields -> 400.

    The body is parsed whatever its content-type (``curl -d`` sends
    form-urlencoded), and NaN / Infinity are refused as the JSON spec does.
    """
    raw = await _read_body(request, limit)
    if not raw.strip():
        raise OpenAIError(400, "The request body is missing; send a JSON object", code="missing_body")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise OpenAIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    unicode_error = _unicode_error(data)
    if unicode_error is not None:
        raise unicode_error
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


# Pre-tokenizer parts that drop text (so a token could stand for more characters than it has).
_DROPPING_PRE_TOKENIZERS = ('"Whitespace"', '"WhitespaceSplit"', '"BertPreTokenizer"', '"CharDelimiterSplit"',
                            '"Removed"')
_LONGEST_TOKEN: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()


def _longest_token(tokenizer: Any) -> int | None:
    """The longest vocabulary entry in characters, or ``None`` where ``ceil(chars / L)``
    is not a sure lower bound on the token count (see the module docstring).

    Vocabulary entries are measured as stored (byte-level BPE: one character
    per byte, SentencePiece: ``▁`` per space), which is never less than their
    decoded length. Cached per tokenizer.
    """
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    longest: int | None = None
    try:
        backend = tokenizer.backend_tokenizer
        model = backend.model
        pre = backend.pre_tokenizer.__getstate__().decode() if backend.pre_tokenizer is not None else "null"
        usable = (
            type(model).__name__ == "BPE"
            and ('"ByteLevel"' in pre or bool(model.byte_fallback))
            and not any(part in pre for part in _DROPPING_PRE_TOKENIZERS)
            and not any(t.lstrip or t.rstrip for t in tokenizer.added_tokens_decoder.values())
        )
        if usable:
            longest = max((len(token) for token in tokenizer.get_vocab()), default=0) or None
    except Exception:  # a slow or unusual tokenizer: no bound, tokenize as before
        logger.debug("no token-count lower bound for this tokenizer", exc_info=True)
        longest = None
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


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


def _for_method(request: Request, response: Response) -> Response:
    """``response``, without its body for a HEAD request (status and headers, the
    GET body's ``content-length`` included, are kept: RFC 9110 section 9.3.2)."""
    if request.method != "HEAD":
        return response
    return Response(status_code=response.status_code, headers=dict(response.headers))


# ------------------------------------------------------------------------ the app


class _Frontend:
    """The request handling behind the routes; one per app."""

    def __init__(self, backend: Backend, max_request_bytes: int) -> None:
        self.backend = backend
        self.max_request_bytes = max_request_bytes
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

    def _min_tokens(self, text: str) -> int | None:
        """A sure lower bound on ``text``'s token count, or ``None`` (see the module docstring)."""
        tokenizer = self.backend.tokenizer
        longest = _longest_token(tokenizer)
        if longest is None:
            return None
        normalizer = tokenizer.backend_tokenizer.normalizer
        if normalizer is not None:
            with self._tokenizer_lock:
                text = normalizer.normalize_str(text)
        return -(-len(text) // longest)

    def _encode(self, text: str, check: Callable[[int], None], chat: bool) -> list[int]:
        """``text``'s token ids, after ``check`` (raising) passed its lower bound.

        Chat text is an already rendered template, so no special tokens are
        added (as ``apply_chat_template(tokenize=True)`` does); a completion
        prompt gets the tokenizer's default special tokens (a BOS where the
        model wants one, none for SmolLM2).
        """
        bound = self._min_tokens(text)
        if bound is not None:
            check(bound)
        with self._tokenizer_lock:
            if chat:
                return _token_list(self.backend.tokenizer(text, add_special_tokens=False))
            return _token_list(self.backend.tokenizer(text))

    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        try:
            rendered = self.backend.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateError as exc:
            # The template's raise_exception (e.g. "roles must alternate") is the client's problem.
            raise OpenAIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
        return str(rendered)

    def _encode_chat(self, messages: list[dict[str, str]], check: Callable[[int], None]) -> list[int]:
        return self._encode(self._render_chat(messages), check, chat=True)

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

    def _output_budget(
        self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int, where: str, at_least: bool = False
    ) -> int:
        """The request's max_tokens after the context and KV-pool checks (see module docstring).

        ``at_least``: ``prompt_len`` is a lower bound, not the count, and the
        messages say so ("at least N tokens").
        """
        context = self.backend.max_model_len
        seatable = self.backend.max_seatable_tokens()
        requested = body.requested_max_tokens
        least = "at least " if at_least else ""
        if requested is not None:
            total = prompt_len + requested
            param = where if prompt_len >= context else body.max_tokens_param
            if total > context:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{least}{total} tokens ({least}{prompt_len} in the {where}, {requested} in the completion). "
                    f"Please reduce the length of the {where} or completion.",
                    param=param,
                    code="context_length_exceeded",
                )
            if total > seatable:
                raise OpenAIError(
                    400,
                    f"This server's largest KV cache holds {seatable} tokens. However, you requested "
                    f"{least}{total} tokens ({least}{prompt_len} in the {where}, {requested} in the completion). "
                    f"Please reduce the length of the {where} or completion.",
                    param=where if prompt_len >= seatable else body.max_tokens_param,
                    code="context_length_exceeded",
                )
            return requested
        if prompt_len >= context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {context} tokens. However, your {where} "
                f"resulted in {least}{prompt_len} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {where}.",
                param=where,
                code="context_length_exceeded",
            )
        if prompt_len >= seatable:
            raise OpenAIError(
                400,
                f"This server's largest KV cache holds {seatable} tokens. However, your {where} "
                f"resulted in {least}{prompt_len} tokens, which leaves no room for a completion. "
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
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"

        def check(bound: int) -> None:
            self._output_budget(body, bound, where, at_least=True)

        if isinstance(body, ChatCompletionRequest):
            token_ids = await run_in_threadpool(self._encode_chat, body.chat_messages(), check)
        elif isinstance(body.prompt, str):
            token_ids = await run_in_threadpool(self._encode, body.prompt, check, False) if body.prompt else []
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
        try:
            return await self._handle(request, request_id, chat)
        except Exception as exc:
            # Ray's cancellations are Exceptions (some also asyncio.CancelledError):
            # Starlette would log them as unhandled errors with a traceback.
            if not is_cancellation(exc):
                raise
            logger.info("request %s was cancelled (the client went away): %s", request_id, type(exc).__name__)
            raise cancelled_error() from None

    async def _handle(self, request: Request, request_id: str, chat: bool) -> Any:
        created = int(time.time())
        body = await _parse_body(request, ChatCompletionRequest if chat else CompletionRequest, self.max_request_bytes)
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
                except Exception as exc:
                    if is_cancellation(exc):
                        logger.info("request %s was cancelled mid-stream (the client went away): %s",
                                    rid, type(exc).__name__)
                        yield _sse(cancelled_error().body())
                        break
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


def create_app(backend: Backend, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible FastAPI app over ``backend``.

    Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
    GET|HEAD /v1/models, GET|HEAD /v1/models/{model}, GET|HEAD /health (200
    ``{"status": "ok"}`` or 503), GET /v1/capacity (the replicas' capacity
    snapshots as a JSON list). Every error is an OpenAI-style body
    (:func:`ferrox.cluster.errors.install_error_handlers`); completion
    responses carry ``x-request-id`` and ``x-ferrox-replica``. Request
    bodies over ``max_request_bytes`` get 413.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
    frontend = _Frontend(backend, max_request_bytes)
    app = FastAPI(title="ferrox", description="OpenAI-compatible LLM serving", version="0.1.0")
    app.state.backend = backend
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await frontend.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await frontend.handle(request, chat=True)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(request: Request) -> Any:
        return _for_method(request, JSONResponse(frontend.models().model_dump(mode="json")))

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def retrieve_model(request: Request, model: str) -> Any:
        try:
            frontend._check_model(model)
        except OpenAIError as exc:
            return _for_method(request, error_response(request, exc))
        return _for_method(request, JSONResponse(frontend.models().data[0].model_dump(mode="json")))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Any:
        try:
            ok = bool(await backend.healthy())
        except Exception:
            logger.warning("health check failed", exc_info=True)
            ok = False
        if not ok:
            error = OpenAIError(503, "The model backend is not healthy", type="server_error", code="unhealthy")
            return _for_method(request, error_response(request, error))
        return _for_method(request, JSONResponse({"status": "ok"}))

    @app.get("/v1/capacity")
    async def capacity() -> Any:
        snapshots = await backend.capacity()
        return JSONResponse([s.to_dict() if hasattr(s, "to_dict") else dict(s) for s in snapshots])

    return app


__all__ = ["Backend", "create_app", "DEFAULT_MAX_REQUEST_BYTES", "REQUEST_ID_HEADER", "REPLICA_HEADER"]
