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
- A node may also hold **side state** for models whose prefix is more than
  full-attention KV (after SGLang's SWA and Mamba radix caches, kept
  page-granular here): :data:`SIDE_WINDOW`, the window-pool page holding the
  same positions' sliding-window KV, and :data:`SIDE_STATE`, a recurrent-pool
  slot holding the recurrent state after the node's last token. Side state
  can be dropped on its own (a *tombstone*: the node keeps its full page),
  least recently used first, when its pool runs short; evicting a node drops
  its side state with it (:attr:`RadixCache.on_side_free` is told). Side
  state has its own lock count (:meth:`RadixCache.lock_side`): a request
  locks only the side state it resumes from, and lets go of a window page
  as soon as its window slides past it, while the path's full pages stay
  locked. Whether a prefix is usable without some side state is the
  caller's rule, given to :meth:`RadixCache.match` as ``usable``.

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
from typing import Callable, Sequence

_ROOT_HASH = 0

#: Side-state kinds a node can hold (indexes into ``RadixNode.side``).
SIDE_WINDOW = 0
SIDE_STATE = 1
NUM_SIDE = 2


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

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "hash", "depth", "side", "side_lock")

    def __init__(self, key: tuple[int, ...], page: int, parent: "RadixNode | None", hash_: int, depth: int):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hash = hash_
        self.depth = depth  # pages from the root, the root being 0
        #: Side state by kind (:data:`SIDE_WINDOW`, :data:`SIDE_STATE`); -1 for none.
        self.side = [-1] * NUM_SIDE
        #: Per kind, how many requests use this node's side state now.
        self.side_lock = [0] * NUM_SIDE

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
    ``path``: the matched nodes, root side first.
    """

    cached_len: int
    pages: tuple[int, ...]
    node: RadixNode = field(compare=False, repr=False)
    evictable_len: int = 0
    path: tuple[RadixNode, ...] = field(default=(), compare=False, repr=False)


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
        #: Per side kind: the nodes holding one, in the same recency order,
        #: and how many of those are unlocked.
        self._side_nodes: list[OrderedDict[RadixNode, None]] = [OrderedDict() for _ in range(NUM_SIDE)]
        self._side_evictable = [0] * NUM_SIDE
        #: Called as ``on_side_free(kind, id)`` for the side state of an
        #: evicted node (the owner of that pool frees it).
        self.on_side_free: Callable[[int, int], None] | None = None

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

    def side_count(self, kind: int) -> int:
        """Side entries of ``kind`` held in the tree (locked or not)."""
        return len(self._side_nodes[kind])

    def side_evictable(self, kind: int) -> int:
        """Side entries of ``kind`` no request uses: droppable now."""
        return self._side_evictable[kind]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(
        self,
        token_ids: Sequence[int],
        *,
        touch: bool = True,
        usable: Callable[[list[RadixNode]], int] | None = None,
    ) -> PrefixMatch:
        """The longest cached whole-page prefix of ``token_ids``, never all of it.

        ``touch`` refreshes the matched nodes' LRU clock (a planner's
        what-if query passes ``False``). ``usable(path)``, given the matched
        root-to-node path, returns how many of its leading nodes can be used
        (a model that also needs side state at or before the cut shortens
        the match); the whole path by default.
        """
        p = self.page_size
        max_pages = max(len(token_ids) - 1, 0) // p
        node = self.root
        path: list[RadixNode] = []
        for i in range(max_pages):
            child = node.children.get(tuple(token_ids[i * p : (i + 1) * p]))
            if child is None:
                break
            node = child
            path.append(child)
        if usable is not None and path:
            del path[usable(path):]
        evictable = sum(1 for n in path if n.lock_ref == 0)
        if touch:
            self._touch(path)
        node = path[-1] if path else self.root
        return PrefixMatch(len(path) * p, tuple(n.page for n in path), node, evictable * p, tuple(path))

    def _touch(self, path: list[RadixNode]) -> None:
        """Mark a root-to-node path used now."""
        now = self._tick()
        recency = self._recency
        side_nodes = self._side_nodes
        for node in reversed(path):
            node.last_access = now
            recency[node] = None
            recency.move_to_end(node)
            for kind in range(NUM_SIDE):
                if node.side[kind] >= 0:
                    side_nodes[kind].move_to_end(node)
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
    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        side: Sequence[Sequence[int]] | None = None,
    ) -> tuple[RadixNode, list[int], list[int]]:
        """Insert the full pages of ``token_ids`` whose KV is in ``pages``.

        ``pages[i]`` holds tokens ``[i*page_size, (i+1)*page_size)``; only
        ``min(len(pages), len(token_ids) // page_size)`` pages are inserted.
        Returns ``(node, adopted, duplicates)``: the deepest node of the path,
        the page ids the tree now owns, and the caller's page ids whose
        content the tree already had (the caller frees those).
        New nodes start unlocked (evictable).

        ``side[kind][i]`` (``-1`` for none) is side state for page ``i``; a
        node of the path without side state of that kind adopts it. Whether
        an id was adopted shows as ``node.side[kind] == id`` on
        :meth:`path_to` of the returned node; the caller frees the others.
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
            if side is not None:
                for kind, ids in enumerate(side):
                    if i < len(ids) and ids[i] >= 0 and child.side[kind] < 0:
                        child.side[kind] = ids[i]
                        # Appended now; the touch below puts it in recency order.
                        self._side_nodes[kind][child] = None
                        self._side_evictable[kind] += 1
            path.append(child)
            node = child
        self._touch(path)
        return node, adopted, duplicates

    def path_to(self, node: RadixNode) -> list[RadixNode]:
        """Root-to-``node`` path (without the root)."""
        path: list[RadixNode] = []
        while node is not self.root and node is not None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        path.reverse()
        return path

    def lock_side(self, node: RadixNode, kind: int) -> None:
        """A request uses ``node``'s side state of ``kind`` (which it must have)."""
        if node.side[kind] < 0:
            raise ValueError(f"node has no side state of kind {kind} to lock")
        if node.side_lock[kind] == 0:
            self._side_evictable[kind] -= 1
        node.side_lock[kind] += 1

    def unlock_side(self, node: RadixNode, kind: int) -> None:
        """Undo one :meth:`lock_side`."""
        if node.side_lock[kind] <= 0:
            raise ValueError("unlock_side of side state that is not locked")
        node.side_lock[kind] -= 1
        if node.side_lock[kind] == 0:
            self._side_evictable[kind] += 1

    def _drop_side(self, node: RadixNode, kind: int) -> int:
        ident = node.side[kind]
        node.side[kind] = -1
        del self._side_nodes[kind][node]
        self._side_evictable[kind] -= 1  # only unlocked side state is ever dropped
        return ident

    def evict_side(self, kind: int, count: int) -> list[int]:
        """Drop up to ``count`` side entries of ``kind`` from unlocked nodes,
        least recently used first; the nodes keep their pages (tombstones).
        Returns the dropped ids (the caller frees them)."""
        out: list[int] = []
        if count <= 0:
            return out
        for node in list(self._side_nodes[kind]):
            if len(out) >= count:
                break
            if node.side_lock[kind] == 0:
                out.append(self._drop_side(node, kind))
        return out

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
            for kind in range(NUM_SIDE):
                if leaf.side[kind] >= 0:
                    ident = self._drop_side(leaf, kind)
                    if self.on_side_free is not None:
                        self.on_side_free(kind, ident)
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

    def all_side(self, kind: int) -> list[int]:
        """Every side id of ``kind`` the tree holds."""
        return [n.side[kind] for n in self._side_nodes[kind]]

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
        for kind in range(NUM_SIDE):
            holders = [n for n in nodes if n.side[kind] >= 0]
            if set(holders) != set(self._side_nodes[kind]) or len(holders) != len(self._side_nodes[kind]):
                raise AssertionError(f"side kind {kind}: the index and the tree disagree")
            if sum(1 for n in holders if n.side_lock[kind] == 0) != self._side_evictable[kind]:
                raise AssertionError(f"side kind {kind}: evictable counter disagrees with the tree")
            for n in nodes:
                if n.side_lock[kind] < 0 or (n.side_lock[kind] and (n.side[kind] < 0 or n.lock_ref == 0)):
                    raise AssertionError(f"side kind {kind}: side state locked on a node no request locks")
            if len({n.side[kind] for n in holders}) != len(holders):
                raise AssertionError(f"side kind {kind}: an id appears twice in the tree")
            order = [(n.last_access, -n.depth) for n in self._side_nodes[kind]]
            if order != sorted(order):
                raise AssertionError(f"side kind {kind}: not in the order of last use")
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
