"""The prefix cache's bookkeeping: a radix tree over full pages of token ids.

Decided here:

- The tree's unit is one **full page** of token ids: each node holds one
  page id and the ``page_size`` token ids whose KV that page stores. A
  partial page is never cached, because a later request could not append to
  a page another request shares.
- A match never covers the whole prompt: at most ``(len - 1) // page_size``
  pages, so at least one prompt token is always computed and there are
  logits to sample the first output token from.
- Matched paths are **locked** (reference counted up to the root) while a
  request uses them; only unlocked **leaves** are evictable, least recently
  used first (a logical clock, not wall time, so replays are deterministic).
  Evicting a leaf may expose its parent as the next leaf.
- Eviction and the digest cost what they return, not the size of the tree:
  a full tree holds a node per page of the pool, and both run under the
  engine's lock. Evictable leaves wait in a heap that is pushed to whenever
  a node becomes one (stale entries are skipped when popped), and nodes are
  kept in the order of their last use.
- Each node carries a chained hash of its path (:func:`page_hashes`), so the
  replica can tell the router which prefixes it holds without sending token
  ids.

Deliberately not here: tensors, and the page pool itself. The tree returns
the page ids it evicts or declines (duplicates) and the caller frees them in
its :class:`~ferrox.scheduler.pages.PageAllocator`.

Design after SGLang's RadixCache (page-granular matching, lock refs, LRU
leaf eviction), written anew for page-sized nodes.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import Sequence

_ROOT_HASH = 0


def _chain(prev: int, page_tokens: Sequence[int]) -> int:
    data = struct.pack(f"<Q{len(page_tokens)}q", prev, *page_tokens)
    # 63 bits: fits a signed 64-bit integer and JSON's safe range is not needed
    # (snapshots travel pickled), but Prometheus/JSON consumers stay happy.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of ``token_ids``.

    ``h[i] = blake2b(h[i-1] || tokens of page i)`` (63-bit), with ``h[-1] = 0``,
    so equal hashes at index ``i`` mean equal first ``(i + 1) * page_size``
    tokens (up to hash collisions). The partial last page has no hash.
    Deterministic across processes (no Python hash randomisation).
    """
    out: list[int] = []
    prev = _ROOT_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prev = _chain(prev, token_ids[start : start + page_size])
        out.append(prev)
    return out


class RadixNode:
    """One cached page: its token ids, page id, and place in the tree."""

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "hash", "depth")

    def __init__(self, key: tuple[int, ...], page: int, parent: "RadixNode | None", hash_: int, depth: int):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hash = hash_
        self.depth = depth  # pages from the root, the root being 0

    def __lt__(self, other: "RadixNode") -> bool:  # heap order: oldest, then deepest
        return (self.last_access, -self.depth, self.page) < (other.last_access, -other.depth, other.page)


@dataclass(frozen=True)
class PrefixMatch:
    """What a prompt found in the cache.

    ``cached_len`` tokens (a multiple of the page size) are covered by
    ``pages``; ``node`` is the deepest matched node (the root when nothing
    matched) and is what :meth:`RadixCache.lock` takes.
    ``evictable_len``: tokens of the match that are currently unlocked, i.e.
    counted as evictable capacity until a lock takes them out of it.
    """

    cached_len: int
    pages: tuple[int, ...]
    node: RadixNode = field(compare=False, repr=False)
    evictable_len: int = 0


