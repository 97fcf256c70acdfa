"""Prefix caching for window and recurrent models: window pages and recurrent
snapshots cached beside the full pages, matched only where usable, shared,
restored, evicted on their own, and never leaked."""

from __future__ import annotations

from ferrox.scheduler.core import Scheduler, SchedulerConfig
from ferrox.scheduler.radix import SIDE_STATE, SIDE_WINDOW


def scheduler(**overrides) -> Scheduler:
    values = dict(page_size=4, num_pages=16, max_slots=2, max_prefill_tokens=64, max_model_len=100)
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def run(s: Scheduler, uid: int, prompt: list[int], max_tokens: int) -> list:
    """Run one request to its end alone; sampled tokens are 500, 501, ... Returns its steps."""
    s.add_request(uid, prompt, max_tokens)
    steps = []
    while s.has_request(uid):
        step = s.schedule()
        steps.append(step)
        s.commit(step, {q.uid: 499 + len(steps) for q in step.seqs if q.samples})
        s.check_integrity()
    return steps


def shape(step) -> list[tuple]:
    return [(q.computed_len, len(q.query_tokens), q.recurrent_slots, q.restore_slot, q.snapshots) for q in step.seqs]


PROMPT = list(range(100, 110))  # 10 tokens; pages of 4: its last prompt boundary is 8


# ------------------------------------------------------------- recurrent
def test_a_recurrent_request_snapshots_its_last_prompt_boundary_and_its_latest_boundary():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    steps = run(s, 1, PROMPT, 6)
    assert [shape(step) for step in steps] == [
        [(0, 10, (0, 1, 2), -1, ((8, 1),))],  # the state after 8 prompt tokens -> slot 1, inside the chunk
        [(10, 1, (0, 1, 2), -1, ())],
        [(11, 1, (0, 1, 2), -1, ((1, 2),))],  # position 11 ends page 3: latest snapshot -> slot 2
        [(12, 1, (0, 1, 2), -1, ())],
        [(13, 1, (0, 1, 2), -1, ())],
        [(14, 1, (0, 1, 2), -1, ())],
    ]
    # 15 positions computed: three whole pages cached, snapshots at 8 and 12 with them.
    assert s.kv.cache.cached_tokens == 12
    assert sorted(s.kv.cache.all_side(SIDE_STATE)) == [1, 2]
    assert s.kv.recurrent.num_free == 4, "the live slot went back to the pool"
    s.kv.check_idle()


def test_a_repeated_recurrent_prompt_resumes_from_the_prompt_snapshot():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    run(s, 1, PROMPT, 6)
    steps = run(s, 2, PROMPT, 2)
    assert shape(steps[0]) == [(8, 2, (0, 3, 4), 1, ())], "restores slot 1, computes tokens 8 and 9 only"
    assert steps[0].seqs[0].admission == (10, 8)
    s.kv.check_idle()


def test_a_follow_up_turn_resumes_from_the_latest_snapshot():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    run(s, 1, PROMPT, 6)  # tokens: PROMPT + 500..505, positions 0..14 computed
    turn = PROMPT + [500, 501, 502, 503, 504, 505, 7, 8]
    steps = run(s, 2, turn, 1)
    assert shape(steps[0]) == [(12, 6, (0, 3, 4), 2, ((4, 3),))], (
        "restores slot 2 (state after 12 tokens); the new prompt's own boundary 16 goes to its slot 1"
    )
    s.kv.check_idle()


def test_a_cached_prefix_without_a_snapshot_at_its_end_is_cut_back_to_one():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    run(s, 1, PROMPT, 6)
    # Three cached pages match, and a snapshot ends at 12:
    assert s.kv.match(PROMPT + [500, 501, 9, 9, 9]).cached_len == 12
    # Diverging inside page 3: the full-page match is 8 tokens, which has the prompt snapshot.
    assert s.kv.match(PROMPT + [500, 9, 9, 9]).cached_len == 8
    # Diverging inside page 2: 4 tokens match, but no snapshot ends there, so nothing is usable.
    assert s.kv.match(PROMPT[:6] + [9, 9, 9]).cached_len == 0


