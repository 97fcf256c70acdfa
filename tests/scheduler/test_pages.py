"""PageAllocator: page ids handed out whole, last-freed-first, with an owner per page."""

from __future__ import annotations

import pytest

from ferrox.scheduler.pages import CACHE_OWNER, OutOfPages, PageAllocator


def test_a_fresh_pool_hands_out_pages_in_id_order():
    pool = PageAllocator(5)
    assert (pool.num_pages, pool.num_free) == (5, 5)
    assert pool.allocate(3, owner=7) == [0, 1, 2]
    assert pool.num_free == 2
    assert [pool.owner(p) for p in range(5)] == [7, 7, 7, None, None]


def test_freed_pages_come_back_last_freed_first():
    pool = PageAllocator(6)
    pool.allocate(4, owner=1)
    pool.free([1, 3], owner=1)
    assert pool.allocate(1, owner=2) == [3], "the most recently freed page comes back first"
    assert pool.allocate(2, owner=2) == [1, 4]


def test_asking_for_more_pages_than_are_free_takes_none():
    pool = PageAllocator(4)
    pool.allocate(1, owner=1)
    with pytest.raises(OutOfPages, match="asked for 4 pages, 3 free"):
        pool.allocate(4, owner=2)
    assert pool.num_free == 3
    assert pool.pages_of(2) == []


def test_a_negative_page_count_is_refused():
    with pytest.raises(ValueError, match="cannot allocate -1 pages"):
        PageAllocator(4).allocate(-1, owner=1)
    with pytest.raises(ValueError, match="num_pages must be >= 0"):
        PageAllocator(-1)


def test_only_the_owner_may_free_a_page():
    pool = PageAllocator(4)
    pool.allocate(2, owner=7)
    with pytest.raises(ValueError, match="page 0 freed by 8 but it is held by 7"):
        pool.free([0, 1], owner=8)
    assert pool.num_free == 2, "a refused free frees nothing"
    assert pool.pages_of(7) == [0, 1]


def test_a_double_free_is_an_error_at_the_moment_it_happens():
    pool = PageAllocator(4)
    pool.allocate(2, owner=7)
    pool.free([1], owner=7)
    with pytest.raises(ValueError, match="page 1 freed by 7 but it is free"):
        pool.free([0, 1], owner=7)
    assert pool.pages_of(7) == [0]


def test_a_page_named_twice_in_one_free_is_refused():
    pool = PageAllocator(4)
    pool.allocate(2, owner=7)
    with pytest.raises(ValueError, match="named twice"):
        pool.free([0, 0], owner=7)
    assert pool.num_free == 2
    pool.check_integrity({7: [0, 1]})


def test_transfer_hands_pages_to_the_cache():
    pool = PageAllocator(4)
    pool.allocate(3, owner=5)
    pool.transfer([0, 2], from_owner=5, to_owner=CACHE_OWNER)
    assert pool.pages_of(CACHE_OWNER) == [0, 2]
    assert pool.pages_of(5) == [1]
    assert pool.owner(0) == CACHE_OWNER
    with pytest.raises(ValueError, match="page 1 is not held by -1"):
        pool.transfer([1], from_owner=CACHE_OWNER, to_owner=5)
    pool.check_integrity({5: [1], CACHE_OWNER: [0, 2]})


def test_integrity_holds_when_the_claims_match_the_records():
    pool = PageAllocator(6)
    pool.allocate(2, owner=1)
    pool.allocate(3, owner=2)
    pool.free([2], owner=2)
    pool.check_integrity()
    pool.check_integrity({1: [0, 1], 2: [3, 4]})


def test_integrity_fails_on_a_page_claimed_by_the_wrong_owner():
    pool = PageAllocator(4)
    pool.allocate(2, owner=1)
    with pytest.raises(AssertionError, match="page 1 is claimed by 2 but recorded as 1"):
        pool.check_integrity({1: [0], 2: [1]})


def test_integrity_fails_on_a_page_claimed_twice():
    pool = PageAllocator(4)
    pool.allocate(2, owner=1)
    with pytest.raises(AssertionError, match="page 0 is claimed by 1 and 1"):
        pool.check_integrity({1: [0, 0, 1]})


def test_integrity_fails_on_a_held_page_nobody_claims():
    pool = PageAllocator(4)
    pool.allocate(2, owner=1)
    with pytest.raises(AssertionError, match=r"pages held but claimed by nobody: \[1\]"):
        pool.check_integrity({1: [0]})


def test_integrity_fails_on_a_corrupted_free_list():
    # The allocator's own methods cannot produce these states; the test
    # writes them into its private fields to show check_integrity sees them.
    pool = PageAllocator(4)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="on the free list twice"):
        pool.check_integrity()
    pool = PageAllocator(4)
    pool.allocate(1, owner=3)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="page 0 is on the free list but held by 3"):
        pool.check_integrity()
    pool = PageAllocator(4)
    pool._free.pop()
    with pytest.raises(AssertionError, match="0 held \\+ 3 free != 4 pages: a page is lost"):
        pool.check_integrity()