class RadixCache:
    """Prefix tree over full pages of token ids -> page ids."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode((), -1, None, _ROOT_HASH, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._num_pages = 0
        self._evictable_pages = 0
        #: (last_access, -depth, page, node) of unlocked leaves, as pushed; an
        #: entry whose node was since locked, grown, touched or evicted is stale.
        self._leaf_heap: list[tuple[int, int, int, RadixNode]] = []
        #: Every node, least recently used first; within one use, deepest first.
        self._recency: OrderedDict[RadixNode, None] = OrderedDict()

    # ---------------------------------------------------------------- queries
    @property
    def cached_tokens(self) -> int:
        """Tokens held in the tree (locked or not)."""
        return self._num_pages * self.page_size

    @property
    def evictable_tokens(self) -> int:
        """Tokens in unlocked nodes: they can all be evicted, leaves first."""
        return self._evictable_pages * self.page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, token_ids: Sequence[int], *, touch: bool = True) -> PrefixMatch:
        """The longest cached whole-page prefix of ``token_ids``, never all of it.

        ``touch`` refreshes the matched nodes' LRU clock (a planner's
        what-if query passes ``False``).
        """
        p = self.page_size
        max_pages = max(len(token_ids) - 1, 0) // p
        node = self.root
        pages: list[int] = []
        evictable = 0
        path: list[RadixNode] = []
        for i in range(max_pages):
            child = node.children.get(tuple(token_ids[i * p : (i + 1) * p]))
            if child is None:
                break
            node = child
            path.append(child)
            pages.append(child.page)
            if child.lock_ref == 0:
                evictable += 1
        if touch:
            self._touch(path)
        return PrefixMatch(len(pages) * p, tuple(pages), node, evictable * p)

    def _touch(self, path: list[RadixNode]) -> None:
        """Mark a root-to-node path used now."""
        now = self._tick()
        recency = self._recency
        for node in reversed(path):
            node.last_access = now
            recency[node] = None
            recency.move_to_end(node)
        if path:
            self._offer(path[-1])

    def _offer(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it is an unlocked leaf."""
        if node.lock_ref == 0 and not node.children and node is not self.root:
            heap = self._leaf_heap
            heapq.heappush(heap, (node.last_access, -node.depth, node.page, node))
            if len(heap) > 2 * self._num_pages + 64:
                # Mostly stale: rebuild in place (callers may hold the list).
                heap[:] = [
                    (n.last_access, -n.depth, n.page, n)
                    for n in self._recency
                    if n.lock_ref == 0 and not n.children
                ]
                heapq.heapify(heap)

    # ------------------------------------------------------------- locking
    def lock(self, node: RadixNode) -> int:
        """Lock the path from ``node`` to the root. Returns the tokens that
        stopped being evictable."""
        removed = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_pages -= 1
                removed += 1
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        return removed * self.page_size

    def unlock(self, node: RadixNode) -> int:
        """Undo one :meth:`lock`. Returns the tokens that became evictable."""
        added = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += 1
                added += 1
                self._offer(node)
            node = node.parent  # type: ignore[assignment]
        return added * self.page_size

    # ------------------------------------------------------------- insertion
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> tuple[RadixNode, list[int], list[int]]:
        """Insert the full pages of ``token_ids`` whose KV is in ``pages``.

        ``pages[i]`` holds tokens ``[i*page_size, (i+1)*page_size)``; only
        ``min(len(pages), len(token_ids) // page_size)`` pages are inserted.
        Returns ``(node, adopted, duplicates)``: the deepest node of the path,
        the page ids the tree now owns, and the caller's page ids whose
        content the tree already had (the caller frees those).
        New nodes start unlocked (evictable).
        """
        p = self.page_size
        n = min(len(pages), len(token_ids) // p)
        node = self.root
        adopted: list[int] = []
        duplicates: list[int] = []
        path: list[RadixNode] = []
        for i in range(n):
            key = tuple(token_ids[i * p : (i + 1) * p])
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, pages[i], node, _chain(node.hash, key), node.depth + 1)
                node.children[key] = child
                self._num_pages += 1
                self._evictable_pages += 1
                adopted.append(pages[i])
            elif child.page != pages[i]:
                duplicates.append(pages[i])
            path.append(child)
            node = child
        self._touch(path)
        return node, adopted, duplicates

    # -------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> list[int]:
        """Evict up to ``num_pages`` unlocked pages, least recently used leaves
        first. Returns the evicted page ids (the caller frees them)."""
        if num_pages <= 0:
            return []
        heap = self._leaf_heap
        evicted: list[int] = []
        while heap and len(evicted) < num_pages:
            last_access, _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.lock_ref or leaf.last_access != last_access:
                continue  # stale: evicted, grown, locked or touched since it was pushed
            del parent.children[leaf.key]
            del self._recency[leaf]
            leaf.parent = None
            self._num_pages -= 1
            self._evictable_pages -= 1
            evicted.append(leaf.page)
            self._offer(parent)
        return evicted

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        return [n.page for n in self._iter_nodes()]

    def digest(self, limit: int = 4096) -> list[int]:
        """Path hashes of cached pages, most recently used first (shallower
        first within one use), at most ``limit``."""
        return [n.hash for n in islice(reversed(self._recency), limit)]

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the counters disagree with the tree."""
        nodes = list(self._iter_nodes())
        if len(nodes) != self._num_pages:
            raise AssertionError(f"tree has {len(nodes)} nodes, counter says {self._num_pages}")
        unlocked = sum(1 for n in nodes if n.lock_ref == 0)
        if unlocked != self._evictable_pages:
            raise AssertionError(f"{unlocked} unlocked nodes, counter says {self._evictable_pages}")
        for n in nodes:
            if n.lock_ref < 0:
                raise AssertionError("negative lock count")
            if n.parent is not self.root and n.parent.lock_ref < n.lock_ref:  # type: ignore[union-attr]
                raise AssertionError("a child is locked more often than its parent")
        if len({n.page for n in nodes}) != len(nodes):
            raise AssertionError("a page appears twice in the tree")
        if set(self._recency) != set(nodes):
            raise AssertionError("the recency order and the tree hold different nodes")
        order = [(n.last_access, -n.depth) for n in self._recency]
        if order != sorted(order) or len(set(order)) != len(order):
            raise AssertionError("the recency order is not the order of last use")
        queued = {
            id(n)
            for last_access, _, _, n in self._leaf_heap
            if n.parent is not None and not n.children and n.lock_ref == 0 and n.last_access == last_access
        }
        missing = [n.page for n in nodes if n.lock_ref == 0 and not n.children and id(n) not in queued]
        if missing:
            raise AssertionError(f"evictable leaves missing from the eviction heap: pages {missing[:16]}")