def test_cached_snapshots_are_evicted_when_new_requests_need_their_slots():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    run(s, 1, PROMPT, 6)
    assert s.kv.capacity(2).recurrent_slots == 6, "4 free + 2 evictable snapshots"
    s.add_request(2, list(range(200, 210)), 2)
    s.add_request(3, list(range(300, 310)), 2)
    step = s.schedule()
    assert len(step.seqs) == 2, "both admitted: they take the 4 free slots and evict the 2 snapshots"
    assert s.kv.cache.side_count(SIDE_STATE) == 0
    assert s.kv.cache.cached_tokens == 12, "the pages stay, as tombstones of their snapshots"
    assert s.kv.match(PROMPT).cached_len == 0, "without a snapshot the prefix is no longer usable"
    s.abort(2)
    s.abort(3)
    s.kv.check_idle()


def test_a_locked_snapshot_is_not_evictable_and_the_planner_does_not_count_it():
    s = scheduler(recurrent=True, num_recurrent_slots=6, max_slots=3)
    run(s, 1, PROMPT, 6)
    # Request 2 hits the prompt snapshot (slot 1) and takes 3 slots: 1 free slot and
    # the unlocked latest snapshot remain, too few for a third request.
    s.add_request(2, PROMPT, 4)
    s.add_request(3, list(range(200, 210)), 2)
    step = s.schedule()
    assert [q.uid for q in step.seqs] == [2]
    assert step.blocked is not None and step.blocked.value == "recurrent_budget"
    assert s.kv.capacity(1).recurrent_slots == 2
    s.check_integrity()
    s.abort(2)
    s.abort(3)
    s.kv.check_idle()


def test_a_window_request_unlocks_shared_pages_as_its_window_slides_past_them():
    s = scheduler(sliding_window=8, num_swa_pages=16)
    run(s, 1, PROMPT, 2)  # caches pages 0..8 with window pages 0 and 1
    s.add_request(2, PROMPT, 12)
    step = s.schedule()
    assert s.kv.capacity(2).swa_tokens == 13 * 4, "13 free; both cached window pages locked"
    sampled = 500
    while step.seqs[0].computed_len < 16:
        s.commit(step, {2: sampled})
        sampled += 1
        step = s.schedule()
    # At 16 computed the window starts at 4: page 0 (positions 0..4) went back to being evictable.
    assert s.kv.request(2).swa_start == 4 and s.kv.cache.side_evictable(SIDE_WINDOW) == 1
    s.abort(2)
    s.kv.check_idle()
    assert s.kv.cache.side_evictable(SIDE_WINDOW) == 2


def test_the_second_request_on_the_same_window_prefix_is_admitted_without_stalling():
    # Found by the property tests: a hit that locks the pool's last evictable
    # window page must not be refused for the room that page took.
    s = scheduler(page_size=1, num_pages=8, max_slots=1, max_prefill_tokens=1, sliding_window=1, num_swa_pages=4)
    run(s, 0, [7, 8], 1)
    steps = run(s, 1, [7, 9], 2)
    assert steps[0].seqs[0].admission == (2, 1)
    s.kv.check_idle()


def test_an_aborted_recurrent_request_caches_nothing_and_leaks_nothing():
    s = scheduler(recurrent=True, num_recurrent_slots=6)
    s.add_request(1, PROMPT, 6)
    step = s.schedule()
    s.commit(step, {1: 500})
    s.abort(1)
    s.kv.check_idle()
    assert s.kv.recurrent.num_free == 6 and s.kv.cache.cached_tokens == 0


# ---------------------------------------------------------------- window
def test_a_finished_window_request_caches_the_window_pages_it_still_holds():
    s = scheduler(sliding_window=8, num_swa_pages=16)
    prompt = list(range(100, 120))
    steps = run(s, 1, prompt, 4)
    assert [(q.computed_len, q.swa_start, q.swa_pages) for st in steps for q in st.seqs] == [
        (0, 0, (0, 1, 2, 3, 4)),
        (20, 8, (2, 3, 4, 1)),  # pages before 20 - 8 - 4 slid out and went back to the pool
        (21, 8, (2, 3, 4, 1)),
        (22, 8, (2, 3, 4, 1)),
    ]
    # 23 positions computed: five whole pages cached; window pages for pages 2..4 (positions 8..20).
    assert s.kv.cache.cached_tokens == 20
    assert sorted(s.kv.cache.all_side(SIDE_WINDOW)) == [2, 3, 4]
    assert s.kv.swa_pages.num_free == 13
    s.kv.check_idle()


