"""The OpenAI wire format ferrox speaks: request and response models for /v1/completions,
/v1/chat/completions and /v1/models.

Decided here:

- Which request fields are accepted, their ranges, and how they map onto
  :class:`ferrox.replicas.types.SamplingParams` (``to_sampling_params``).
  Ranges follow the OpenAI API reference (temperature in [0, 2], penalties in
  [-2, 2]) and vLLM's extensions (top_k, min_p, repetition_penalty,
  ignore_eos, stop_token_ids); ``stop`` may hold up to 16 strings (OpenAI
  allows 4; the engine handles 16 at no extra cost).
- Which OpenAI features are refused rather than silently ignored: ``n`` > 1,
  tools / tool_choice / functions / function_call, logprobs / top_logprobs,
  response_format other than text, logit_bias, and for completions echo,
  best_of > 1, suffix and batched prompts. Each is refused by a field
  validator, so the pydantic error's ``loc`` is the field and the HTTP layer
  can name it as the OpenAI error's ``param``. The "off" value of each
  (``n=1``, ``tools=[]``, ``tool_choice="none"``, ``logprobs=false``, ...) is
  accepted, because SDKs and proxies send those.
- Request fields are strictly typed (``strict=True`` on every request
  model), as OpenAI checks them: ``"max_tokens": "4"``, ``"max_tokens": true``,
  ``"max_tokens": 4.0`` and ``"stream": "yes"`` are refused naming the
  field, where pydantic's default would coerce them. An integer is still a
  number (``"temperature": 1`` is accepted).
- That every string in a request body must be valid Unicode
  (:func:`lone_surrogate`): JSON may spell a lone UTF-16 surrogate
  (``"\\ud800"``), which Python decodes into a ``str`` that no tokenizer
  or response encoder accepts. The whole parsed body is checked, keys and
  values, fields ferrox reads and fields it ignores, before validation, so
  the refusal names the field wherever it is.
- Unknown fields are ignored (``extra="ignore"``): the OpenAI SDK and
  clients built for newer API versions send fields we have no use for
  (``user``, ``store``, ``metadata``, ...), and refusing them would break
  those clients for no gain.
- Response and stream-chunk shapes, field for field as OpenAI returns them,
  with ``usage.prompt_tokens_details.cached_tokens`` carrying prefix-cache hits.

Deliberately not here: tokenization, the chat template, the context-length
check (they need the tokenizer and the model's limits: see
:mod:`ferrox.cluster.openai_app`), and anything about HTTP status codes
(:mod:`ferrox.cluster.errors`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ferrox.replicas.types import SamplingParams

MAX_STOP_STRINGS = 16
"""``stop`` holds at most this many strings (SamplingParams enforces the same limit)."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's accepted range


def _unsupported(field: str, detail: str) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_parameter",
        "'{field}' is not supported by this server: {detail}",
        {"field": field, "detail": detail},
    )


# --------------------------------------------------------------------------- requests

_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def lone_surrogate(data: Any) -> tuple[str | None, bool] | None:
    """Where parsed JSON holds a string UTF-8 cannot encode (a lone surrogate), if anywhere.

    Returns ``(path, is_key)`` for the first such string in document order:
    ``path`` is the dotted path of the value (``"messages.0.content"``) or,
    for an object key, of the object holding it (``None`` for the body
    itself); ``None`` when every string is valid. Iterative, so it accepts
    whatever depth the JSON parser accepted.
    """
    # Paths are linked (key, parent) pairs, joined only for the string found:
    # constant work per node however deep the body nests.
    Link = tuple[str, Any] | None

    def dotted(link: Link) -> str | None:
        keys: list[str] = []
        while link is not None:
            keys.append(link[0])
            link = link[1]
        return ".".join(reversed(keys)) or None

    stack: list[tuple[Any, Link]] = [(data, None)]
    while stack:
        value, link = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return dotted(link), False
        elif isinstance(value, dict):
            children = []
            for key, child in value.items():
                if _has_surrogate(key):
                    return dotted(link), True
                if isinstance(child, (str, dict, list)):
                    children.append((child, (key, link)))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            items = [(child, (str(i), link)) for i, child in enumerate(value) if isinstance(child, (str, dict, list))]
            stack.extend(reversed(items))
    return None


