"""The capacity router's policy (ferrox.cluster.routing), as pure arithmetic.

Every case builds CapacitySnapshots by hand and asserts the exact ranking,
outcome and figures. No Ray here; tests/cluster/test_router_ray.py runs the
policy inside a real Serve router.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ferrox.cluster.routing import (
    PREFIX_IMBALANCE_REQUESTS,
    Candidate,
    RequestShape,
    RoutedLedger,
    align_ceil,
    expected_wait_s,
    prefix_hit_pages,
    rank_by_queue,
    rank_replicas,
    tokens_needed,
)
from ferrox.replicas.types import CapacitySnapshot, GenerateRequest, SamplingParams

STALE = 5.0


def snap(replica_id: str, **overrides) -> CapacitySnapshot:
    base = dict(
        replica_id=replica_id,
        seq=1,
        timestamp=100.0,
        model="m",
        free_slots=8,
        max_slots=8,
        kv_tokens_available=4096,
        kv_tokens_total=4096,
        swa_tokens_available=None,
        recurrent_slots_available=None,
        waiting_requests=0,
        waiting_tokens=0,
        running_requests=0,
        page_size=16,
        max_model_len=8192,
        prefix_digest=(),
        decode_tokens_per_s=0.0,
        healthy=True,
    )
    base.update(overrides)
    return CapacitySnapshot(**base)


def cand(replica_id: str, age_s: float = 0.1, routed=(0, 0), queue_len=None, **overrides) -> Candidate:
    return Candidate(
        replica_id=replica_id,
        snapshot=snap(replica_id, **overrides),
        age_s=age_s,
        routed_requests=routed[0],
        routed_tokens=routed[1],
        queue_len=queue_len,
    )


def rank(request, candidates):
    return rank_replicas(request, candidates, stale_after_s=STALE)


# -- building blocks ---------------------------------------------------------


def test_align_ceil_rounds_up_to_whole_pages_and_not_below_zero():
    assert align_ceil(17, 16) == 32
    assert align_ceil(16, 16) == 16
    assert align_ceil(0, 16) == 0
    assert align_ceil(-5, 16) == 0


def test_only_the_leading_run_of_prefix_pages_counts_as_a_hit():
    assert prefix_hit_pages((1, 2, 3), {1, 2, 3, 9}) == 3
    assert prefix_hit_pages((1, 2, 3), (1, 3)) == 1
    assert prefix_hit_pages((1, 2, 3), {2, 3}) == 0
    assert prefix_hit_pages((), {1}) == 0


def test_a_request_needs_its_uncached_prompt_plus_output_rounded_up_to_pages():
    request = RequestShape(prompt_len=90, max_tokens=10, prefix_hashes=(11, 12, 13, 14, 15))
    # 90 - 4 pages * 16 = 26 uncached; 26 + 10 = 36 -> 48.
    assert tokens_needed(request, snap("a", prefix_digest=(11, 12, 13, 14))) == 48
    # nothing cached: 90 + 10 = 100 -> 112.
    assert tokens_needed(request, snap("a")) == 112
    # no snapshot, no page size: the bare sum.
    assert tokens_needed(request, None) == 100


def test_a_request_shape_reads_a_generate_requests_lengths_and_hashes():
    request = GenerateRequest(
        request_id="r",
        prompt_token_ids=tuple(range(40)),
        params=SamplingParams(max_tokens=7),
        prefix_hashes=(5, 6),
    )
    assert RequestShape.of(request) == RequestShape(prompt_len=40, max_tokens=7, prefix_hashes=(5, 6))


# -- can it seat the request? --------------------------------------------------


def test_a_replica_with_its_pool_nearly_reserved_is_skipped_for_a_long_request():
    # "a" holds the prompt's first 4 pages but has only 300 KV tokens left.
    a = cand("a", kv_tokens_available=300, prefix_digest=(1, 2, 3, 4))
    b = cand("b", kv_tokens_available=2000)
    short = RequestShape(prompt_len=64, max_tokens=32, prefix_hashes=(1, 2, 3, 4))
    long = RequestShape(prompt_len=64, max_tokens=1000, prefix_hashes=(1, 2, 3, 4))

    d_short = rank(short, [a, b])
    assert d_short.ranking == ("a", "b")
    assert d_short.outcome == "prefix_hit"
    assert d_short.best.need_tokens == 32
    assert d_short.best.headroom_tokens == 268

    d_long = rank(long, [a, b])
    # on "a": 0 uncached + 1000 -> 1008 > 300; on "b": 64 + 1000 -> 1072 <= 2000.
    assert d_long.ranking == ("b", "a")
    assert d_long.outcome == "seat_fit"
    assert d_long.best.need_tokens == 1072
    assert d_long.best.headroom_tokens == 928
    assert d_long.assessments["a"].can_seat is False


def test_a_repeated_long_prefix_goes_to_the_replica_whose_digest_holds_it():
    request = RequestShape(prompt_len=90, max_tokens=10, prefix_hashes=(11, 12, 13, 14, 15))
    holder = cand("a", kv_tokens_available=1000, prefix_digest=(14, 13, 12, 11))
    roomy = cand("b", kv_tokens_available=3000)
    # holds pages 2..5 but not page 1: no usable hit, only its headroom counts.
    tail_only = cand("c", kv_tokens_available=3500, prefix_digest=(12, 13, 14, 15))

    d = rank(request, [roomy, tail_only, holder])
    assert d.ranking == ("a", "c", "b")
    assert d.outcome == "prefix_hit"
    assert d.best.replica_id == "a"
    assert d.best.hit_pages == 4
    assert d.best.need_tokens == 48


def test_more_prefix_pages_win_over_more_headroom():
    request = RequestShape(prompt_len=64, max_tokens=16, prefix_hashes=(1, 2, 3, 4))
    two = cand("a", kv_tokens_available=4000, prefix_digest=(1, 2))
    three = cand("b", kv_tokens_available=200, prefix_digest=(1, 2, 3))
    assert rank(request, [two, three]).ranking == ("b", "a")


def test_routed_since_tokens_make_a_fresh_looking_replica_full():
    request = RequestShape(prompt_len=400, max_tokens=100)  # 500 -> 512
    a_fresh = cand("a", kv_tokens_available=1000)
    b = cand("b", kv_tokens_available=800)
    assert rank(request, [a_fresh, b]).ranking == ("a", "b")

    a_after_routing = cand("a", kv_tokens_available=1000, routed=(1, 600))
    d = rank(request, [a_after_routing, b])
    assert d.ranking == ("b", "a")
    assert d.assessments["a"].headroom_tokens == -112
    assert d.assessments["a"].can_seat is False


def test_routed_since_requests_use_up_free_slots():
    request = RequestShape(prompt_len=16, max_tokens=16)
    a = cand("a", free_slots=2, routed=(2, 64), kv_tokens_available=4096)
    b = cand("b", free_slots=1, kv_tokens_available=100)
    d = rank(request, [a, b])
    assert d.ranking == ("b", "a")
    assert d.assessments["a"].can_seat is False


def test_a_replica_with_its_recurrent_slots_exhausted_is_not_chosen():
    request = RequestShape(prompt_len=16, max_tokens=16)
    exhausted = cand("a", kv_tokens_available=4096, recurrent_slots_available=2)
    enough = cand("b", kv_tokens_available=500, recurrent_slots_available=6, routed=(1, 32))
    d = rank(request, [exhausted, enough])
    assert d.ranking == ("b", "a")
    assert d.outcome == "seat_fit"

    # one more routed request there and 6 slots no longer cover 3 + 3 * 2.
    enough_no_more = replace(enough, routed_requests=2)
    assert rank(request, [exhausted, enough_no_more]).outcome == "wait"


def test_a_window_pool_without_a_free_page_after_routed_requests_cannot_seat():
    request = RequestShape(prompt_len=16, max_tokens=16)
    no_page = cand("a", kv_tokens_available=4096, swa_tokens_available=15)
    one_page = cand("b", kv_tokens_available=500, swa_tokens_available=32, routed=(1, 32))
    d = rank(request, [no_page, one_page])
    assert d.ranking == ("b", "a")
    assert d.assessments["a"].can_seat is False
    assert d.assessments["b"].can_seat is True


# -- nobody can seat it: the shortest expected wait -----------------------------


def test_when_no_replica_can_seat_the_shortest_expected_wait_goes_first():
    request = RequestShape(prompt_len=400, max_tokens=100)  # need 512
    # (512 + 256) / 256 tok/s = 3.0 s
    fast = cand("a", kv_tokens_available=-256, decode_tokens_per_s=256.0, waiting_requests=5)
    # (512 - 0) / 128 tok/s = 4.0 s
    slow = cand("b", kv_tokens_available=0, decode_tokens_per_s=128.0, waiting_requests=1)
    # slot-bound: 2 waiting + 1 - 0 free = 3 requests * 512 / 512 tok/s = 3.0 s
    no_slots = cand("c", free_slots=0, waiting_requests=2, kv_tokens_available=4096, decode_tokens_per_s=512.0)

    d = rank(request, [slow, fast, no_slots])
    assert d.outcome == "wait"
    # "a" and "c" tie at 3.0 s; "c" has fewer waiting requests.
    assert d.ranking == ("c", "a", "b")
    assert d.assessments["a"].wait_s == 3.0
    assert d.assessments["b"].wait_s == 4.0
    assert d.assessments["c"].wait_s == 3.0
    assert d.best.replica_id == "c"


def test_expected_wait_counts_routed_tokens_and_floors_the_decode_rate():
    s = snap("a", kv_tokens_available=100, decode_tokens_per_s=0.0)
    assert expected_wait_s(s, need_tokens=64) == 0.0
    # 64 + 100 routed - 100 available = 64 tokens at the 1 tok/s floor.
    assert expected_wait_s(s, need_tokens=64, routed_requests=1, routed_tokens=100) == 64.0
    assert expected_wait_s(s, need_tokens=64, routed_tokens=100, min_decode_tokens_per_s=32.0) == 2.0


# -- missing, stale or unhealthy snapshots --------------------------------------


def test_stale_and_missing_stats_fall_back_to_queue_length_without_raising():
    request = RequestShape(prompt_len=16, max_tokens=16)
    stale = cand("a", age_s=STALE + 0.5, queue_len=3)
    missing = Candidate(replica_id="b", snapshot=None, queue_len=1)
    unknown_queue = Candidate(replica_id="c", snapshot=None, queue_len=None)
    d = rank(request, [stale, missing, unknown_queue])
    assert d.ranking == ("c", "b", "a")
    assert d.outcome == "fallback"
    assert d.best is None


def test_a_call_that_is_not_a_generate_request_is_ranked_by_queue_length():
    full = cand("a", kv_tokens_available=0, queue_len=0)
    roomy = cand("b", kv_tokens_available=4096, queue_len=2)
    d = rank(None, [roomy, full])
    assert d.ranking == ("a", "b")
    assert d.outcome == "fallback"
    assert rank_by_queue([roomy, full]) == d


def test_a_fresh_replica_that_can_seat_goes_before_one_without_stats():
    request = RequestShape(prompt_len=16, max_tokens=16)
    missing = Candidate(replica_id="a", snapshot=None, queue_len=0)
    fresh = cand("b", queue_len=7)
    d = rank(request, [missing, fresh])
    assert d.ranking == ("b", "a")
    assert d.outcome == "seat_fit"


def test_a_replica_without_stats_goes_before_one_known_to_be_full():
    request = RequestShape(prompt_len=16, max_tokens=16)
    missing = Candidate(replica_id="b", snapshot=None, queue_len=4)
    full = cand("a", kv_tokens_available=0, decode_tokens_per_s=100.0)
    d = rank(request, [full, missing])
    assert d.ranking == ("b", "a")
    assert d.outcome == "fallback"


def test_an_unhealthy_replica_is_ranked_last():
    request = RequestShape(prompt_len=16, max_tokens=16)
    sick = cand("a", healthy=False, kv_tokens_available=4096)
    full = cand("b", kv_tokens_available=0)
    missing = Candidate(replica_id="c", snapshot=None, queue_len=9)
    assert rank(request, [sick, full, missing]).ranking == ("c", "b", "a")


def test_no_candidates_gives_an_empty_fallback():
    d = rank(RequestShape(prompt_len=1, max_tokens=1), [])
    assert d.ranking == ()
    assert d.outcome == "fallback"


# -- determinism ----------------------------------------------------------------


@pytest.mark.parametrize("order", [("b", "a", "c"), ("c", "b", "a"), ("a", "c", "b")])
def test_equal_replicas_are_ranked_by_replica_id_whatever_the_input_order(order):
    request = RequestShape(prompt_len=32, max_tokens=32, prefix_hashes=(1, 2))
    d = rank(request, [cand(rid) for rid in order])
    assert d.ranking == ("a", "b", "c")
    assert d.outcome == "seat_fit"


# -- the routed-since ledger ---------------------------------------------------


def test_a_snapshot_settles_only_the_requests_routed_before_it():
    ledger = RoutedLedger()
    ledger.routed("r1", "a", 64, at=10.0)
    ledger.routed("r2", "a", 128, at=12.0)
    assert ledger.totals("a") == (2, 192)
    assert ledger.settle("a", snapshot_timestamp=11.0) == 1
    assert ledger.totals("a") == (1, 128)
    # settled requests are still in flight until they complete.
    assert ledger.in_flight("a") == 2


def test_requests_ranked_in_a_burst_count_in_flight_before_serve_sends_them():
    ledger = RoutedLedger()
    ledger.record("r1", "a", 32, at=10.0)
    ledger.routed("r2", "a", 32, at=10.1)
    assert ledger.in_flight("a") == 2
    # once a snapshot counts r1, only requests actually sent stay in flight.
    ledger.settle("a", snapshot_timestamp=10.5)
    assert ledger.in_flight("a") == 1


def test_a_completed_request_leaves_both_books():
    ledger = RoutedLedger()
    ledger.routed("r1", "a", 64, at=10.0)
    ledger.completed("r1", "a")
    assert ledger.totals("a") == (0, 0)
    assert ledger.in_flight("a") == 0


def test_a_provisional_entry_moves_to_the_replica_that_accepted():
    ledger = RoutedLedger()
    ledger.record("r1", "a", 64, at=10.0)
    assert ledger.totals("a") == (1, 64)
    assert ledger.in_flight("a") == 1
    ledger.routed("r1", "b", 80, at=10.5)
    assert ledger.totals("a") == (0, 0)
    assert ledger.totals("b") == (1, 80)
    assert ledger.in_flight("b") == 1


def test_a_late_refusal_does_not_drop_the_requests_new_entry_elsewhere():
    ledger = RoutedLedger()
    ledger.record("r1", "a", 64, at=10.0)
    ledger.record("r1", "b", 64, at=10.2)  # re-ranked after "a" refused
    ledger.completed("r1", "a")  # the refusal is reported afterwards
    assert ledger.totals("b") == (1, 64)


def test_calls_that_take_no_slot_count_in_flight_only():
    ledger = RoutedLedger()
    ledger.routed("h1", "a", 0, at=10.0, counts_capacity=False)
    assert ledger.totals("a") == (0, 0)
    assert ledger.in_flight("a") == 1


def test_replicas_that_left_are_forgotten():
    ledger = RoutedLedger()
    ledger.routed("r1", "a", 64, at=10.0)
    ledger.routed("r2", "b", 64, at=10.0)
    ledger.retain(["b"])
    assert ledger.totals("a") == (0, 0)
    assert ledger.in_flight("a") == 0
    assert ledger.totals("b") == (1, 64)


def test_ledger_totals_feed_the_policy_until_a_newer_snapshot_counts_them():
    request = RequestShape(prompt_len=400, max_tokens=100)  # need 512
    ledger = RoutedLedger()
    ledger.routed("r1", "a", 512, at=100.5)
    a_snap = snap("a", kv_tokens_available=1000, timestamp=100.0)
    b_snap = snap("b", kv_tokens_available=600, timestamp=100.0)

    def candidates(a_snapshot):
        ledger.settle("a", a_snapshot.timestamp)
        n, t = ledger.totals("a")
        return [
            Candidate("a", a_snapshot, 0.1, n, t),
            Candidate("b", b_snap, 0.1),
        ]

    assert rank(request, candidates(a_snap)).ranking == ("b", "a")
    # the next snapshot from "a" already counts r1's reservation.
    newer = replace(a_snap, seq=2, timestamp=101.0, kv_tokens_available=488)
    assert rank(request, candidates(newer)).ranking == ("b", "a")
    assert ledger.totals("a") == (0, 0)
    newest = replace(a_snap, seq=3, timestamp=102.0, kv_tokens_available=1000)
    assert rank(request, candidates(newest)).ranking == ("a", "b")


def test_a_burst_without_fresh_stats_alternates_between_replicas():
    ledger = RoutedLedger()
    request = RequestShape(prompt_len=16, max_tokens=16)
    picks = []
    for i in range(4):
        candidates = [Candidate(r, None, queue_len=ledger.in_flight(r)) for r in ("a", "b")]
        top = rank(request, candidates).ranking[0]
        ledger.record(f"r{i}", top, 32, at=10.0 + i)
        picks.append(top)
    assert picks == ["a", "b", "a", "b"]


def test_a_burst_between_snapshots_alternates_between_equal_replicas():
    ledger = RoutedLedger()
    request = RequestShape(prompt_len=16, max_tokens=16)  # need 32
    picks = []
    for i in range(4):
        candidates = [
            Candidate(r, snap(r, timestamp=9.0), 0.1, *ledger.totals(r)) for r in ("a", "b")
        ]
        d = rank(request, candidates)
        ledger.record(f"r{i}", d.ranking[0], d.best.need_tokens, at=10.0 + i)
        picks.append(d.ranking[0])
    assert picks == ["a", "b", "a", "b"]


def test_a_prefix_hit_wins_only_while_its_replica_is_within_the_imbalance_bound():
    # Found by a user test: SmolLM2's chat template puts a one-page default
    # system prompt in every chat, so the replica that cached it first took
    # every chat request while the other stayed idle.
    request = RequestShape(prompt_len=30, max_tokens=16, prefix_hashes=(7,))
    assert PREFIX_IMBALANCE_REQUESTS == 4
    near = [cand("a", prefix_digest=(7,), running_requests=4, free_slots=4), cand("b")]
    decision = rank_replicas(request, near, stale_after_s=STALE)
    assert (decision.ranking, decision.outcome) == (("a", "b"), "prefix_hit")
    far = [cand("a", prefix_digest=(7,), running_requests=4, free_slots=4, routed=(1, 32)), cand("b")]
    decision = rank_replicas(request, far, stale_after_s=STALE)
    assert (decision.ranking, decision.outcome) == (("b", "a"), "seat_fit")
    assert (decision.assessments["a"].load, decision.assessments["b"].load) == (5, 0)
