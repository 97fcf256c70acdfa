"""Incremental detokenization, stop handling and the finish reason of one request.

Decided here: which of the tokens the engine sampled a request accepts, which
text may be streamed to the client after each step, and whether (and why) the
request is finished. Each appended token is processed in order:

1. It is counted as generated (it was sampled and it used budget).
2. A token in ``stop_token_ids``, or an EOS token unless ``ignore_eos``, ends
   the request with "stop"; its text is never produced.
3. Otherwise its text is decoded incrementally (below) and the new text is
   searched for the stop strings. A match ends the request with "stop"; the
   text from the start of the match onward is cut (OpenAI semantics: the stop
   string is not returned).
4. When the output budget (``max_tokens``) is reached the request ends with
   "length", unless the same token also stopped it: the precedence rule is
   :func:`ferrox.scheduler.admission.finish_reason`'s, not re-derived here.

Tokens after the one that finished the request are dropped: they are neither
counted nor turned into text (the engine may hand over more than one token per
step, e.g. when it drains a multi-token step).

Incremental text uses the prefix/read-offset method (as in Hugging Face's
TextStreamer and vLLM): the text of a token is the decode of a short window
of ids minus the decode of the window without it, so tokenizers whose decode
depends on context (leading-space stripping, byte-level merges) come out the
same as a one-shot decode. While the window's decode ends in U+FFFD, a
multi-byte UTF-8 character is split across tokens and nothing is emitted until
a later token completes it. The window starts in the last few prompt tokens so
that the first output token is decoded in context too.

Stop strings can span tokens, so any tail of the text that is a prefix of some
stop string is held back: it is emitted once a later token shows it is not a
stop, or when the request ends by length (it never became a stop), and never
if it turns into a stop.

Deliberately not done here:
- A UTF-8 sequence still incomplete when the request finishes is dropped,
  never emitted as U+FFFD (its token ids are still reported); vLLM does the
  same.
- No sampling, no abort handling (an abort is the engine's decision) and no
  usage accounting beyond ``num_output_tokens``.
- Special tokens are always skipped in the text; there is no option to keep
  them, because the OpenAI API has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ferrox.replicas.types import SamplingParams
from ferrox.scheduler.admission import FinishReason, finish_reason

# How many prompt tokens before the first output token the decode window starts
# with; enough for a multi-token character or a context-dependent leading space.
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerOutput:
    """What one :meth:`IncrementalDetokenizer.append` call produced.

    - ``token_ids``: the accepted new token ids, in order. A stop token or EOS
      that ended the request is included (it was generated); tokens after the
      one that finished the request are not.
    - ``text``: new text that is safe to send to the client now.
    - ``finish_reason``: ``FinishReason.STOP`` / ``FinishReason.LENGTH`` when
      this call finished the request, else ``None``.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


def _decode_function(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """Return ``ids -> text`` that skips special tokens and does no clean-up.

    A ``transformers`` fast tokenizer is decoded through its underlying
    ``tokenizers.Tokenizer`` (``backend_tokenizer``): the wrapper's
    ``clean_up_tokenization_spaces`` rewrites text by context (" ." -> "."),
    which would break the rule that a window's decode extends its prefix's.
    Anything else must offer ``decode(ids, skip_special_tokens=True)``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    target = backend if backend is not None else tokenizer
    decode = getattr(target, "decode", None)
    if decode is None:
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no decode method")

    def run(ids: Sequence[int]) -> str:
        return decode(list(ids), skip_special_tokens=True)

    return run


class IncrementalDetokenizer:
    """Turns one request's sampled token ids into streamable text and a finish reason.

    ``tokenizer``: a ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``.
    ``prompt_token_ids``: the request's prompt (only its last few ids are used,
    as decode context). ``eos_token_ids``: the model's end-of-sequence ids
    (ignored as stops when ``params.ignore_eos``).

    Calling :meth:`append` after the request finished raises ``RuntimeError``:
    the engine must stop stepping a finished request.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
    ) -> None:
        self._decode = _decode_function(tokenizer)
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self._stops = tuple(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # Decode window: a few prompt ids for context, then the output ids that
        # produce text. [_prefix_offset, _read_offset) is the part already turned
        # into text; ids from _read_offset on await a complete character.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._window_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context) if context else ""

        self._text = ""  # all decoded output text, held-back tail included
        self._emitted = 0  # how many chars of _text were returned
        self._num_output_tokens = 0
        self._finish_reason: FinishReason | None = None

    @property
    def output_text(self) -> str:
        """All text returned so far by :meth:`append` (concatenated)."""
        return self._text[: self._emitted]

    @property
    def num_output_tokens(self) -> int:
        """Tokens accepted as generated so far, the finishing stop/EOS token included."""
        return self._num_output_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the request finished, or ``None`` while it runs."""
        return self._finish_reason

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    def append(self, new_token_ids: Sequence[int]) -> DetokenizerOutput:
        """Accept newly sampled tokens, in order; return their text and any finish reason.

        Raises ``RuntimeError`` if the request already finished.
        """
        if self._finish_reason is not None:
            raise RuntimeError(
                f"request already finished ({self._finish_reason.value}); no more tokens accepted"
            )
        accepted: list[int] = []
        start = self._emitted
        for token_id in new_token_ids:
            token_id = int(token_id)
            accepted.append(token_id)
            self._num_output_tokens += 1
            hit_stop_token = token_id in self._stop_ids
            matched_stop = False
            if not hit_stop_token:
                matched_stop = self._push_text(token_id)
            budget_exhausted = self._num_output_tokens >= self._params.max_tokens
            reason = finish_reason(
                hit_eos=hit_stop_token,
                matched_stop=matched_stop,
                budget_exhausted=budget_exhausted,
            )
            if reason is not None:
                self._finish(reason)
                break
        if self._finish_reason is None:
            self._release_safe_text()
        return DetokenizerOutput(
            token_ids=accepted,
            text=self._text[start : self._emitted],
            finish_reason=self._finish_reason,
        )

    def _push_text(self, token_id: int) -> bool:
        """Decode one more token into ``_text``; True if a stop string completed.

        On a match ``_text`` is cut at the match's start.
        """
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            # A special token (no text) or an incomplete UTF-8 sequence: wait.
            return False
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._window_ids[self._read_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        # Keep the window short: nothing before _prefix_offset is decoded again.
        if self._prefix_offset > 0:
            del self._window_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

        old_len = len(self._text)
        self._text += new_text
        if not self._stops:
            return False
        # A new match must end inside the new text; earlier ends were searched
        # by earlier tokens. The earliest-starting match wins.
        first = -1
        for stop in self._stops:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (first == -1 or index < first):
                first = index
        if first == -1:
            return False
        self._text = self._text[:first]
        return True

    def _release_safe_text(self) -> None:
        """Advance ``_emitted`` to the end of the text minus any partial stop-string match."""
        held = 0
        tail_len = min(self._max_stop_len - 1, len(self._text) - self._emitted)
        for size in range(tail_len, 0, -1):
            tail = self._text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                held = size
                break
        self._emitted = max(self._emitted, len(self._text) - held)

    def _finish(self, reason: FinishReason) -> None:
        # A stop string already cut _text at the match, so whatever is left,
        # held-back partial matches included, is real text; by length a held
        # partial match never became a stop, so it is flushed too.
        self._finish_reason = reason
        self._emitted = len(self._text)