_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints. Field order matters: validators read earlier fields."""

    model_config = _REQUEST_CONFIG

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise PydanticCustomError(
                "stream_options_without_stream",
                "'stream_options' is only allowed when 'stream' is true",
            )
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if value is not None and not isinstance(value, list):
            raise PydanticCustomError("stop_type", "'stop' must be a string or a list of strings")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "too_many_stop_strings",
                "'stop' may hold at most {limit} strings, got {count}",
                {"limit": MAX_STOP_STRINGS, "count": len(value)},
            )
        if any(s == "" for s in value):
            raise PydanticCustomError("empty_stop_string", "'stop' strings must be non-empty")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported("n", f"only n=1 is supported, got n={value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias", "logit biases are not applied")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise PydanticCustomError("negative_token_id", "'stop_token_ids' must be non-negative token ids")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        """The output budget the client asked for, or ``None`` when it left it to the server."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The request field that carried the output budget (for error messages)."""
        return "max_tokens"

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters for this request.

        ``default_max_tokens`` (>= 1) is used when the request gave no
        output budget; the caller derives it from the context left
        (see :mod:`ferrox.cluster.openai_app`). Unset OpenAI fields take
        OpenAI's defaults (temperature 1, top_p 1, no penalties).
        Raises ``ValueError`` (from :meth:`SamplingParams.validate`) naming
        the field if a value is out of the engine's range.
        """
        max_tokens = self.requested_max_tokens
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat. ``content`` is a string or a list of text parts.

    ``developer`` is OpenAI's newer name for ``system`` (its API reference:
    "developer messages replace system messages" for newer models); chat
    templates know only ``system``, so it is rendered as one."""

    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Checked by hand so that a wrong part yields one error at
        # messages.<i>.content instead of one per union member.
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError(
                "content_type", "'content' must be a string or a list of text parts"
            )
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "only content parts of type 'text' are supported, got '{kind}'",
                    {"kind": kind},
                )
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("content_part_text", "a text content part needs a string 'text'")
        return value

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM does)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = _REQUEST_CONFIG

    type: str


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("logprobs", "log probabilities are not returned")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("top_logprobs", "log probabilities are not returned")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None and value.type != "text":
            raise _unsupported("response_format", f"only type 'text' is supported, got {value.type!r}")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None, info: Any) -> list[Any] | None:
        if value:
            raise _unsupported(info.field_name, "tool and function calling are not supported")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any, info: Any) -> Any:
        if value is not None and value != "none":
            raise _unsupported(info.field_name, "tool and function calling are not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: ``[{"role", "content": str}]``."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    """POST /v1/completions.

    ``prompt`` is a string, a list of token ids, or a one-element list of
    either; after validation it is a ``str`` or a ``list[int]``.
    """

    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        # Checked by hand so that a bad prompt yields one error at 'prompt'
        # instead of one per union member.
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) != 1:
                raise _unsupported("prompt", f"one prompt per request, got a batch of {len(value)}")
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
        raise PydanticCustomError(
            "prompt_type", "'prompt' must be a string, a list of token ids, or a list of one of those"
        )

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise _unsupported("echo", "the prompt is not echoed back")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise _unsupported("logprobs", "log probabilities are not returned")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported("best_of", f"only best_of=1 is supported, got best_of={value}")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix", "insertion (suffix) is not supported")
        return value


# -------------------------------------------------------------------------- responses


FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed /v1/completions response; also each streamed chunk
    (OpenAI uses ``object: "text_completion"`` for both; chunks carry
    ``usage`` only on the final include_usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


CompletionStreamChunk = CompletionResponse


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A chat stream delta; ``None`` fields are left out on the wire (OpenAI sends ``{}`` on the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


def chunk_dict(chunk: ChatCompletionChunk | CompletionResponse, include_usage: bool) -> dict[str, Any]:
    """A stream chunk as its JSON object: ``usage`` present (null until the last chunk)
    only when the client asked for it, and chat deltas without their unset fields."""
    data = chunk.model_dump(mode="json")
    if not include_usage and data.get("usage") is None:
        data.pop("usage", None)
    for choice in data["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "ferrox"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
