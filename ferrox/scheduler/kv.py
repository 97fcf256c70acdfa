"""Who holds which page, per request: the replica's memory bookkeeping.

Decided here: one :class:`KVManager` owns, as ids only,
- the full-attention page pool (:class:`PageAllocator`) and the prefix
  cache (:class:`RadixCache`) over it;
- the window page pool, for sliding-window layers, from which a request
  holds only the pages its window still needs and gives back the pages that
  slid out (the seed's self-reclaim) once a step has computed past them --
  never before, since the step's first query still reads them;
- the recurrent-state slot pool, three slots per request.

Prefix caching covers all three pools (after SGLang's SWA and Mamba radix
caches, page-granular here). A finished request's full pages go to the
radix tree as before; its window pages still held go with them (a window
page is side state of the node of the same positions), and so do its
recurrent snapshots (a snapshot is side state of the node that ends at its
boundary). A cached prefix of ``L`` tokens is *usable* only with what the
model needs to go on from ``L``: for a window model the window pages from
``window_start(L)`` (the page the seed's self-reclaim would keep at ``L``)
to ``L``; for a recurrent model a snapshot at exactly ``L``. The match is
cut back to the longest usable length. A hit shares the window pages (the
request drops them from its table as its window slides, never frees them)
and restores its live recurrent slot from the snapshot on its first step.
Window pages and snapshots of unlocked nodes count as evictable capacity
of their pools and are dropped least recently used first (the node keeps
its full page) when the pool runs short.

Which boundaries a recurrent request snapshots (slot 1 and slot 2 of its
three; slot 0 is live): the last page boundary of its prompt that a
repeated prompt can reuse, ``((prompt_len - 1) // page) * page`` (at most
``prompt_len - 1``, the radix match's cap), and, ping-ponged with later
crossings, the latest page boundary it computed past (so a follow-up turn
that extends the conversation resumes from its end). Intermediate
boundaries are not kept: each would cost a pool slot for as long as it is
cached, and two cover the repeated-prompt and multi-turn cases.

It measures the :class:`~ferrox.scheduler.admission.Capacity` the planner
reads (free + evictable, never a guess) and carries out an admission in two
phases -- lock every admitted prompt's matched prefix first, then allocate
-- so that one admission's eviction can never take pages another admission
of the same step was promised.

Deliberately not here: deciding what runs (``planner.py``) and any tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .admission import RECURRENT_SLOTS_PER_REQUEST, Capacity, align_down
from .pages import CACHE_OWNER, OutOfPages, PageAllocator
from .planner import NO_HIT, PrefixHit
from .radix import SIDE_STATE, SIDE_WINDOW, PrefixMatch, RadixCache, RadixNode


@dataclass
class RequestMemory:
    """What one admitted request holds."""

    uid: int
    #: Full-attention page ids, position order; the first ``cached_len // page_size``
    #: belong to the prefix cache (shared, locked), the rest to the request.
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    locked: RadixNode | None = None
    #: Window page ids for positions ``[swa_start, ...)``, position order;
    #: the first ``swa_shared`` are a cached prefix's (cache-owned, locked).
    swa_pages: list[int] = field(default_factory=list)
    swa_start: int = 0
    swa_shared: int = 0
    #: The cache nodes of the shared window pages (their window pages locked).
    swa_nodes: list[RadixNode] = field(default_factory=list)
    #: ``[live, prompt snapshot, latest snapshot]`` once allocated.
    recurrent_slots: list[int] = field(default_factory=list)
    #: Cached snapshot slot to restore the live slot from on the first step, or -1,
    #: and the node holding it (its snapshot locked until the request ends).
    restore_slot: int = -1
    state_node: RadixNode | None = None
    #: ``tables()``'s answer until the next change (a decode step changes a
    #: request's pages once a page, not once a token).
    _tables: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = field(
        default=None, repr=False, compare=False
    )

    def tables(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(pages, swa_pages, recurrent_slots)`` as tuples, for a :class:`ScheduledSeq`."""
        tables = self._tables
        if tables is None:
            tables = self._tables = (tuple(self.pages), tuple(self.swa_pages), tuple(self.recurrent_slots))
        return tables