def test_a_window_conversation_continues_on_its_cached_window_pages():
    s = scheduler(sliding_window=8, num_swa_pages=16)
    prompt = list(range(100, 120))
    run(s, 1, prompt, 4)
    turn = prompt + [500, 501, 502, 7, 8]
    steps = run(s, 2, turn, 3)
    (first,) = steps[0].seqs
    assert (first.computed_len, first.swa_start, first.swa_pages) == (20, 8, (2, 3, 4, 1, 0)), (
        "the window from 8 comes from the cache (pages 2, 3, 4), shared; new pages follow"
    )
    assert first.admission == (25, 20)
    assert s.kv.window_held(2) == 0, "released"
    # Request 2 computed 26 positions: its window pages for page 5 (20..24) joined the cached ones.
    assert sorted(s.kv.cache.all_side(SIDE_WINDOW)) == [1, 2, 3, 4]
    assert s.kv.swa_pages.num_free == 12
    s.kv.check_idle()


def test_a_window_prefix_whose_window_slid_out_is_not_usable():
    s = scheduler(sliding_window=8, num_swa_pages=16)
    prompt = list(range(100, 120))
    run(s, 1, prompt, 4)
    # The same prompt would resume at 16 and needs window pages from 4; pages 0 and 1 slid out.
    assert s.kv.match(prompt).cached_len == 0


def test_a_short_window_prompt_is_reused_with_its_window_pages():
    s = scheduler(sliding_window=8, num_swa_pages=16)
    run(s, 1, PROMPT, 2)
    hit = s.kv.match(PROMPT)
    assert (hit.cached_len, hit.swa_evictable_len) == (8, 8)
    s.add_request(2, PROMPT, 2)
    (seq,) = s.schedule().seqs
    assert (seq.computed_len, seq.swa_start, seq.swa_pages) == (8, 0, (0, 1, 2))
    assert s.kv.window_held(2) == 12, "the two shared pages count as held, with the new one"
    assert s.kv.capacity(2).swa_tokens == 13 * 4, "13 free pages; the shared two are locked"
    s.abort(2)
    s.kv.check_idle()


def test_cached_window_pages_are_evicted_when_the_window_pool_runs_short():
    s = scheduler(sliding_window=8, num_swa_pages=6, num_pages=32)
    run(s, 1, PROMPT, 2)
    assert s.kv.cache.side_count(SIDE_WINDOW) == 2 and s.kv.swa_pages.num_free == 4
    # A new prompt of 20 tokens needs 5 window pages at once: the least recently
    # used cached page (of PROMPT's page 1; deepest first within one use) is dropped.
    run(s, 2, list(range(200, 220)), 1)
    assert s.kv.match(PROMPT).cached_len == 4, "page 0 keeps its window page; page 1 is a tombstone"
    # Request 2 kept pages for 8..20 after its window slid: cached with its full pages.
    assert s.kv.cache.side_count(SIDE_WINDOW) == 4 and s.kv.swa_pages.num_free == 2
    s.kv.check_idle()


def test_a_hit_whose_snapshot_the_pool_cannot_also_hold_runs_uncached():
    # Found by the property tests: 3 slots, two cached snapshots (at 1 and 2)
    # and one free. Locking the one at 1 would leave 2 for a request that
    # needs 3, so the hit is declined; both snapshots are evicted instead.
    s = scheduler(page_size=1, num_pages=8, max_slots=1, max_prefill_tokens=1, recurrent=True, num_recurrent_slots=3)
    run(s, 0, [7, 8], 1)
    assert s.kv.match([7, 9]).cached_len == 1 and s.kv.cache.side_count(SIDE_STATE) == 2
    steps = run(s, 1, [7, 9], 1)
    assert steps[0].seqs[0].admission == (2, 0)
    assert steps[0].seqs[0].restore_slot == -1
    s.kv.check_idle()
