"""KVManager: two-phase admission, eviction, release to the prefix cache, window and recurrent pools."""

from __future__ import annotations

import pytest

from ferrox.scheduler.admission import Capacity
from ferrox.scheduler.kv import KVManager
from ferrox.scheduler.pages import CACHE_OWNER, OutOfPages
from ferrox.scheduler.planner import PrefixHit

P = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def finished(kv: KVManager, uid: int, ids: list[int]) -> None:
    """Run ``uid`` over ``ids`` and release it to the cache."""
    kv.admit(uid, ids)
    kv.allocate(uid, len(ids))
    kv.release(uid, ids)


def test_capacity_is_free_plus_evictable_pages_in_tokens():
    kv = KVManager(P, 10, num_recurrent_slots=6)
    assert kv.capacity(3) == Capacity(request_slots=3, kv_tokens=40, swa_tokens=0, recurrent_slots=6)
    finished(kv, 1, tokens(0, 10))  # two full pages cached, the partial third freed
    kv.admit(2, tokens(100, 5))
    kv.allocate(2, 5)
    assert kv.capacity(2) == Capacity(request_slots=2, kv_tokens=40 - 8, swa_tokens=0, recurrent_slots=3)
    assert (kv.pages.num_free, kv.cache.evictable_tokens) == (6, 8)


def test_a_released_request_leaves_its_full_pages_to_the_next_prompt():
    kv = KVManager(P, 10)
    finished(kv, 1, tokens(0, 10))
    assert kv.cache.cached_tokens == 8
    assert kv.match(tokens(0, 12)) == PrefixHit(cached_len=8, evictable_len=8)
    assert kv.admit(2, tokens(0, 12), expected_cached_len=8) == 8
    mem = kv.request(2)
    assert mem.pages == [0, 1] and mem.cached_len == 8
    assert kv.cache.evictable_tokens == 0, "the admitted prefix is locked"
    kv.allocate(2, 12)
    assert mem.pages == [0, 1, 2]
    kv.check_integrity()
    kv.release(2, tokens(0, 12))
    kv.check_idle()
    assert kv.cache.cached_tokens == 12


def test_an_aborted_request_caches_nothing_and_unlocks_its_prefix():
    kv = KVManager(P, 10)
    finished(kv, 1, tokens(0, 8))
    kv.admit(2, tokens(0, 20))
    kv.allocate(2, 20)
    kv.release(2, None)
    kv.check_idle()
    assert (kv.cache.cached_tokens, kv.cache.evictable_tokens, kv.pages.num_free) == (8, 8, 8)


def test_a_what_if_match_changes_nothing():
    kv = KVManager(P, 10)
    finished(kv, 1, tokens(0, 8))
    before = kv.cache.digest()
    assert kv.match(tokens(0, 9)).cached_len == 8
    assert kv.cache.digest() == before
    assert kv.cache.evictable_tokens == 8


def test_without_prefix_caching_nothing_is_matched_or_kept():
    kv = KVManager(P, 10, enable_prefix_caching=False)
    finished(kv, 1, tokens(0, 8))
    assert kv.match(tokens(0, 9)) == PrefixHit(0, 0)
    assert kv.admit(2, tokens(0, 9)) == 0
    assert (kv.cache.cached_tokens, kv.pages.num_free) == (0, 10)


def test_allocation_evicts_unlocked_cache_pages_when_the_free_list_is_short():
    kv = KVManager(P, 4)
    finished(kv, 1, tokens(0, 8))  # pages 0, 1 cached
    finished(kv, 2, tokens(50, 5))  # page 2 cached, later
    assert (kv.pages.num_free, kv.cache.cached_tokens) == (1, 12)
    kv.admit(3, tokens(100, 12))
    kv.allocate(3, 12)  # three pages: the free one and two evicted
    assert kv.pages.num_free == 0
    assert kv.cache.all_pages() == [2], "the older path went, leaf first, then its exposed parent"
    assert kv.request(3).pages == [0, 1, 3], "last freed, first handed out"
    kv.check_integrity()


def test_an_admitted_prefix_is_never_evicted_for_another_admission():
    """Phase one locks every admitted prompt's prefix before phase two
    allocates, so one admission's eviction cannot take another's prefix."""
    kv = KVManager(P, 4)
    finished(kv, 1, tokens(0, 8))  # pages 0, 1 cached; 2 free
    kv.admit(2, tokens(0, 10))  # hits both pages and locks them
    kv.admit(3, tokens(100, 12))  # needs three pages
    with pytest.raises(OutOfPages, match="need 3 pages, 2 free after eviction"):
        kv.allocate(3, 12)
    assert kv.request(2).pages == [0, 1]
    assert kv.cache.cached_tokens == 8, "the locked prefix survived"
    kv.allocate(2, 10)
    kv.check_integrity()