class KVManager:
    """Page and slot bookkeeping of one replica.

    Parameters: ``page_size`` (tokens per page), ``num_pages`` (full pool),
    ``num_swa_pages`` and ``sliding_window`` (window pool; 0 / ``None`` for
    none), ``num_recurrent_slots`` (0 for none), ``enable_prefix_caching``.
    """

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        *,
        num_swa_pages: int = 0,
        sliding_window: int | None = None,
        num_recurrent_slots: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.page_size = page_size
        self.pages = PageAllocator(num_pages)
        self.cache = RadixCache(page_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.swa_pages = PageAllocator(num_swa_pages)
        self.recurrent = PageAllocator(num_recurrent_slots)
        self._side_pools = {SIDE_WINDOW: self.swa_pages, SIDE_STATE: self.recurrent}
        self.cache.on_side_free = lambda kind, ident: self._side_pools[kind].free([ident], CACHE_OWNER)
        self._requests: dict[int, RequestMemory] = {}
        usable_rules = (self.sliding_window is not None, num_recurrent_slots > 0)
        self._usable = self._usable_prefix if any(usable_rules) else None

    def window_start(self, computed: int) -> int:
        """First position a window request still holds once ``computed``
        tokens are done: whole pages older than window + one page go (the
        seed's self-reclaim)."""
        p = self.page_size
        return align_down(max(computed - (self.sliding_window + p), 0), p)  # type: ignore[operator]

    def _usable_prefix(self, path: list[RadixNode]) -> int:
        """How many leading nodes of a matched path a request can resume
        from (see the module docstring); 0 when none."""
        p = self.page_size
        windowed = self.sliding_window is not None
        recurrent = self.recurrent.num_pages > 0
        run: list[int] = []
        if windowed:
            count = 0
            for node in path:
                count = count + 1 if node.side[SIDE_WINDOW] >= 0 else 0
                run.append(count)
        for k in range(len(path), 0, -1):
            if recurrent and path[k - 1].side[SIDE_STATE] < 0:
                continue
            if windowed and run[k - 1] < k - self.window_start(k * p) // p:
                continue
            return k
        return 0

    # ----------------------------------------------------------- measuring
    def capacity(self, request_slots: int) -> Capacity:
        """Capacity now: free + evictable full-pool tokens, free window tokens,
        free recurrent slots."""
        p = self.page_size
        cache = self.cache
        return Capacity(
            request_slots=request_slots,
            kv_tokens=self.pages.num_free * p + cache.evictable_tokens,
            swa_tokens=(self.swa_pages.num_free + cache.side_evictable(SIDE_WINDOW)) * p,
            recurrent_slots=self.recurrent.num_free + cache.side_evictable(SIDE_STATE),
        )

    def match(self, prompt: Sequence[int]) -> PrefixHit:
        """A what-if prefix match for the planner; changes nothing."""
        if not self.enable_prefix_caching:
            return NO_HIT
        m = self.cache.match(prompt, touch=False, usable=self._usable)
        if not m.cached_len:
            return PrefixHit(0, 0)
        p = self.page_size
        swa = state = 0
        if self.sliding_window is not None:
            needed = m.path[self.window_start(m.cached_len) // p :]
            swa = sum(1 for n in needed if n.side_lock[SIDE_WINDOW] == 0) * p
        if self.recurrent.num_pages:
            state = int(m.path[-1].side_lock[SIDE_STATE] == 0)
        return PrefixHit(m.cached_len, m.evictable_len, swa_evictable_len=swa, recurrent_evictable=state)

    def window_held(self, uid: int) -> int:
        """Window tokens request ``uid`` holds, its shared prefix pages included."""
        mem = self._requests.get(uid)
        return len(mem.swa_pages) * self.page_size if mem else 0

    def request(self, uid: int) -> RequestMemory | None:
        return self._requests.get(uid)

    # ----------------------------------------------------------- admitting
    def admit(self, uid: int, prompt: Sequence[int], expected_cached_len: int | None = None) -> int:
        """Phase one of an admission: lock the prompt's matched prefix (its
        pages, window pages and snapshot). Returns the cached length.
        Recurrent slots are taken in phase two (:meth:`allocate`), as they
        may evict cached snapshots.

        ``expected_cached_len`` is what the planner admitted the request
        with: 0 means uncached (the planner may decline a hit, see
        ``planner.py``), and nothing is matched or locked; otherwise the
        match must agree, or the planner's reservation was computed on a
        different prefix. ``None`` (direct use) takes whatever matches.
        """
        if uid in self._requests:
            raise ValueError(f"request {uid} is already admitted")
        mem = RequestMemory(uid)
        path: tuple[RadixNode, ...] = ()
        if self.enable_prefix_caching and expected_cached_len != 0:
            m = self.cache.match(prompt, usable=self._usable)
            if expected_cached_len is not None and m.cached_len != expected_cached_len:
                raise AssertionError(
                    f"prefix of request {uid} changed between planning ({expected_cached_len}) "
                    f"and admission ({m.cached_len})"
                )
            if m.cached_len:
                self.cache.lock(m.node)
                mem.locked = m.node
                mem.pages = list(m.pages)
                mem.cached_len = m.cached_len
                path = m.path
        p = self.page_size
        if self.recurrent.num_pages and mem.cached_len:
            mem.state_node = path[-1]
            mem.restore_slot = path[-1].side[SIDE_STATE]
            self.cache.lock_side(path[-1], SIDE_STATE)
        if self.sliding_window is not None:
            # The window layers resume with the cached prefix's last window
            # pages, shared; the first new page follows them.
            mem.swa_start = self.window_start(mem.cached_len)
            mem.swa_nodes = list(path[mem.swa_start // p : mem.cached_len // p])
            for node in mem.swa_nodes:
                self.cache.lock_side(node, SIDE_WINDOW)
            mem.swa_pages = [n.side[SIDE_WINDOW] for n in mem.swa_nodes]
            mem.swa_shared = len(mem.swa_pages)
        self._requests[uid] = mem
        return mem.cached_len

    def allocate(self, uid: int, upto: int) -> None:
        """Phase two: make request ``uid`` hold pages for positions ``[0, upto)``
        (and window pages from its window's start through ``upto``), evicting
        unlocked cache pages if the free list is short. Raises
        :class:`OutOfPages` if even eviction cannot cover it -- an admission
        bug, never a normal outcome.

        Window pages are not slid here: the step about to run attends, from
        its first query on, to keys up to a window before that query, so the
        pages its *last* query no longer needs are still read while it runs.
        :meth:`slide` gives them back once the step has run."""
        mem = self._requests[uid]
        p = self.page_size
        need = -(-upto // p) - len(mem.pages)
        if need > 0:
            self._ensure_free(need)
            mem.pages.extend(self.pages.allocate(need, uid))
            mem._tables = None
        if self.sliding_window is not None:
            need = -(-upto // p) - mem.swa_start // p - len(mem.swa_pages)
            if need > 0:
                mem.swa_pages.extend(self._take_side(SIDE_WINDOW, need, uid))
                mem._tables = None
        if self.recurrent.num_pages and not mem.recurrent_slots:
            mem.recurrent_slots = self._take_side(SIDE_STATE, RECURRENT_SLOTS_PER_REQUEST, uid)
            mem._tables = None

    def _take_side(self, kind: int, count: int, uid: int) -> list[int]:
        """Allocate ``count`` window pages / recurrent slots, dropping cached
        ones (least recently used, unlocked) if the free list is short."""
        pool = self._side_pools[kind]
        short = count - pool.num_free
        if short > 0:
            pool.free(self.cache.evict_side(kind, short), CACHE_OWNER)
        return pool.allocate(count, uid)

    def slide(self, uid: int, computed: int) -> None:
        """Give back the window pages that slid out once ``computed`` tokens are done."""
        mem = self._requests.get(uid)
        if mem is not None and self.sliding_window is not None:
            self._slide(mem, computed)

    def _slide(self, mem: RequestMemory, computed: int) -> None:
        p = self.page_size
        # The seed's self-reclaim: pages wholly older than window + one page.
        evict_to = self.window_start(computed)
        drop = min((evict_to - mem.swa_start) // p, len(mem.swa_pages)) if evict_to > mem.swa_start else 0
        if drop > 0:
            # Shared prefix pages leave the table and are unlocked; they are the cache's.
            shared = min(drop, mem.swa_shared)
            for node in mem.swa_nodes[:shared]:
                self.cache.unlock_side(node, SIDE_WINDOW)
            del mem.swa_nodes[:shared]
            self.swa_pages.free(mem.swa_pages[shared:drop], mem.uid)
            mem.swa_shared -= shared
            del mem.swa_pages[:drop]
            mem.swa_start += drop * p
            mem._tables = None

    def _ensure_free(self, need: int) -> None:
        short = need - self.pages.num_free
        if short > 0:
            evicted = self.cache.evict(short)
            self.pages.free(evicted, CACHE_OWNER)
        if need > self.pages.num_free:
            raise OutOfPages(f"need {need} pages, {self.pages.num_free} free after eviction")

    # ------------------------------------------------------------- endings
    def take_restore(self, uid: int) -> int:
        """The cached snapshot slot request ``uid``'s first step restores its
        live slot from (-1 for none); answered once."""
        mem = self._requests[uid]
        slot, mem.restore_slot = mem.restore_slot, -1
        return slot

    def release(
        self,
        uid: int,
        token_ids: Sequence[int] | None = None,
        snapshots: dict[int, int] | None = None,
    ) -> None:
        """The request ended. With ``token_ids`` (the tokens whose KV its pages
        hold, in order) its full pages go to the prefix cache, with the window
        pages it still holds for them and its recurrent ``snapshots``
        (``{slot: boundary}``, each slot holding the state after the first
        ``boundary`` tokens, a multiple of the page size); the rest, and
        everything of an aborted request (``token_ids=None``), is freed."""
        mem = self._requests.pop(uid, None)
        if mem is None:
            return
        p = self.page_size
        own = mem.pages[mem.cached_len // p :]
        own_swa = mem.swa_pages[mem.swa_shared :]
        own_slots = list(mem.recurrent_slots)
        if self.enable_prefix_caching and token_ids is not None:
            full = min(len(token_ids) // p, len(mem.pages))
            side: list[list[int]] = [[], []]
            if self.sliding_window is not None and own_swa:
                first = (mem.swa_start // p) + mem.swa_shared  # page index of own_swa[0]
                side[SIDE_WINDOW] = [-1] * first + own_swa
            if snapshots and own_slots:
                ids = [-1] * full
                for slot, boundary in snapshots.items():
                    if slot in own_slots and 0 < boundary <= full * p and boundary % p == 0:
                        ids[boundary // p - 1] = slot
                side[SIDE_STATE] = ids
            node, adopted, duplicates = self.cache.insert(token_ids[: full * p], mem.pages[:full], side)
            self.pages.transfer(adopted, uid, CACHE_OWNER)
            adopted_set = set(adopted)
            shared = set(mem.pages[: mem.cached_len // p])
            to_free = [pg for pg in own if pg not in adopted_set and pg not in shared]
            self.pages.free(to_free, uid)
            path = self.cache.path_to(node) if (side[SIDE_WINDOW] or side[SIDE_STATE]) else []
            for kind in (SIDE_WINDOW, SIDE_STATE):
                kept = {
                    n.side[kind]
                    for i, n in enumerate(path)
                    if i < len(side[kind]) and side[kind][i] >= 0 and side[kind][i] == n.side[kind]
                }
                if kept:
                    self._side_pools[kind].transfer(sorted(kept), uid, CACHE_OWNER)
                    if kind == SIDE_WINDOW:
                        own_swa = [pg for pg in own_swa if pg not in kept]
                    else:
                        own_slots = [s for s in own_slots if s not in kept]
        else:
            self.pages.free(own, uid)
        for node in mem.swa_nodes:
            self.cache.unlock_side(node, SIDE_WINDOW)
        if mem.state_node is not None:
            self.cache.unlock_side(mem.state_node, SIDE_STATE)
        if mem.locked is not None:
            self.cache.unlock(mem.locked)
        if own_swa:
            self.swa_pages.free(own_swa, uid)
        if own_slots:
            self.recurrent.free(own_slots, uid)

    # ------------------------------------------------------------ checking
    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every page and slot is free, cached,
        or held by exactly one live request, and the tree's counters agree."""
        self.cache.check_integrity()
        expected: dict[int, list[int]] = {CACHE_OWNER: self.cache.all_pages()}
        for uid, mem in self._requests.items():
            expected[uid] = mem.pages[mem.cached_len // self.page_size :]
        self.pages.check_integrity(expected)
        swa = {uid: m.swa_pages[m.swa_shared :] for uid, m in self._requests.items()}
        swa[CACHE_OWNER] = self.cache.all_side(SIDE_WINDOW)
        self.swa_pages.check_integrity(swa)
        slots = {uid: m.recurrent_slots for uid, m in self._requests.items()}
        slots[CACHE_OWNER] = self.cache.all_side(SIDE_STATE)
        self.recurrent.check_integrity(slots)
        for uid, m in self._requests.items():
            if [n.side[SIDE_WINDOW] for n in m.swa_nodes] != m.swa_pages[: m.swa_shared]:
                raise AssertionError(f"request {uid} shares window pages the cache does not hold")

    def check_idle(self) -> None:
        """Raise ``AssertionError`` unless no request holds anything: every
        page is free or cached (and unlocked), every slot free."""
        self.check_integrity()
        if self._requests:
            raise AssertionError(f"requests still hold memory: {sorted(self._requests)[:8]}")
        if self.cache.evictable_tokens != self.cache.cached_tokens:
            raise AssertionError("a cached prefix is still locked with no request holding it")
        if self.swa_pages.num_free + self.cache.side_count(SIDE_WINDOW) != self.swa_pages.num_pages:
            raise AssertionError("window pages leaked")
        if self.recurrent.num_free + self.cache.side_count(SIDE_STATE) != self.recurrent.num_pages:
            raise AssertionError("recurrent slots leaked")
