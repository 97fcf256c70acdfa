"""The scheduler a replica's engine drives: planner + memory bookkeeping + token ids.

Decided here: the one sequence of calls that turns a plan into page tables,
shared by the engine (``ferrox.replicas.engine``) and the trace simulator
(``simulator.py``), so the simulator exercises exactly the code that serves:

1. measure :class:`Capacity` from the :class:`KVManager`;
2. ask the :class:`StepPlanner` for a step;
3. for a prefill step, lock every new prompt's prefix first, then allocate
   every chunk's pages; for a decode step, allocate one more position each;
4. hand the engine :class:`ScheduledStep` -- per sequence its query tokens,
   positions already computed, page table and whether it samples;
5. after the forward pass, :meth:`Scheduler.commit` appends the sampled
   tokens and releases the requests that ended (budget, EOS or stop string),
   their full pages going to the prefix cache.

Prefix caching covers window and recurrent models too (``kv.py`` says
what a usable prefix is). The scheduler's part for a recurrent model:
a hit's first step carries ``restore_slot`` (copy that cached snapshot into
the live slot before running), and a step that crosses one of the request's
snapshot boundaries carries ``snapshots`` (``(query offset, slot)``: store
the state after that many of the step's query tokens in that slot);
:meth:`Scheduler.commit` records what was stored, and the finished request
hands those snapshots to the cache with its pages.

Deliberately not done: snapshots at every page boundary (see ``kv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

from .admission import Geometry, NotAdmitted
from .kv import KVManager, RequestMemory
from .planner import DecodeStep, IdleStep, PrefillStep, RequestRefused, StepPlanner


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes of one replica's scheduler (tokens unless stated)."""

    page_size: int
    num_pages: int
    max_slots: int
    max_prefill_tokens: int
    max_model_len: int
    sliding_window: int | None = None
    num_swa_pages: int = 0
    recurrent: bool = False
    num_recurrent_slots: int = 0
    enable_prefix_caching: bool = True
    max_waiting: int | None = None

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.page_size, self.sliding_window if self.num_swa_pages else None, self.recurrent)


class ScheduledSeq(NamedTuple):
    """One sequence of a step.

    ``query_tokens`` are computed this step at positions
    ``computed_len .. computed_len + len(query_tokens) - 1``; ``pages`` is
    its full page table (covering every position through the last query
    token); ``samples``: whether its last position's logits are sampled.

    A named tuple rather than a frozen dataclass: as immutable, but built
    ten times faster, and a decode step builds one per running request while
    the forward pass waits.
    """

    uid: int
    slot: int
    computed_len: int
    query_tokens: tuple[int, ...]
    pages: tuple[int, ...]
    samples: bool
    swa_pages: tuple[int, ...] = ()
    swa_start: int = 0
    recurrent_slots: tuple[int, ...] = ()
    #: Set on a prompt's first chunk: (prompt tokens, cached tokens).
    admission: tuple[int, int] | None = None
    #: Recurrent models: the cached snapshot slot to copy into the live slot
    #: before this step (a prefix hit's first chunk), else -1.
    restore_slot: int = -1
    #: Recurrent models: ``(offset, slot)`` pairs, store the state after the
    #: first ``offset`` query tokens of this step in ``slot``
    #: (``1 <= offset <= len(query_tokens)``).
    snapshots: tuple[tuple[int, int], ...] = ()

    @property
    def seq_len(self) -> int:
        return self.computed_len + len(self.query_tokens)


@dataclass(frozen=True)
class ScheduledStep:
    kind: str  # "prefill" | "decode"
    seqs: tuple[ScheduledSeq, ...]
    blocked: NotAdmitted | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.query_tokens) for s in self.seqs)


@dataclass
class _Req:
    uid: int
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    outputs: int = 0
    cached_len: int = 0
    #: Positions whose KV a committed step has written.
    computed: int = 0
    prefilled: bool = False
    slot: int = -1
    mem: RequestMemory | None = None
    #: Recurrent snapshots stored by committed steps: slot -> boundary.
    snapshots: dict[int, int] = field(default_factory=dict)


