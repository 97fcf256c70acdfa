"""The data that crosses the replica boundary: sampling parameters in, token chunks out.

Decided here: the exact fields of a generate request's sampling parameters
and of each streamed :class:`TokenChunk`, as DESIGN.md's contracts name them,
and the validation rules every entry point shares (offline engine, Serve
replica, HTTP ingress). Validation raises ``ValueError`` whose message names
the field and the limit, so the ingress can turn it into an OpenAI-style 400
without re-deriving the rule.

Deliberately not here: anything torch, ray or HTTP. These are plain
dataclasses so they pickle cheaply across Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReasonStr = Literal["stop", "length", "abort"]

#: Temperatures below this sample greedily (as vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Semantics follow the OpenAI API (temperature, top_p, presence/frequency
    penalties, stop) and vLLM's extensions (top_k, min_p,
    repetition_penalty, stop_token_ids, ignore_eos).

    - ``temperature``: >= 0; 0 means greedy (argmax).
    - ``top_p``: in (0, 1]. ``top_k``: -1 or 0 (off) or >= 1. ``min_p``: in [0, 1].
    - ``presence_penalty`` / ``frequency_penalty``: in [-2, 2], applied to
      tokens already *generated* (OpenAI's definition).
    - ``repetition_penalty``: > 0, 1 is off; divides positive logits and
      multiplies negative ones of tokens in prompt or output (CTRL, Keskar
      et al. 2019, as implemented by transformers and vLLM).
    - ``seed``: per-request generator seed; the same seed gives the same
      tokens whatever else shares the batch.
    - ``max_tokens``: >= 1, the output budget reserved at admission.
    - ``stop``: strings; the matched stop string is not returned.
    - ``stop_token_ids``: token ids that end generation (not returned as text).
    - ``ignore_eos``: keep generating past the model's EOS token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's sampling epsilon) dividing logits by the
        # temperature overflows float32 into NaN; such a request means greedy.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its limit if any value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if len(self.stop) > 16:
            raise ValueError(f"stop may hold at most 16 strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True)
class Usage:
    """Token counts of one request, as OpenAI's ``usage`` reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenChunk:
    """One piece of a request's output stream (replica -> ingress).

    ``token_ids``: the new token ids of this chunk (may be empty on the last
    chunk). ``text``: the new text, already cut of any stop string and of any
    held-back partial stop match. ``finish_reason`` and ``usage`` are set on
    the last chunk only. ``error`` carries a message when the replica failed
    the request (finish_reason is then "abort").
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReasonStr | None = None
    usage: Usage | None = None
    error: str | None = None
    replica: str | None = None
    #: HTTP status the ingress should answer with when ``error`` is set before
    #: any token was produced (400 for a request that can never run, 503 for a
    #: full queue); ``None`` means a server-side failure (500).
    error_status: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerateRequest:
    """What the ingress sends a replica (DESIGN.md: "Generate request").

    ``prompt_token_ids``: the tokenized prompt (chat template applied).
    ``prefix_hashes``: chained hashes of the prompt's full pages
    (:func:`ferrox.scheduler.radix.page_hashes` at the cluster's page size),
    read by the router for prefix affinity; the replica ignores them.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool = True
    prefix_hashes: tuple[int, ...] = ()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class CapacitySnapshot:
    """A replica's free capacity, as the router reads it (DESIGN.md: "Capacity snapshot").

    Stale by design: the router adds what it routed since ``seq``.
    All token figures are counts of KV token positions (not bytes).

    - ``kv_tokens_available``: free + evictable pages, in tokens, minus what
      running and waiting requests have reserved or will reserve
      (their remaining prompt + output budgets). May be negative when the
      queue already over-subscribes the pool.
    - ``kv_tokens_total``: the whole full-attention pool.
    - ``swa_tokens_available`` / ``recurrent_slots_available``: ``None`` for a
      model without that pool.
    - ``prefix_digest``: chained page hashes of the prefix pages the replica's
      prefix cache holds (most recently used first, bounded in length).
    - ``decode_tokens_per_s``: recent measured output rate, for wait estimates.
    """

    replica_id: str
    seq: int
    timestamp: float
    model: str
    free_slots: int
    max_slots: int
    kv_tokens_available: int
    kv_tokens_total: int
    swa_tokens_available: int | None
    recurrent_slots_available: int | None
    waiting_requests: int
    waiting_tokens: int
    running_requests: int
    page_size: int
    max_model_len: int
    prefix_digest: tuple[int, ...] = ()
    decode_tokens_per_s: float = 0.0
    healthy: bool = True

    def to_dict(self) -> dict:
        from dataclasses import asdict

        out = asdict(self)
        out["prefix_digest"] = list(self.prefix_digest)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CapacitySnapshot":
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["prefix_digest"] = tuple(fields.get("prefix_digest", ()))
        return cls(**fields)
