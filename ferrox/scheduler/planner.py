"""The step planner: what one engine step runs, decided from measured capacity.

Decided here, on top of the seed's admission rules (``admission.py``):

- The waiting queue is FIFO; a prompt being prefilled in chunks stays at the
  head until its last chunk runs. Admission is strict head-of-line: the
  first prompt that does not fit ends the pass, and the reason is reported.
- **Prefill first**: a step is a prefill step if any chunk can run,
  otherwise a decode step of every running request (uid order), otherwise
  idle. Prefill and decode never share a step.
- The seed leaves it to its caller to charge each admission's request slot,
  recurrent slots and page rounding against the capacity the next admission
  in the same pass reads. The planner does: after each admission the pass
  sees one slot fewer, three recurrent slots fewer, the tokens of the
  matched prefix it just locked (no longer evictable), and the rounding of
  the reservation up to whole pages (pages are allocated whole; the seed's
  own check compares tokens). The matched prefix is also taken out of the
  capacity the prompt's *own* check reads: the measured ``kv_tokens``
  counts it as evictable, but once locked it is no room for the prompt
  that locked it (SGLang checks with the node locked for the same reason).
- Reservations between steps: the decode set's remaining output plus a page
  each (the seed's ``inflight_tokens``), plus, for each prompt still being
  chunked, its remaining prompt and whole output budget plus a page.
- Window models: on top of the seed's start-of-window check, an admitted
  request reserves the most window-pool tokens it can ever hold at once,
  ``min(ceil_page(prompt + output), ceil_page(window) + 2 pages + ceil_page(chunk budget))``
  (the window, the page being written, the page about to slide out, and
  one chunk), so a window request never finds the window pool full
  mid-generation either. A prefix hit's cached window pages count as held
  against that reservation (what it locks leaves the evictable room by as
  much as its outstanding need shrinks), and its recurrent snapshot, like
  its full pages, is evictable room until the admission locks it, so no
  room for the prompt that locks it; a hit whose snapshot the request
  cannot afford to lock beside its own three slots is declined (the
  request runs uncached) rather than left to wait for room only it holds.
- Requests that can never run -- prompt + output beyond the context length,
  beyond the whole KV pool, beyond the window or recurrent pool -- are
  refused at arrival with the numbers, never left waiting forever.
- Deterministic: no clocks, no randomness, dict order only where insertion
  order is itself deterministic. The same arrival trace gives byte-identical
  plans.

Deliberately not here: pages and prefix trees (``kv.py`` owns them and
measures the :class:`Capacity` passed in), tensors, and any notion of time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Union

from .admission import (
    RECURRENT_SLOTS_PER_REQUEST,
    AdmittedChunk,
    Capacity,
    ChunkState,
    DecodeSet,
    DecodingRequest,
    Geometry,
    NotAdmitted,
    PendingRequest,
    PrefillPass,
    SlotTable,
    align_ceil,
)


class RequestRefused(ValueError):
    """A request that can never be served by this replica, refused at arrival.

    ``reason`` is one of ``"empty_prompt"``, ``"bad_max_tokens"``,
    ``"context_length"``, ``"kv_pool"``, ``"window_pool"``,
    ``"recurrent_pool"``, ``"queue_full"``, ``"duplicate"``; ``limit`` and
    ``requested`` are the two numbers the message quotes (tokens, or
    requests for ``queue_full``).
    """

    def __init__(self, reason: str, message: str, *, requested: int = 0, limit: int = 0):
        super().__init__(message)
        self.reason = reason
        self.requested = requested
        self.limit = limit


@dataclass(frozen=True)
class PrefixHit:
    """What the prefix cache holds for a waiting prompt, as the planner reads it.

    ``cached_len``: tokens (whole pages) already computed.
    ``evictable_len``: the part of them currently unlocked, which the
    measured ``kv_tokens`` counts as evictable and which stops being so once
    the admission locks it. ``swa_evictable_len`` (window-pool tokens) and
    ``recurrent_evictable`` (recurrent slots): the same for the cached
    window pages and snapshots of the matched path.
    """

    cached_len: int = 0
    evictable_len: int = 0
    swa_evictable_len: int = 0
    recurrent_evictable: int = 0


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class PrefillStep:
    """Run these chunks. ``blocked``: why the pass stopped before the queue
    emptied (``None`` when every waiting prompt got a chunk)."""

    chunks: tuple[AdmittedChunk, ...]
    blocked: NotAdmitted | None = None

    kind = "prefill"


@dataclass(frozen=True)
class DecodeStep:
    """Decode one token for each of ``uids`` (uid order). ``blocked``: why no
    prefill ran although prompts were waiting (``None`` if none were).

    Uids only, not the seed's per-request :class:`DecodingRequest`: building
    one object per running request per step was most of a decode step's
    planning time (:meth:`DecodeSet.next_batch` still gives them)."""

    uids: tuple[int, ...]
    blocked: NotAdmitted | None = None

    kind = "decode"


@dataclass(frozen=True)
class IdleStep:
    """Nothing can run. ``blocked`` is why the head of the queue waits, if any does."""

    blocked: NotAdmitted | None = None

    kind = "idle"


Step = Union[PrefillStep, DecodeStep, IdleStep]


@dataclass
class _Prefilling:
    request: PendingRequest
    #: While it is being chunked: its share of :meth:`StepPlanner.inflight_tokens`.
    reserved: int = 0


class StepPlanner:
    """The engine-facing scheduler: waiting queue, decode set and slot table.

    Parameters (all tokens unless stated):
        geometry: page size, sliding window, recurrent.
        max_slots: request slots (concurrency limit).
        max_prefill_tokens: prefill token budget of one step (chunk size);
            at least one page for a window model (``ValueError`` otherwise).
        max_model_len: context length; prompt + output beyond it is refused.
        kv_pool_tokens: the whole full-attention pool (pages * page_size).
        swa_pool_tokens: the whole window pool (window models).
        recurrent_pool_slots: the whole recurrent-state pool (recurrent models).
        max_waiting: requests allowed to wait before arrivals are refused
            with ``queue_full`` (``None``: unbounded).
    """

    def __init__(
        self,
        geometry: Geometry,
        max_slots: int,
        max_prefill_tokens: int,
        max_model_len: int,
        kv_pool_tokens: int,
        swa_pool_tokens: int = 0,
        recurrent_pool_slots: int = 0,
        max_waiting: int | None = None,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if geometry.sliding_window is not None and max_prefill_tokens < geometry.page_size:
            # A window model's continuation must end on a page boundary; a
            # budget short of one page could never run one, and the prompt
            # would hold its slot forever.
            raise ValueError(
                f"a window model's max_prefill_tokens must be at least one page "
                f"({geometry.page_size} tokens), got {max_prefill_tokens}"
            )
        self.geometry = geometry
        self.slots = SlotTable(max_slots)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.kv_pool_tokens = kv_pool_tokens
        self.swa_pool_tokens = swa_pool_tokens
        self.recurrent_pool_slots = recurrent_pool_slots
        self.max_waiting = max_waiting
        self.decode = DecodeSet()
        self._waiting: deque[_Prefilling] = deque()
        self._entries: dict[int, _Prefilling] = {}  # the waiting queue, by uid
        self._num_new = 0  # waiting entries not yet admitted
        self._chunk_reserved = 0  # sum of the chunked entries' ``reserved``
        self._known: set[int] = set()
        self._slot_of: dict[int, int] = {}
        self._window_reserve: dict[int, int] = {}
        self._output_len: dict[int, int] = {}
        self._waiting_tokens = 0

    # ------------------------------------------------------------ arrivals
    def window_reserve(self, prompt_len: int, output_len: int) -> int:
        """Window-pool tokens a request may hold at once (see module docstring)."""
        window = self.geometry.sliding_window
        if window is None:
            return 0
        p = self.geometry.page_size
        bound = align_ceil(window, p) + 2 * p + align_ceil(self.max_prefill_tokens, p)
        return min(align_ceil(prompt_len + output_len, p), bound)

    def add_request(self, uid: int, prompt_len: int, output_len: int) -> None:
        """Queue a request, or raise :class:`RequestRefused` if it can never run."""
        if uid in self._known:
            raise RequestRefused("duplicate", f"request {uid} is already queued or running")
        if prompt_len < 1:
            raise RequestRefused("empty_prompt", "the prompt must hold at least one token")
        if output_len < 1:
            raise RequestRefused(
                "bad_max_tokens", f"max_tokens must be at least 1, got {output_len}", requested=output_len, limit=1
            )
        total = prompt_len + output_len
        if total > self.max_model_len:
            raise RequestRefused(
                "context_length",
                f"prompt ({prompt_len} tokens) + max_tokens ({output_len}) = {total} tokens "
                f"exceeds the context length of {self.max_model_len} tokens",
                requested=total,
                limit=self.max_model_len,
            )
        if align_ceil(total, self.geometry.page_size) > self.kv_pool_tokens:
            raise RequestRefused(
                "kv_pool",
                f"prompt ({prompt_len} tokens) + max_tokens ({output_len}) = {total} tokens "
                f"can never fit this replica's KV pool of {self.kv_pool_tokens} tokens",
                requested=total,
                limit=self.kv_pool_tokens,
            )
        if self.geometry.sliding_window is not None:
            need = self.window_reserve(prompt_len, output_len)
            if need > self.swa_pool_tokens:
                raise RequestRefused(
                    "window_pool",
                    f"the request needs {need} window-pool tokens; the pool holds {self.swa_pool_tokens}",
                    requested=need,
                    limit=self.swa_pool_tokens,
                )
        if self.geometry.recurrent and self.recurrent_pool_slots < RECURRENT_SLOTS_PER_REQUEST:
            raise RequestRefused(
                "recurrent_pool",
                f"a request needs {RECURRENT_SLOTS_PER_REQUEST} recurrent slots; "
                f"the pool holds {self.recurrent_pool_slots}",
                requested=RECURRENT_SLOTS_PER_REQUEST,
                limit=self.recurrent_pool_slots,
            )
        if self.max_waiting is not None and self.num_waiting_new >= self.max_waiting:
            raise RequestRefused(
                "queue_full",
                f"{self.num_waiting_new} requests are already waiting (limit {self.max_waiting})",
                requested=self.num_waiting_new + 1,
                limit=self.max_waiting,
            )
        self._known.add(uid)
        self._output_len[uid] = output_len
        entry = _Prefilling(PendingRequest(uid, prompt_len, output_len))
        self._waiting.append(entry)
        self._entries[uid] = entry
        self._num_new += 1
        self._waiting_tokens += total

    # ------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        """Prompts not yet fully prefilled (chunked ones included)."""
        return len(self._waiting)

    @property
    def num_waiting_new(self) -> int:
        """Prompts not yet admitted."""
        return self._num_new

    @property
    def waiting_tokens(self) -> int:
        """Prompt + output tokens of the prompts not yet admitted."""
        return self._waiting_tokens

    @property
    def num_running(self) -> int:
        """Requests holding a slot (prefilling in chunks or decoding)."""
        return len(self._slot_of)

    def slot_of(self, uid: int) -> int | None:
        return self._slot_of.get(uid)

    def is_known(self, uid: int) -> bool:
        return uid in self._known

    def inflight_tokens(self) -> int:
        """KV tokens the admitted requests may still consume (see module docstring)."""
        return self.decode.inflight_tokens(self.geometry.page_size) + self._chunk_reserved

    def window_reserved(self, exclude: int | None = None) -> int:
        """Window-pool tokens reserved by admitted requests (optionally but one)."""
        return sum(v for uid, v in self._window_reserve.items() if uid != exclude)

    def pending_kv_tokens(self) -> int:
        """What the unadmitted queue will reserve when admitted (no prefix hits assumed)."""
        return self._waiting_tokens

    # ---------------------------------------------------------------- plan
    def plan(
        self,
        capacity: Capacity,
        match: Callable[[int], PrefixHit] = lambda uid: NO_HIT,
        window_held: Callable[[int], int] = lambda uid: 0,
    ) -> Step:
        """Decide this step, and move the planner's state past it.

        ``capacity`` is measured by the caller: ``kv_tokens`` = free +
        evictable pages in tokens; ``swa_tokens`` = free window-pool tokens;
        ``recurrent_slots`` = free recurrent slots; ``request_slots`` is
        read from the planner's own slot table. ``match(uid)`` gives a
        waiting prompt's prefix hit; ``window_held(uid)`` the window-pool
        tokens an admitted request holds now.

        After a prefill step, chunked prompts stay at the queue's head with
        their progress, and finished prompts join the decode set with their
        output budget less the token the prefill samples. After a decode
        step, each request's remaining budget is one less; a request whose
        budget is spent leaves and its slot is freed.
        """
        step = self._plan_prefill(capacity, match, window_held)
        if isinstance(step, PrefillStep):
            return step
        blocked = step
        if self.decode.runnable:
            batch, spent = self.decode.advance()
            for uid in spent:
                self._release(uid)
            return DecodeStep(batch, blocked)
        return IdleStep(blocked)

    def _plan_prefill(self, capacity: Capacity, match, window_held) -> PrefillStep | NotAdmitted | None:
        if not self._waiting:
            return None
        g = self.geometry
        p = g.page_size
        windowed = g.sliding_window is not None
        cap = replace(capacity, request_slots=self.slots.available)
        swa_free = capacity.swa_tokens
        # Future window needs of admitted requests, net of what they hold:
        # measured (one call per running request) only once a window
        # decision needs it.
        outstanding: dict[int, int] | None = None
        swa_outstanding = 0
        pass_ = PrefillPass(self.max_prefill_tokens, self.inflight_tokens(), g)
        chunks: list[AdmittedChunk] = []
        blocked: NotAdmitted | None = None
        new_reserve = 0
        for entry in self._waiting:
            request = entry.request
            if request.chunk is None:
                if cap.request_slots == 0:
                    # The seed's first and cheapest answer, given before the
                    # prefix match it would make pointless.
                    blocked = NotAdmitted.NO_REQUEST_SLOT
                    break
                hit = match(request.uid) if request.prompt_len > p else NO_HIT
                cached = hit.cached_len
                if windowed:
                    if outstanding is None:
                        outstanding = self._window_outstanding(window_held)
                        swa_outstanding = sum(outstanding.values())
                    # A hit's cached window pages it locks leave the evictable
                    # room and count as held against its reservation: no
                    # change to what the reservation may take.
                    swa_avail = swa_free - swa_outstanding - new_reserve
                    cap = replace(cap, swa_tokens=max(swa_avail, 0))
                # The prompt's own matched prefix is in the measured kv_tokens
                # (and its snapshot in recurrent_slots) as evictable until this
                # admission locks it: it is no room for the prompt itself.
                seat = cap
                if hit.evictable_len or hit.recurrent_evictable:
                    seat = replace(
                        cap,
                        kv_tokens=cap.kv_tokens - hit.evictable_len,
                        recurrent_slots=cap.recurrent_slots - hit.recurrent_evictable,
                    )
                refusal = pass_.check_admission(request, cached, seat)
                if refusal is NotAdmitted.RECURRENT_BUDGET and hit.recurrent_evictable:
                    # Locking the hit's snapshot would take a slot the request
                    # itself needs (a small pool): run it uncached instead
                    # of waiting for room that only its own hit holds.
                    hit, cached = NO_HIT, 0
                    refusal = pass_.check_admission(request, 0, cap)
                if refusal is None and windowed:
                    reserve = self.window_reserve(request.prompt_len, request.output_len)
                    if reserve > swa_avail - pass_.reserved_swa:
                        refusal = NotAdmitted.WINDOW_BUDGET
                if refusal is not None:
                    blocked = refusal
                    break
                slot = self.slots.allocate()
                if slot is None:  # pragma: no cover - check_admission saw the same table
                    blocked = NotAdmitted.NO_REQUEST_SLOT
                    break
                # A window prompt's own first chunk comes out of the
                # reservation just checked, which ``cap`` still holds.
                result = pass_.take_chunk(request, cached, slot, cap)
                if isinstance(result, NotAdmitted):
                    self.slots.free(slot)
                    blocked = result
                    break
                estimated = request.prompt_len - cached + request.output_len
                rounding = align_ceil(estimated, p) - estimated
                cap = replace(
                    cap,
                    request_slots=cap.request_slots - 1,
                    kv_tokens=cap.kv_tokens - hit.evictable_len - rounding,
                    recurrent_slots=cap.recurrent_slots
                    - hit.recurrent_evictable
                    - (RECURRENT_SLOTS_PER_REQUEST if g.recurrent else 0),
                )

                self._slot_of[request.uid] = slot
                self._waiting_tokens -= request.prompt_len + request.output_len
                self._num_new -= 1
                if windowed:
                    reserve = self.window_reserve(request.prompt_len, request.output_len)
                    self._window_reserve[request.uid] = reserve
                    new_reserve += reserve
            else:
                if windowed:
                    if outstanding is None:
                        outstanding = self._window_outstanding(window_held)
                        swa_outstanding = sum(outstanding.values())
                    own = outstanding.get(request.uid, 0)
                    cap = replace(cap, swa_tokens=max(swa_free - (swa_outstanding - own) - new_reserve, 0))
                result = pass_.take_chunk(request, 0, request.chunk.slot, cap)
                if isinstance(result, NotAdmitted):
                    blocked = result
                    break
            chunks.append(result)
            if pass_.token_budget == 0:
                break
        if not chunks:
            return blocked
        if blocked is None and len(chunks) < len(self._waiting):
            blocked = NotAdmitted.BUDGET_SPENT
        self._advance(chunks)
        return PrefillStep(tuple(chunks), blocked)

    def _window_outstanding(self, window_held: Callable[[int], int]) -> dict[int, int]:
        return {uid: max(res - window_held(uid), 0) for uid, res in self._window_reserve.items()}

    def _advance(self, chunks: list[AdmittedChunk]) -> None:
        """Move the queue past a prefill step. The pass took its chunks from
        the head of the queue, in order, so only that many entries are
        touched; the ones still being chunked go back to the head."""
        p = self.geometry.page_size
        window = self.geometry.sliding_window
        kept: list[_Prefilling] = []
        finished: list[DecodingRequest] = []
        for chunk in chunks:
            entry = self._waiting.popleft()
            request = entry.request
            assert request.uid == chunk.uid
            self._chunk_reserved -= entry.reserved
            end = chunk.computed_len + chunk.chunk_len
            if chunk.chunked:
                old = request.chunk
                evicted = 0
                if window is not None:
                    evicted = max((end - (window + p)) // p * p, 0)
                    if old is not None:
                        evicted = max(evicted, old.swa_evicted_len)
                state = ChunkState(
                    computed_len=end,
                    slot=chunk.slot,
                    swa_evicted_len=evicted,
                    locked_prefix_len=old.locked_prefix_len if old else chunk.computed_len,
                )
                entry.request = replace(request, chunk=state)
                # The rest of the prompt, the whole output, and a page.
                entry.reserved = (request.prompt_len - end) + request.output_len + (p - 1)
                self._chunk_reserved += entry.reserved
                kept.append(entry)
            else:
                del self._entries[request.uid]
                remaining = request.output_len - 1
                if remaining > 0:
                    finished.append(DecodingRequest(request.uid, remaining))
                else:
                    self._release(request.uid)
        self._waiting.extendleft(reversed(kept))
        self.decode.admit(finished)

    # ------------------------------------------------------------ endings
    def _release(self, uid: int) -> None:
        slot = self._slot_of.pop(uid, None)
        if slot is not None:
            self.slots.free(slot)
        self._window_reserve.pop(uid, None)
        self._output_len.pop(uid, None)
        self._known.discard(uid)

    def finish(self, uid: int) -> bool:
        """A request stopped early (EOS, stop string): free its slot. Returns
        whether it was still known (a request whose budget ran out was
        already released by :meth:`plan`)."""
        if uid not in self._known:
            return False
        self.decode.remove(uid)
        entry = self._entries.pop(uid, None)
        if entry is not None:
            self._remove_waiting(entry)
        self._release(uid)
        return True

    def abort(self, uid: int) -> bool:
        """Drop a request at any stage, returning its slot and reservations.
        Returns whether it was known. (Pages and locks are the KV manager's.)"""
        return self.finish(uid)

    def _remove_waiting(self, entry: _Prefilling) -> None:
        self._waiting.remove(entry)
        self._chunk_reserved -= entry.reserved
        if entry.request.chunk is None:
            self._num_new -= 1
            self._waiting_tokens -= entry.request.prompt_len + entry.request.output_len

    def waiting_uids(self) -> list[int]:
        return [w.request.uid for w in self._waiting]

    def pending(self, uid: int) -> PendingRequest | None:
        entry = self._entries.get(uid)
        return None if entry is None else entry.request
