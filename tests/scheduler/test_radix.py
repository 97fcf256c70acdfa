"""RadixCache: whole-page prefix matching, locks, LRU leaf eviction, path hashes."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox.scheduler.radix import RadixCache, page_hashes

P = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def chained(prev: int, page: list[int]) -> int:
    """The docstring's formula, written out: blake2b-64 of ``prev || page``, shifted to 63 bits."""
    data = struct.pack(f"<Q{len(page)}q", prev, *page)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def test_page_hashes_chain_over_full_pages_only():
    ids = tokens(1, 10)  # two full pages of 4 and a partial one
    h0 = chained(0, [1, 2, 3, 4])
    h1 = chained(h0, [5, 6, 7, 8])
    assert page_hashes(ids, P) == [h0, h1]
    assert page_hashes(ids[:3], P) == [], "a partial page has no hash"
    assert page_hashes([1, 2, 3, 4, 9, 9, 9, 9], P)[0] == h0, "equal first pages, equal first hash"
    assert page_hashes([1, 2, 3, 4, 9, 9, 9, 9], P)[1] != h1
    assert all(0 <= h < 1 << 63 for h in (h0, h1))


def test_a_match_covers_whole_pages_and_never_the_whole_prompt():
    cache = RadixCache(P)
    cache.insert(tokens(0, 12), [10, 11, 12])
    exact = cache.match(tokens(0, 12))
    assert (exact.cached_len, exact.pages) == (8, (10, 11)), "one token is always left to compute"
    longer = cache.match(tokens(0, 13))
    assert (longer.cached_len, longer.pages) == (12, (10, 11, 12))
    diverging = cache.match(tokens(0, 6) + [99] + tokens(7, 10))
    assert (diverging.cached_len, diverging.pages) == (4, (10,)), "a page matches whole or not at all"
    assert cache.match(tokens(0, 4)).cached_len == 0
    assert cache.match([]).cached_len == 0
    miss = cache.match(tokens(50, 9))
    assert (miss.cached_len, miss.pages, miss.node) == (0, (), cache.root)


def test_only_full_pages_of_a_sequence_are_inserted():
    cache = RadixCache(P)
    node, adopted, duplicates = cache.insert(tokens(0, 11), [3, 4, 5])
    assert (adopted, duplicates) == ([3, 4], [])
    assert node.depth == 2
    assert cache.num_pages == 2
    assert (cache.cached_tokens, cache.evictable_tokens) == (8, 8), "new nodes start unlocked"


def test_inserting_content_the_tree_already_has_returns_the_duplicate_pages():
    cache = RadixCache(P)
    cache.insert(tokens(0, 8), [3, 4])
    _, adopted, duplicates = cache.insert(tokens(0, 12), [7, 4, 9])
    assert adopted == [9], "only the new third page is adopted"
    assert duplicates == [7], "page 7 holds what page 3 already holds; the caller frees it"
    assert sorted(cache.all_pages()) == [3, 4, 9]
    cache.check_integrity()


def test_locking_a_match_takes_its_path_out_of_the_evictable_tokens():
    cache = RadixCache(P)
    cache.insert(tokens(0, 12), [0, 1, 2])
    cache.insert(tokens(0, 4) + tokens(100, 4), [0, 5])
    assert (cache.cached_tokens, cache.evictable_tokens) == (16, 16)
    m = cache.match(tokens(0, 9))
    assert (m.cached_len, m.evictable_len) == (8, 8)
    assert cache.lock(m.node) == 8
    assert cache.evictable_tokens == 8
    assert cache.match(tokens(0, 9)).evictable_len == 0, "the locked path is no longer evictable"
    assert cache.lock(m.node) == 0, "a second lock removes nothing more"
    other = cache.match(tokens(0, 4) + tokens(100, 4) + [1])
    assert other.evictable_len == 4, "the shared first page is locked, the second is not"
    assert cache.unlock(m.node) == 0, "still locked once"
    assert cache.unlock(m.node) == 8
    assert cache.evictable_tokens == 16
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)
    cache.check_integrity()


def test_eviction_takes_least_recently_used_leaves_and_then_their_exposed_parents():
    cache = RadixCache(P)
    cache.insert(tokens(0, 12), [0, 1, 2])  # path a: pages 0 -> 1 -> 2
    cache.insert(tokens(0, 4) + tokens(100, 4), [0, 5])  # path b shares page 0, then 5
    cache.match(tokens(0, 12) + [1])  # touch path a: b's leaf is now the oldest
    assert cache.evict(1) == [5]
    assert cache.evict(1) == [2], "then a's leaf; a's page 1 is exposed as a leaf"
    assert cache.evict(5) == [1, 0], "the parent goes once its children have"
    assert cache.num_pages == 0
    assert cache.evict(1) == []
    cache.check_integrity()


