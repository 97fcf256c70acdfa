"""Admission and chunked prefill: which requests run this step, and how much of each prompt.

Everything here is arithmetic over capacities the caller measures. Nothing
allocates, nothing runs a forward pass. That is deliberate: the failure this
module exists to prevent -- admitting a request the machine cannot finish --
is an arithmetic failure, and it is much easier to be sure about arithmetic
that can be run without a GPU.

Ported from the seed, ``ferrox-server``'s ``admission.rs`` (itself ported 1:1
from FreeToken's ``scheduler/prefill.py``, ``decode.py``, ``table.py`` and
``status.py``, Apache-2.0), with the same semantics, names (snake_case),
reasons and tests. Its manner is kept:

Prefill first, and no skipping ahead
    A step runs prefill if any prompt can be admitted, otherwise decode.
    Admission is strict FIFO with **head-of-line blocking**: the first request
    that does not fit stops the pass, even if a smaller one behind it would
    have fit. Skipping ahead is a fairness decision made by memory pressure
    rather than by policy, and its victim is always the largest request --
    the one already waiting longest, which can then be starved indefinitely
    by a stream of small ones. Blocking makes the queue's order mean what it
    says.

What a chunk reserves
    Admitting a prompt reserves the KV for its **whole remaining prompt plus
    its whole output budget**, not for the chunk being run. A chunked prompt
    whose later chunks have nowhere to go is worse than one that never
    started: it holds a request slot and a locked prefix while making no
    progress. So the reservation is taken once, at admission, against the
    worst case. Continuations then bypass the gate entirely -- the memory was
    already reserved, and re-checking could refuse a request that is
    half-computed.

Deliberately not here: charging one admission's request slot and recurrent
slots against the capacity the *next* admission in the same pass reads. The
seed leaves that to its caller; :class:`ferrox.scheduler.planner.StepPlanner`
does it. Also not here: page allocation (``pages.py``) and prefix matching
(``radix.py``).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field, replace
from typing import Iterable


def align_ceil(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (``alignment`` >= 1)."""
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    """Round ``value`` down to a multiple of ``alignment`` (``alignment`` >= 1)."""
    return (value // alignment) * alignment


def _div_ceil(value: int, divisor: int) -> int:
    return -(-value // divisor)


class SlotTable:
    """Request slots: the fixed set of rows the engine's page table has.

    The count is the real concurrency limit, independent of memory -- a row is
    a fixed-width allocation made once at startup.
    """

    __slots__ = ("_free", "_capacity", "_held")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"slot table capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._free: list[int] = list(range(capacity))
        self._held: set[int] = set()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """Take a slot, or ``None`` when all are held.

        Last-in-first-out, so a burst of requests reuses the same few rows and
        leaves the rest of the page table cold.
        """
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``. Raises ``ValueError`` on a double free or an unknown slot."""
        if slot not in self._held:
            raise ValueError(f"slot {slot} was freed twice (or never allocated)")
        self._held.remove(slot)
        self._free.append(slot)

    def rebuild(self, capacity: int) -> None:
        """Resize. Only legal while idle: a live request holds indices into the
        page table this is about to replace. Raises ``RuntimeError`` otherwise."""
        if len(self._free) != self._capacity:
            raise RuntimeError("a slot table may only be rebuilt while idle")
        self._capacity = capacity
        self._free = list(range(capacity))
        self._held = set()


@dataclass(frozen=True)
class DecodingRequest:
    """One request that is decoding."""

    uid: int
    #: Tokens it may still produce.
    remaining: int


class DecodeSet:
    """The set of requests currently decoding.

    Every runnable request decodes every step -- there is no admission
    decision here, because concurrency is already bounded by the slot table.
    Batches come out sorted by uid so a replayed trace produces byte-identical
    batches.

    Kept as the decode step at which each request's budget runs out rather
    than as a count per request, so that a step of the whole set
    (:meth:`advance`) costs the requests it ends, not the requests it runs:
    the engine plans under a lock its forward pass waits on.
    """

    __slots__ = ("_end", "_ending", "_ticks", "_end_sum", "_uids", "_batch")

    def __init__(self) -> None:
        #: uid -> the value of ``_ticks`` at which its budget is spent.
        self._end: dict[int, int] = {}
        #: tick -> the uids whose budget is spent at that tick.
        self._ending: dict[int, set[int]] = {}
        #: Decode steps taken by :meth:`advance`.
        self._ticks = 0
        self._end_sum = 0
        self._uids: list[int] = []  # sorted
        self._batch: tuple[int, ...] | None = ()

    def __len__(self) -> int:
        return len(self._end)

    def __contains__(self, uid: int) -> bool:
        return uid in self._end

    def is_empty(self) -> bool:
        return not self._end

    @property
    def runnable(self) -> bool:
        return bool(self._end)

    def get(self, uid: int) -> DecodingRequest | None:
        end = self._end.get(uid)
        return None if end is None else DecodingRequest(uid, end - self._ticks)

    def admit(self, requests: Iterable[DecodingRequest]) -> None:
        """Add newly-prefilled requests (or update existing ones) and drop the finished ones."""
        for request in requests:
            self._drop(request.uid)
            if request.remaining > 0:
                end = self._ticks + request.remaining
                self._end[request.uid] = end
                self._ending.setdefault(end, set()).add(request.uid)
                self._end_sum += end
                bisect.insort(self._uids, request.uid)
                self._batch = None

    def remove(self, uid: int) -> DecodingRequest | None:
        end = self._drop(uid)
        return None if end is None else DecodingRequest(uid, end - self._ticks)

    def _drop(self, uid: int) -> int | None:
        end = self._end.pop(uid, None)
        if end is not None:
            bucket = self._ending[end]
            bucket.discard(uid)
            if not bucket:
                del self._ending[end]
            self._end_sum -= end
            del self._uids[bisect.bisect_left(self._uids, uid)]
            self._batch = None
        return end

    def inflight_tokens(self, page_size: int) -> int:
        """KV the running set will still consume before it drains.

        The ``page_size - 1`` per request is not slack: a request's next token
        may land in a fresh page, and a page is allocated whole. A budget that
        ignores it admits a prompt that then cannot get its last page.
        """
        n = len(self._end)
        return self._end_sum - n * self._ticks + (page_size - 1) * n

    def uids(self) -> tuple[int, ...]:
        """The running uids, in uid order."""
        if self._batch is None:
            self._batch = tuple(self._uids)
        return self._batch

    def next_batch(self) -> list[DecodingRequest]:
        """This step's decode batch, in uid order."""
        ticks = self._ticks
        return [DecodingRequest(uid, self._end[uid] - ticks) for uid in self.uids()]

    def advance(self) -> tuple[tuple[int, ...], list[int]]:
        """Decode one token for every running request.

        Returns the batch (uids, uid order) and the uids whose budget this
        token spent (uid order); those have left the set.
        """
        batch = self.uids()
        self._ticks += 1
        ended = self._ending.pop(self._ticks, None)
        if not ended:
            return batch, []
        done = sorted(ended)
        for uid in done:
            del self._end[uid]
            del self._uids[bisect.bisect_left(self._uids, uid)]
        self._end_sum -= self._ticks * len(done)
        self._batch = None
        return batch, done


@dataclass(frozen=True)
class ChunkState:
    """Where a chunked prefill has got to."""

    #: Tokens of this prompt already computed.
    computed_len: int
    #: The request slot it holds.
    slot: int
    #: How far the request has let its own window state slide out.
    swa_evicted_len: int = 0
    #: The prefix length the tree owns, which the request may never free.
    locked_prefix_len: int = 0


@dataclass(frozen=True)
class PendingRequest:
    """A prompt waiting to be prefilled."""

    uid: int
    prompt_len: int
    #: The output budget, reserved at admission along with the prompt.
    output_len: int
    #: Set once the request has been admitted and is being prefilled in chunks.
    chunk: ChunkState | None = None

    @property
    def is_continuation(self) -> bool:
        return self.chunk is not None


@dataclass(frozen=True)
class Capacity:
    """The capacities an admission decision reads, all measured by the caller."""

    #: Free request slots.
    request_slots: int = 0
    #: KV tokens available: free plus evictable.
    kv_tokens: int = 0
    #: Window-pool tokens available, for window models.
    swa_tokens: int = 0
    #: Free recurrent-state slots, for hybrid models.
    recurrent_slots: int = 0


@dataclass(frozen=True)
class Geometry:
    """The model's shape, as far as admission cares."""

    page_size: int = 1
    #: ``None`` for a model with no window pool.
    sliding_window: int | None = None
    #: Whether the model has a recurrent-state pool that admission must reserve slots in.
    recurrent: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


#: A recurrent model needs three slots per admitted request: the live state,
#: and two the snapshot ping-pongs between.
RECURRENT_SLOTS_PER_REQUEST = 3


class NotAdmitted(enum.Enum):
    """Why a prompt was not admitted this pass."""

    #: No free request slot.
    NO_REQUEST_SLOT = "no_request_slot"
    #: The KV it would reserve does not fit alongside what is already running.
    KV_BUDGET = "kv_budget"
    #: The window pool cannot seat it.
    WINDOW_BUDGET = "window_budget"
    #: The recurrent pool cannot seat it.
    RECURRENT_BUDGET = "recurrent_budget"
    #: Its next chunk cannot reach a page boundary, so there is nothing useful to run this pass.
    NO_WHOLE_PAGE = "no_whole_page"
    #: The pass has no token budget left.
    BUDGET_SPENT = "budget_spent"


@dataclass(frozen=True)
class PromptAdmission:
    """What a prompt cost, reported once."""

    uid: int
    #: The complete prompt, not this chunk.
    prompt_tokens: int
    #: How much of it the prefix cache already had.
    cached_tokens: int


@dataclass(frozen=True)
class AdmittedChunk:
    """A chunk this pass will run."""

    uid: int
    slot: int
    #: Prompt tokens already computed before this chunk.
    computed_len: int
    #: Tokens this chunk computes.
    chunk_len: int
    #: Whether more chunks follow.
    chunked: bool
    #: Set on a prompt's **first** chunk only: what to report as its prompt
    #: size and prefix hit. Reporting it per chunk would count one prompt
    #: several times.
    admission: PromptAdmission | None = None


class PrefillPass:
    """One prefill pass's running state.

    The reservations accumulate across the pass, so the second prompt admitted
    is checked against a budget the first one has already spent.
    """

    __slots__ = ("_token_budget", "_reserved_tokens", "_reserved_swa", "_geometry")

    def __init__(self, token_budget: int, inflight_tokens: int, geometry: Geometry) -> None:
        """Start a pass with ``token_budget`` tokens of prefill to spend, on top
        of what the decoding set will still consume (``inflight_tokens``)."""
        self._token_budget = token_budget
        self._reserved_tokens = inflight_tokens
        self._reserved_swa = 0
        self._geometry = geometry

    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def reserved_tokens(self) -> int:
        return self._reserved_tokens

    @property
    def reserved_swa(self) -> int:
        return self._reserved_swa

    def check_admission(
        self, request: PendingRequest, cached_len: int, capacity: Capacity
    ) -> NotAdmitted | None:
        """Can this prompt be seated at all? ``None`` means yes.

        Checked before anything is locked or allocated, and in this order,
        because each answer is cheaper than the next and a refusal must leave
        no trace.
        """
        if capacity.request_slots == 0:
            return NotAdmitted.NO_REQUEST_SLOT
        extend_len = max(request.prompt_len - cached_len, 0)
        # The whole remaining prompt AND the whole output budget: a request
        # that runs out of KV mid-generation has to be dropped after doing all
        # the work.
        estimated = extend_len + request.output_len
        if estimated + self._reserved_tokens > capacity.kv_tokens:
            return NotAdmitted.KV_BUDGET
        if self._geometry.recurrent and capacity.recurrent_slots < RECURRENT_SLOTS_PER_REQUEST:
            return NotAdmitted.RECURRENT_BUDGET
        window = self._geometry.sliding_window
        if window is not None:
            # One whole page beyond the window's first token: enough to start,
            # since the window slides as the request decodes.
            need = align_ceil(min(max(extend_len, 1), window) + 1, self._geometry.page_size)
            if max(capacity.swa_tokens - self._reserved_swa, 0) < need:
                return NotAdmitted.WINDOW_BUDGET
        return None

    def take_chunk(
        self, request: PendingRequest, cached_len: int, slot: int, capacity: Capacity
    ) -> AdmittedChunk | NotAdmitted:
        """Size the chunk this pass will run for ``request``, charging the
        pass's budgets for it.

        Call after :meth:`check_admission` for a new prompt, or directly for a
        continuation.
        """
        if self._token_budget == 0:
            return NotAdmitted.BUDGET_SPENT
        computed_len = request.chunk.computed_len if request.chunk is not None else cached_len
        remaining = max(request.prompt_len - computed_len, 0)
        chunk_len = min(self._token_budget, remaining)

        window = self._geometry.sliding_window
        if window is not None:
            bounded = self._window_bounded_chunk(request, computed_len, chunk_len, window, capacity)
            if isinstance(bounded, NotAdmitted):
                return bounded
            chunk_len = bounded
        if chunk_len == 0:
            return NotAdmitted.NO_WHOLE_PAGE

        chunked = chunk_len < remaining
        self._token_budget -= chunk_len
        # Charged once, on the first chunk: the whole remaining prompt and the
        # whole output budget.
        first = request.chunk is None
        if first:
            self._reserved_tokens += remaining + request.output_len
        return AdmittedChunk(
            uid=request.uid,
            slot=slot,
            computed_len=computed_len,
            chunk_len=chunk_len,
            chunked=chunked,
            admission=PromptAdmission(request.uid, request.prompt_len, cached_len) if first else None,
        )

    def _window_bounded_chunk(
        self,
        request: PendingRequest,
        computed_len: int,
        chunk_len: int,
        window: int,
        capacity: Capacity,
    ) -> int | NotAdmitted:
        """A window model's chunk is bounded by how much window state the pool
        can seat, and a continuation must end on a page boundary.

        The page rule is what makes the window pool's accounting tractable:
        window slots are charged per whole page, so a chunk that stops
        mid-page charges a page for tokens the next chunk then charges again.
        """
        page = self._geometry.page_size
        chunk = request.chunk or ChunkState(computed_len=computed_len, slot=0)
        # What this request can free for itself as its own window slides past
        # what it has already computed. That memory is not in `capacity`, but
        # it is genuinely available to this request.
        newly_evicted = align_down(max(computed_len - (window + page), 0), page)
        already_gone = max(chunk.swa_evicted_len, chunk.locked_prefix_len)
        self_reclaim = max(newly_evicted - already_gone, 0)

        budget = max(capacity.swa_tokens + self_reclaim - self._reserved_swa, 0)
        max_end = (_div_ceil(computed_len, page) + budget // page) * page
        bounded = min(chunk_len, max(max_end - computed_len, 0))

        remaining = max(request.prompt_len - computed_len, 0)
        if 0 < bounded < remaining:
            aligned = max(align_down(computed_len + bounded, page) - computed_len, 0)
            if aligned == 0:
                # Not even one whole page fits this pass. Running a partial
                # page would charge the pool for it twice.
                return NotAdmitted.NO_WHOLE_PAGE
            bounded = aligned
        self._reserved_swa += (
            _div_ceil(computed_len + bounded, page) - _div_ceil(computed_len, page)
        ) * page
        return bounded


class FinishReason(str, enum.Enum):
    """Why a generation stopped."""

    #: The model ended its own turn, or produced a stop string.
    STOP = "stop"
    #: The output budget ran out.
    LENGTH = "length"

    def as_str(self) -> str:
        return self.value


def finish_reason(hit_eos: bool, matched_stop: bool, budget_exhausted: bool) -> FinishReason | None:
    """Decide why a step ended, if it did.

    The precedence matters: a model that emits its end-of-turn token *as* its
    last budgeted token finished on its own terms, and reporting ``length``
    there would tell a client to ask for a continuation of a complete answer.
    """
    if hit_eos or matched_stop:
        return FinishReason.STOP
    if budget_exhausted:
        return FinishReason.LENGTH
    return None
