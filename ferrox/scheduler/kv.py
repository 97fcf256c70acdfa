"""Who holds which page, per request: the replica's memory bookkeeping.

Decided here: one :class:`KVManager` owns, as ids only,
- the full-attention page pool (:class:`PageAllocator`) and the prefix
  cache (:class:`RadixCache`) over it;
- the window page pool, for sliding-window layers, from which a request
  holds only the pages its window still needs and gives back the pages that
  slid out (the seed's self-reclaim) once a step has computed past them --
  never before, since the step's first query still reads them;
- the recurrent-state slot pool, three slots per request.

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
from .radix import PrefixMatch, RadixCache, RadixNode


@dataclass
class RequestMemory:
    """What one admitted request holds."""

    uid: int
    #: Full-attention page ids, position order; the first ``cached_len // page_size``
    #: belong to the prefix cache (shared, locked), the rest to the request.
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    locked: RadixNode | None = None
    #: Window page ids for positions ``[swa_start, ...)``, position order.
    swa_pages: list[int] = field(default_factory=list)
    swa_start: int = 0
    recurrent_slots: list[int] = field(default_factory=list)
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
        self._requests: dict[int, RequestMemory] = {}

    # ----------------------------------------------------------- measuring
    def capacity(self, request_slots: int) -> Capacity:
        """Capacity now: free + evictable full-pool tokens, free window tokens,
        free recurrent slots."""
        p = self.page_size
        return Capacity(
            request_slots=request_slots,
            kv_tokens=self.pages.num_free * p + self.cache.evictable_tokens,
            swa_tokens=self.swa_pages.num_free * p,
            recurrent_slots=self.recurrent.num_free,
        )

    def match(self, prompt: Sequence[int]) -> PrefixHit:
        """A what-if prefix match for the planner; changes nothing."""
        if not self.enable_prefix_caching:
            return NO_HIT
        m = self.cache.match(prompt, touch=False)
        return PrefixHit(m.cached_len, m.evictable_len)

    def window_held(self, uid: int) -> int:
        mem = self._requests.get(uid)
        return len(mem.swa_pages) * self.page_size if mem else 0

    def request(self, uid: int) -> RequestMemory | None:
        return self._requests.get(uid)

    # ----------------------------------------------------------- admitting
    def admit(self, uid: int, prompt: Sequence[int], expected_cached_len: int | None = None) -> int:
        """Phase one of an admission: lock the prompt's matched prefix and
        take recurrent slots. Returns the cached length.

        ``expected_cached_len`` (what the planner was told) is checked: the
        two must agree, or the planner's reservation was computed on a
        different prefix.
        """
        if uid in self._requests:
            raise ValueError(f"request {uid} is already admitted")
        mem = RequestMemory(uid)
        if self.enable_prefix_caching:
            m = self.cache.match(prompt)
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
        if self.recurrent.num_pages:
            mem.recurrent_slots = self.recurrent.allocate(RECURRENT_SLOTS_PER_REQUEST, uid)
        if self.sliding_window is not None:
            # The window layers see the cached prefix's window as already
            # computed; a window model's prefix hit has no window pages to
            # share, so it starts its window pages at the first new page.
            mem.swa_start = mem.cached_len
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
                mem.swa_pages.extend(self.swa_pages.allocate(need, uid))
                mem._tables = None

    def slide(self, uid: int, computed: int) -> None:
        """Give back the window pages that slid out once ``computed`` tokens are done."""
        mem = self._requests.get(uid)
        if mem is not None and self.sliding_window is not None:
            self._slide(mem, computed)

    def _slide(self, mem: RequestMemory, computed: int) -> None:
        p = self.page_size
        # The seed's self-reclaim: pages wholly older than window + one page.
        evict_to = align_down(max(computed - (self.sliding_window + p), 0), p)  # type: ignore[operator]
        drop = min((evict_to - mem.swa_start) // p, len(mem.swa_pages)) if evict_to > mem.swa_start else 0
        if drop > 0:
            self.swa_pages.free(mem.swa_pages[:drop], mem.uid)
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
    def release(self, uid: int, token_ids: Sequence[int] | None = None) -> None:
        """The request ended. With ``token_ids`` (the tokens whose KV its pages
        hold, in order) its full pages go to the prefix cache; the rest, and
        everything of an aborted request (``token_ids=None``), is freed."""
        mem = self._requests.pop(uid, None)
        if mem is None:
            return
        p = self.page_size
        own = mem.pages[mem.cached_len // p :]
        if self.enable_prefix_caching and token_ids is not None:
            full = min(len(token_ids) // p, len(mem.pages))
            node, adopted, duplicates = self.cache.insert(token_ids[: full * p], mem.pages[:full])
            self.pages.transfer(adopted, uid, CACHE_OWNER)
            adopted_set = set(adopted)
            shared = set(mem.pages[: mem.cached_len // p])
            to_free = [pg for pg in own if pg not in adopted_set and pg not in shared]
            self.pages.free(to_free, uid)
        else:
            self.pages.free(own, uid)
        if mem.locked is not None:
            self.cache.unlock(mem.locked)
        if mem.swa_pages:
            self.swa_pages.free(mem.swa_pages, uid)
        if mem.recurrent_slots:
            self.recurrent.free(mem.recurrent_slots, uid)

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
        self.swa_pages.check_integrity({uid: m.swa_pages for uid, m in self._requests.items()})
        self.recurrent.check_integrity({uid: m.recurrent_slots for uid, m in self._requests.items()})

    def check_idle(self) -> None:
        """Raise ``AssertionError`` unless no request holds anything: every
        page is free or cached (and unlocked), every slot free."""
        self.check_integrity()
        if self._requests:
            raise AssertionError(f"requests still hold memory: {sorted(self._requests)[:8]}")
        if self.cache.evictable_tokens != self.cache.cached_tokens:
            raise AssertionError("a cached prefix is still locked with no request holding it")
        if self.swa_pages.num_free != self.swa_pages.num_pages:
            raise AssertionError("window pages leaked")
        if self.recurrent.num_free != self.recurrent.num_pages:
            raise AssertionError("recurrent slots leaked")