def test_locked_pages_are_never_evicted():
    cache = RadixCache(P)
    cache.insert(tokens(0, 8), [0, 1])
    cache.insert(tokens(50, 8), [2, 3])
    m = cache.match(tokens(0, 9))
    cache.lock(m.node)
    assert cache.evict(10) == [3, 2]
    assert sorted(cache.all_pages()) == [0, 1]
    assert cache.evictable_tokens == 0
    cache.unlock(m.node)
    assert cache.evict(10) == [1, 0]


def test_a_what_if_match_does_not_refresh_the_lru_clock():
    cache = RadixCache(P)
    cache.insert(tokens(0, 4), [0])
    cache.insert(tokens(50, 4), [1])
    cache.match(tokens(0, 5), touch=False)
    assert cache.evict(1) == [0], "page 0 is still the older"
    cache.insert(tokens(0, 4), [0])
    cache.match(tokens(50, 5))
    assert cache.evict(1) == [0]


def test_the_digest_is_the_page_hashes_of_the_prompt():
    cache = RadixCache(P)
    prompt = tokens(7, 14)
    cache.insert(prompt, [0, 1, 2])
    assert cache.digest() == page_hashes(prompt, P)
    assert cache.digest(limit=2) == page_hashes(prompt, P)[:2]


def test_the_digest_lists_the_most_recently_used_first():
    cache = RadixCache(P)
    a, b = tokens(0, 8), tokens(50, 4)
    cache.insert(a, [0, 1])
    cache.insert(b, [2])
    assert cache.digest() == page_hashes(b, P) + page_hashes(a, P)
    cache.match(a + [0])
    assert cache.digest() == page_hashes(a, P) + page_hashes(b, P)


def test_integrity_fails_when_a_counter_disagrees_with_the_tree():
    # Corrupts a private counter to show check_integrity sees it.
    cache = RadixCache(P)
    cache.insert(tokens(0, 8), [0, 1])
    cache._evictable_pages = 1
    with pytest.raises(AssertionError, match="2 unlocked nodes, counter says 1"):
        cache.check_integrity()
    cache._evictable_pages = 2
    cache._num_pages = 3
    with pytest.raises(AssertionError, match="tree has 2 nodes, counter says 3"):
        cache.check_integrity()


def test_a_page_size_below_one_is_refused():
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RadixCache(0)


# ----------------------------------------------------------------- model-based
def reference_eviction(cache: RadixCache, count: int) -> list[int]:
    """The definition, by brute force: repeatedly take the unlocked leaf of
    least ``(last_access, -depth, page)``, which may expose its parent."""
    nodes = list(cache._iter_nodes())
    children = {id(n): len(n.children) for n in nodes}
    gone: list[int] = []
    alive = {id(n): n for n in nodes}
    while len(gone) < count:
        leaves = [n for n in alive.values() if children[id(n)] == 0 and n.lock_ref == 0]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, -n.depth, n.page))
        gone.append(leaf.page)
        del alive[id(leaf)]
        if leaf.parent is not cache.root:
            children[id(leaf.parent)] -= 1
    return gone


def reference_digest(cache: RadixCache) -> list[int]:
    nodes = sorted(cache._iter_nodes(), key=lambda n: (-n.last_access, n.depth, n.page))
    return [n.hash for n in nodes]


operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict", "peek"]),
        st.integers(0, 5),  # which of a few prompts
        st.integers(1, 6),  # pages
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_eviction_and_digest_agree_with_their_definitions_under_any_history(ops):
    cache = RadixCache(2)
    # Prompts sharing prefixes: 0-2 share a first page, 3-4 another, 5 alone.
    prompts = [[1, 1] + [p] * 12 for p in (10, 11, 12)] + [[2, 2] + [p] * 12 for p in (13, 14)] + [[3] * 14]
    free = list(range(200))
    locked = []
    for op, which, n in ops:
        prompt = prompts[which][: 2 * n + 1]
        if op == "insert":
            pages = [free.pop() for _ in range(n)]
            _, adopted, duplicates = cache.insert(prompt, pages)
            assert sorted(adopted + duplicates) == sorted(pages)
            free.extend(duplicates)
        elif op == "match":
            cache.match(prompt)
        elif op == "peek":
            cache.match(prompt, touch=False)
        elif op == "lock":
            m = cache.match(prompt)
            cache.lock(m.node)
            locked.append(m.node)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(which % len(locked)))
        elif op == "evict":
            expected = reference_eviction(cache, n)
            assert cache.evict(n) == expected
            free.extend(expected)
        cache.check_integrity()
        assert cache.digest() == reference_digest(cache)
    for node in locked:
        cache.unlock(node)
    assert sorted(cache.evict(10_000) + free) == list(range(200))


def test_stale_eviction_entries_are_dropped_before_they_outnumber_the_tree():
    cache = RadixCache(P)
    cache.insert(tokens(0, 8), [0, 1])
    cache.insert(tokens(50, 8), [2, 3])
    for _ in range(500):  # every touch of a leaf queues a fresh entry and leaves a stale one
        cache.match(tokens(0, 9))
    assert len(cache._leaf_heap) <= 2 * cache.num_pages + 64 + 1
    cache.check_integrity()
    assert cache.evict(4) == [3, 2, 1, 0]
