"""Scheduler: plan -> pages -> ScheduledStep -> commit, over token ids, as the engine drives it."""

from __future__ import annotations

import pytest

from ferrox.scheduler.admission import NotAdmitted
from ferrox.scheduler.core import ScheduledSeq, ScheduledStep, Scheduler, SchedulerConfig
from ferrox.scheduler.planner import RequestRefused

PROMPT = list(range(100, 110))  # 10 tokens: two full pages of 4 and a partial one


def scheduler(**overrides) -> Scheduler:
    values = dict(page_size=4, num_pages=16, max_slots=2, max_prefill_tokens=8, max_model_len=100)
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def test_a_request_goes_from_chunked_prefill_through_decode_to_the_prefix_cache():
    s = scheduler()
    s.add_request(1, PROMPT, 3)
    first = s.schedule()
    assert first == ScheduledStep(
        "prefill", (ScheduledSeq(1, 1, 0, tuple(range(100, 108)), (0, 1), samples=False, admission=(10, 0)),)
    )
    assert s.commit(first, {}) == []
    second = s.schedule()
    assert second == ScheduledStep("prefill", (ScheduledSeq(1, 1, 8, (108, 109), (0, 1, 2), samples=True),))
    assert s.commit(second, {1: 500}) == []
    third = s.schedule()
    assert third == ScheduledStep("decode", (ScheduledSeq(1, 1, 10, (500,), (0, 1, 2), samples=True),))
    assert s.commit(third, {1: 501}) == []
    fourth = s.schedule()
    assert fourth == ScheduledStep("decode", (ScheduledSeq(1, 1, 11, (501,), (0, 1, 2), samples=True),))
    assert s.commit(fourth, {1: 502}) == [1], "the third token spent the budget"
    assert s.schedule() is None
    s.kv.check_idle()
    # KV was computed for 12 positions (the last token, 502, was never fed): three whole pages.
    assert s.kv.cache.cached_tokens == 12
    assert not s.has_request(1)


def test_a_prompt_on_a_cached_prefix_starts_after_it():
    s = scheduler(max_prefill_tokens=64)
    s.add_request(1, PROMPT, 3)
    for sampled in ({1: 500}, {1: 501}, {1: 502}):
        s.commit(s.schedule(), sampled)
    s.add_request(2, PROMPT + [500, 501, 7], 2)
    step = s.schedule()
    (seq,) = step.seqs
    assert (seq.computed_len, seq.query_tokens, seq.admission) == (12, (7,), (13, 12))
    assert seq.pages[:3] == (0, 1, 2), "the cached pages, shared"
    assert s.kv.cache.evictable_tokens == 0, "locked while request 2 uses them"
    s.commit(step, {2: 9})
    s.commit(s.schedule(), {2: 9})
    s.kv.check_idle()


def test_a_step_whose_sampled_token_is_missing_is_refused_whole():
    s = scheduler(max_prefill_tokens=64)
    s.add_request(1, PROMPT, 3)
    s.add_request(2, PROMPT[:5], 3)
    step = s.schedule()
    with pytest.raises(ValueError, match=r"no sampled token for request\(s\) \[2\] of this step"):
        s.commit(step, {1: 7})
    assert s.tokens(1) == PROMPT, "nothing was committed"
    assert s.commit(step, {1: 7, 2: 8}) == []
    assert (s.tokens(1)[-1], s.tokens(2)[-1]) == (7, 8)


def test_a_prompt_stopped_between_chunks_caches_only_its_computed_whole_pages():
    s = scheduler(max_prefill_tokens=6)
    s.add_request(1, PROMPT, 5)
    step = s.schedule()
    assert step.seqs[0].seq_len == 6
    assert s.commit(step, {}, stopped=[1]) == [1]
    s.kv.check_idle()
    assert s.kv.cache.cached_tokens == 4, "positions 4 and 5 of the second page were computed, 6 and 7 not"
    assert s.kv.match(PROMPT).cached_len == 4


def test_a_request_stopped_early_is_released_with_its_pages_cached():
    s = scheduler(max_prefill_tokens=64)
    s.add_request(1, PROMPT, 50)
    s.commit(s.schedule(), {1: 5})
    step = s.schedule()
    assert s.commit(step, {1: 6}, stopped=[1]) == [1]
    assert s.planner.num_running == 0
    s.kv.check_idle()
    assert s.kv.cache.cached_tokens == 8, "11 positions computed: two whole pages"


def test_aborting_at_any_stage_gives_everything_back():
    s = scheduler(max_prefill_tokens=4)
    s.add_request(1, PROMPT, 5)  # will be mid-prefill
    s.add_request(2, PROMPT[:3], 5)  # will be waiting
    s.commit(s.schedule(), {})
    assert s.abort(1) is True
    assert s.abort(2) is True
    assert s.abort(3) is False
    assert s.schedule() is None
    s.kv.check_idle()
    assert s.kv.cache.cached_tokens == 0, "an aborted request caches nothing"
    s.add_request(3, PROMPT[:2], 3)
    s.commit(s.schedule(), {3: 1})
    assert s.abort(3) is True, "and while decoding"
    s.kv.check_idle()
    assert s.planner.slots.available == 2


def test_a_request_id_stays_taken_until_the_step_that_ends_it_is_committed():
    s = scheduler()
    s.add_request(1, PROMPT[:4], 1)
    step = s.schedule()  # the planner lets go of request 1 here: its one token is this step's
    with pytest.raises(RequestRefused, match="request 1 is already queued or running") as info:
        s.add_request(1, PROMPT[:4], 1)
    assert info.value.reason == "duplicate"
    assert s.commit(step, {1: 3}) == [1]
    s.add_request(1, PROMPT[:4], 1)


def test_the_blocked_reason_of_each_step_is_kept():
    s = scheduler(max_slots=1, max_prefill_tokens=64)
    s.add_request(1, PROMPT, 2)
    s.add_request(2, PROMPT, 2)
    step = s.schedule()
    assert step.blocked is NotAdmitted.NO_REQUEST_SLOT
    s.commit(step, {1: 1})
    step = s.schedule()
    assert (step.kind, step.blocked, s.last_blocked) == ("decode", NotAdmitted.NO_REQUEST_SLOT, NotAdmitted.NO_REQUEST_SLOT)


def test_a_window_chunk_keeps_the_pages_its_first_query_attends_to():
    s = scheduler(sliding_window=8, num_swa_pages=16, max_prefill_tokens=16, num_pages=32)
    s.add_request(1, list(range(40)), 2)
    first = s.schedule()
    assert (first.seqs[0].swa_start, first.seqs[0].swa_pages) == (0, (0, 1, 2, 3))
    s.commit(first, {})
    (seq,) = s.schedule().seqs
    # The query at 16 reads keys 9..16; after step one, keys before 16 - 8 - 4 = 4 slid out.
    assert (seq.computed_len, seq.swa_start, len(seq.swa_pages)) == (16, 4, 7)


def test_integrity_fails_when_the_planner_and_the_scheduler_disagree():
    s = scheduler()
    s.add_request(1, PROMPT, 3)
    s.planner.abort(1)  # behind the scheduler's back
    with pytest.raises(AssertionError, match="request 1 is held by the scheduler but not the planner"):
        s.check_integrity()