def test_a_duplicate_of_a_cached_page_is_freed_on_release():
    kv = KVManager(P, 8)
    kv.admit(1, tokens(0, 9))
    kv.admit(2, tokens(0, 9))  # admitted together: neither finds the other's pages
    kv.allocate(1, 9)
    kv.allocate(2, 9)
    kv.release(1, tokens(0, 9))
    kv.release(2, tokens(0, 9))
    kv.check_idle()
    assert kv.cache.cached_tokens == 8
    assert kv.pages.num_free == 6, "request 2's copies of the two cached pages came back"


def test_admitting_a_request_twice_is_an_error():
    kv = KVManager(P, 8)
    kv.admit(1, tokens(0, 4))
    with pytest.raises(ValueError, match="request 1 is already admitted"):
        kv.admit(1, tokens(0, 4))


def test_admission_checks_the_prefix_the_planner_was_told():
    kv = KVManager(P, 8)
    finished(kv, 1, tokens(0, 8))
    with pytest.raises(AssertionError, match=r"changed between planning \(4\) and admission \(8\)"):
        kv.admit(2, tokens(0, 9), expected_cached_len=4)


def test_a_request_the_planner_admitted_uncached_locks_nothing():
    kv = KVManager(P, 8)
    finished(kv, 1, tokens(0, 8))
    assert kv.admit(2, tokens(0, 9), expected_cached_len=0) == 0
    assert kv.request(2).pages == [] and kv.cache.evictable_tokens == 8


def test_a_recurrent_request_takes_three_slots_when_its_pages_are_allocated_and_gives_them_back():
    kv = KVManager(P, 8, num_recurrent_slots=7)
    kv.admit(1, tokens(0, 4))
    kv.admit(2, tokens(10, 4))
    assert kv.request(1).recurrent_slots == [], "phase one only locks: taking slots may evict snapshots"
    kv.allocate(1, 4)
    kv.allocate(2, 4)
    assert kv.request(1).recurrent_slots == [0, 1, 2]
    assert kv.request(2).recurrent_slots == [3, 4, 5]
    kv.admit(3, tokens(20, 4))
    with pytest.raises(OutOfPages):
        kv.allocate(3, 4)
    kv.release(3, None)
    kv.release(1, None)
    kv.release(2, None)
    kv.check_idle()


def test_window_pages_slide_out_once_a_step_has_computed_past_them():
    kv = KVManager(P, 64, num_swa_pages=16, sliding_window=8, enable_prefix_caching=False)
    kv.admit(1, tokens(0, 40))
    kv.allocate(1, 16)
    mem = kv.request(1)
    assert (mem.swa_start, mem.swa_pages) == (0, [0, 1, 2, 3])
    kv.slide(1, 16)  # keys before 16 - (8 + 4) = 4 are no longer read
    assert (mem.swa_start, len(mem.swa_pages)) == (4, 3)
    kv.allocate(1, 32)  # the next chunk, 16..32: nothing slides before it runs
    assert (mem.swa_start, len(mem.swa_pages)) == (4, 7)
    assert kv.window_held(1) == 28
    kv.slide(1, 32)
    assert (mem.swa_start, len(mem.swa_pages)) == (20, 3)
    assert kv.swa_pages.num_free == 13
    kv.check_integrity()
    kv.release(1, None)
    kv.check_idle()


def test_allocating_a_chunk_keeps_every_window_page_its_first_query_reads():
    """A chunk at 16..48 with a window of 8 starts with a query at 16 that
    reads keys from 9: the pages from position 8 on stay until the step ran."""
    kv = KVManager(P, 64, num_swa_pages=16, sliding_window=8, enable_prefix_caching=False)
    kv.admit(1, tokens(0, 64))
    kv.allocate(1, 16)
    kv.slide(1, 16)
    kv.allocate(1, 48)
    mem = kv.request(1)
    assert mem.swa_start == 4 <= 16 - 8 + 1
    assert mem.swa_start + len(mem.swa_pages) * P == 48


def test_check_idle_fails_while_a_request_holds_memory():
    kv = KVManager(P, 8, num_recurrent_slots=3)
    kv.admit(1, tokens(0, 4))
    kv.allocate(1, 4)
    with pytest.raises(AssertionError, match=r"requests still hold memory: \[1\]"):
        kv.check_idle()
    kv.release(1, tokens(0, 4))
    kv.check_idle()


def test_integrity_fails_when_a_page_is_recorded_for_the_wrong_holder():
    # Corrupts the manager's own record to show check_integrity sees it.
    kv = KVManager(P, 8)
    kv.admit(1, tokens(0, 8))
    kv.allocate(1, 8)
    kv.request(1).pages.append(5)
    with pytest.raises(AssertionError, match="page 5 is claimed by 1 but recorded as None"):
        kv.check_integrity()


def test_pages_released_to_the_cache_are_owned_by_the_cache():
    kv = KVManager(P, 8)
    finished(kv, 1, tokens(0, 9))
    assert kv.pages.pages_of(CACHE_OWNER) == [0, 1]
    assert kv.pages.owner(2) is None