class Scheduler:
    """Planner and memory of one replica, over token ids.

    Raises :class:`RequestRefused` from :meth:`add_request` for a request that
    can never run here.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        windowed = config.sliding_window is not None and config.num_swa_pages > 0
        caching = config.enable_prefix_caching
        # Recurrent snapshots exist only to be cached.
        self._snapshotting = caching and config.recurrent and config.num_recurrent_slots > 0
        self.kv = KVManager(
            config.page_size,
            config.num_pages,
            num_swa_pages=config.num_swa_pages if windowed else 0,
            sliding_window=config.sliding_window if windowed else None,
            num_recurrent_slots=config.num_recurrent_slots if config.recurrent else 0,
            enable_prefix_caching=caching,
        )
        self.planner = StepPlanner(
            config.geometry,
            max_slots=config.max_slots,
            max_prefill_tokens=config.max_prefill_tokens,
            max_model_len=config.max_model_len,
            kv_pool_tokens=config.num_pages * config.page_size,
            swa_pool_tokens=(config.num_swa_pages * config.page_size) if windowed else 0,
            recurrent_pool_slots=config.num_recurrent_slots,
            max_waiting=config.max_waiting,
        )
        self._reqs: dict[int, _Req] = {}
        self.last_blocked: NotAdmitted | None = None

    # ------------------------------------------------------------ requests
    def add_request(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        if uid in self._reqs:
            # The planner forgets a request whose budget a step spends when it
            # plans that step; its pages stay here until the step's commit.
            raise RequestRefused("duplicate", f"request {uid} is already queued or running")
        self.planner.add_request(uid, len(prompt), max_tokens)
        self._reqs[uid] = _Req(uid, list(prompt), len(prompt), max_tokens)

    def abort(self, uid: int) -> bool:
        """Drop ``uid`` at any stage; every slot, page and lock comes back."""
        known = self.planner.abort(uid)
        self.kv.release(uid, None)
        return self._reqs.pop(uid, None) is not None or known

    def has_request(self, uid: int) -> bool:
        return uid in self._reqs

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def tokens(self, uid: int) -> list[int]:
        return self._reqs[uid].tokens

    # ---------------------------------------------------------------- step
    def schedule(self) -> ScheduledStep | None:
        """Plan the next step and allocate its pages; ``None`` when idle."""
        cap = self.kv.capacity(self.planner.slots.available)
        step = self.planner.plan(
            cap,
            match=lambda uid: self.kv.match(self._prompt(uid)),
            window_held=self.kv.window_held,
        )
        self.last_blocked = step.blocked
        if isinstance(step, IdleStep):
            return None
        seqs: list[ScheduledSeq] = []
        if isinstance(step, PrefillStep):
            # Phase one: lock every new prompt's prefix before any allocation
            # can evict it.
            for chunk in step.chunks:
                if chunk.admission is not None:
                    req = self._reqs[chunk.uid]
                    req.cached_len = self.kv.admit(
                        chunk.uid, self._prompt(chunk.uid), chunk.admission.cached_tokens
                    )
                    req.mem = self.kv.request(chunk.uid)
            for chunk in step.chunks:
                end = chunk.computed_len + chunk.chunk_len
                self.kv.allocate(chunk.uid, end)
                req = self._reqs[chunk.uid]
                req.slot = chunk.slot
                seq = self._seq(
                    req,
                    chunk.slot,
                    chunk.computed_len,
                    req.tokens[chunk.computed_len : end],
                    samples=not chunk.chunked,
                    admission=(chunk.admission.prompt_tokens, chunk.admission.cached_tokens)
                    if chunk.admission
                    else None,
                )
                if self._snapshotting:
                    seq = self._prefill_snapshots(req, seq)
                seqs.append(seq)
                if not chunk.chunked:
                    req.prefilled = True
            return ScheduledStep("prefill", tuple(seqs), step.blocked)
        assert isinstance(step, DecodeStep)
        # The hot path: one sequence per running request, every decode step.
        reqs, kv, p = self._reqs, self.kv, self.config.page_size
        append = seqs.append
        snapshotting = self._snapshotting
        for uid in step.uids:
            req = reqs[uid]
            mem = req.mem
            pos = len(req.tokens) - 1
            if pos >= len(mem.pages) * p:  # type: ignore[union-attr]
                # Full and window pages both end at the same page boundary.
                kv.allocate(uid, pos + 1)
            tables = mem._tables or mem.tables()  # type: ignore[union-attr]
            pages, swa_pages, recurrent_slots = tables
            seq = ScheduledSeq(
                uid, req.slot, pos, (req.tokens[pos],), pages, True, swa_pages, mem.swa_start, recurrent_slots
            )
            if snapshotting and (pos + 1) % p == 0:
                # A page boundary after this token: the latest snapshot.
                seq = seq._replace(snapshots=((1, recurrent_slots[2]),))
            append(seq)
        return ScheduledStep("decode", tuple(seqs), step.blocked)

    def _prefill_snapshots(self, req: _Req, seq: ScheduledSeq) -> ScheduledSeq:
        """A recurrent prompt chunk's restore and snapshots (module docstring)."""
        p = self.config.page_size
        start, end = seq.computed_len, seq.seq_len
        slots = seq.recurrent_slots
        snaps: list[tuple[int, int]] = []
        prompt_boundary = (req.prompt_len - 1) // p * p
        if req.cached_len < prompt_boundary and start < prompt_boundary <= end:
            snaps.append((prompt_boundary - start, slots[1]))
        if end == req.prompt_len and end % p == 0:
            snaps.append((end - start, slots[2]))
        restore = self.kv.take_restore(req.uid) if start == req.cached_len else -1
        if not snaps and restore < 0:
            return seq
        return seq._replace(restore_slot=restore, snapshots=tuple(snaps))

    def _seq(self, req: _Req, slot: int, computed: int, query, samples: bool, admission=None) -> ScheduledSeq:
        mem = req.mem
        assert mem is not None
        pages, swa_pages, recurrent_slots = mem.tables()
        return ScheduledSeq(
            uid=req.uid,
            slot=slot,
            computed_len=computed,
            query_tokens=tuple(query),
            pages=pages,
            samples=samples,
            swa_pages=swa_pages,
            swa_start=mem.swa_start,
            recurrent_slots=recurrent_slots,
            admission=admission,
        )

    def _prompt(self, uid: int) -> list[int]:
        req = self._reqs[uid]
        return req.tokens[: req.prompt_len]

    def commit(self, step: ScheduledStep, sampled: Mapping[int, int], stopped: Iterable[int] = ()) -> list[int]:
        """Record a step's sampled tokens; release requests that ended.

        ``sampled`` maps uid -> the token sampled for each sequence that
        samples; ``stopped`` names requests the engine ended early (EOS, stop
        string, stop token). Returns the uids released, in step order:
        stopped ones and those whose output budget is spent. Sequences of
        requests aborted since :meth:`schedule` are skipped.

        Raises ``ValueError``, changing nothing, when a sampling sequence of
        a live request has no token in ``sampled``: the planner counted that
        token against the request's budget when it planned the step, so
        going on would leave the request live here and forgotten there.
        """
        reqs = self._reqs
        missing = [seq.uid for seq in step.seqs if seq.samples and seq.uid not in sampled and seq.uid in reqs]
        if missing:
            raise ValueError(f"no sampled token for request(s) {missing} of this step")
        order = list(stopped)
        stopped = set(order)
        released: list[int] = []
        kv = self.kv
        window = kv.sliding_window
        # A request's oldest window page can go once it is a window and a
        # page behind what has been computed (kv.slide's rule).
        slide_from = None if window is None else window + 2 * self.config.page_size
        for seq in step.seqs:
            uid = seq.uid
            req = reqs.get(uid)
            if req is None:
                continue
            computed = seq.computed_len + len(seq.query_tokens)
            req.computed = computed
            for offset, slot in seq.snapshots:
                req.snapshots[slot] = seq.computed_len + offset
            if slide_from is not None and computed - req.mem.swa_start >= slide_from:  # type: ignore[union-attr]
                kv.slide(uid, computed)
            if seq.samples:
                req.tokens.append(int(sampled[uid]))
                req.outputs += 1
            if uid in stopped or req.outputs >= req.max_tokens:
                self._finish(req)
                released.append(uid)
        for uid in order:
            if uid in reqs and uid not in released:
                self._finish(reqs[uid])
                released.append(uid)
        return released

    def _finish(self, req: _Req) -> None:
        self.planner.finish(req.uid)
        # KV exists for the positions committed steps computed: every token
        # but the last sampled one, or, for a prompt stopped between chunks,
        # only its computed part (a partly written page must not be cached).
        self.kv.release(req.uid, req.tokens[: req.computed], req.snapshots)
        del self._reqs[req.uid]

    # --------------------------------------------------------------- stats
    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for uid in self._reqs:
            if not self.planner.is_known(uid):
                raise AssertionError(f"request {uid} is held by the scheduler but not the planner")
        if self.planner.slots.capacity - self.planner.slots.available != self.planner.num_running:
            raise AssertionError("slot table disagrees with the running set")
