"""StepPlanner: refusals at arrival, prefill-first steps, FIFO admission, and what one pass charges."""

from __future__ import annotations

import pytest

from ferrox.scheduler.admission import (
    AdmittedChunk,
    Capacity,
    DecodingRequest,
    Geometry,
    NotAdmitted,
    PromptAdmission,
)
from ferrox.scheduler.planner import DecodeStep, IdleStep, PrefillStep, PrefixHit, RequestRefused, StepPlanner


def planner(**overrides) -> StepPlanner:
    kwargs = dict(
        geometry=Geometry(page_size=16),
        max_slots=4,
        max_prefill_tokens=512,
        max_model_len=4096,
        kv_pool_tokens=1600,
    )
    kwargs.update(overrides)
    return StepPlanner(**kwargs)


def roomy(**overrides) -> Capacity:
    values = dict(request_slots=0, kv_tokens=100_000, swa_tokens=100_000, recurrent_slots=64)
    values.update(overrides)
    return Capacity(**values)


def refusal(p: StepPlanner, uid: int, prompt_len: int, output_len: int) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        p.add_request(uid, prompt_len, output_len)
    return info.value


# ------------------------------------------------------------------ arrivals
def test_a_request_beyond_the_context_length_is_refused_with_both_numbers():
    err = refusal(planner(), 1, 4000, 200)
    assert (err.reason, err.requested, err.limit) == ("context_length", 4200, 4096)
    assert str(err) == (
        "prompt (4000 tokens) + max_tokens (200) = 4200 tokens exceeds the context length of 4096 tokens"
    )


def test_a_request_the_whole_kv_pool_cannot_hold_is_refused_at_arrival():
    p = planner()
    p.add_request(1, 1500, 100)  # 1600 tokens: exactly 100 pages
    err = refusal(p, 2, 1500, 101)  # 1601 tokens round up to 101 pages
    assert (err.reason, err.requested, err.limit) == ("kv_pool", 1601, 1600)
    assert str(err) == (
        "prompt (1500 tokens) + max_tokens (101) = 1601 tokens can never fit this replica's KV pool of 1600 tokens"
    )
    assert p.waiting_uids() == [1]


def test_a_window_request_the_window_pool_cannot_seat_is_refused_at_arrival():
    p = planner(geometry=Geometry(page_size=16, sliding_window=512), kv_pool_tokens=10_000, swa_pool_tokens=1000)
    err = refusal(p, 1, 2000, 100)
    # min(ceil16(2100), 512 + 2 * 16 + 512) = 1056 window tokens.
    assert (err.reason, err.requested, err.limit) == ("window_pool", 1056, 1000)
    assert str(err) == "the request needs 1056 window-pool tokens; the pool holds 1000"
    p.add_request(2, 100, 20)  # 128 window tokens at most


def test_a_recurrent_request_needs_a_pool_of_three_slots():
    err = refusal(planner(geometry=Geometry(page_size=16, recurrent=True), recurrent_pool_slots=2), 1, 10, 10)
    assert (err.reason, err.requested, err.limit) == ("recurrent_pool", 3, 2)
    assert str(err) == "a request needs 3 recurrent slots; the pool holds 2"


def test_empty_prompts_zero_budgets_and_duplicate_ids_are_refused():
    p = planner()
    assert refusal(p, 1, 0, 5).reason == "empty_prompt"
    err = refusal(p, 1, 5, 0)
    assert (err.reason, str(err)) == ("bad_max_tokens", "max_tokens must be at least 1, got 0")
    p.add_request(1, 5, 5)
    err = refusal(p, 1, 5, 5)
    assert (err.reason, str(err)) == ("duplicate", "request 1 is already queued or running")


def test_a_full_queue_refuses_new_arrivals_but_not_admitted_ones():
    p = planner(max_waiting=2, max_prefill_tokens=16)
    p.add_request(1, 40, 1)
    p.add_request(2, 8, 1)
    err = refusal(p, 3, 8, 1)
    assert (err.reason, err.requested, err.limit) == ("queue_full", 3, 2)
    assert str(err) == "2 requests are already waiting (limit 2)"
    p.plan(roomy())  # request 1 is admitted and chunked: it no longer counts as waiting
    assert (p.num_waiting, p.num_waiting_new) == (2, 1)
    p.add_request(3, 8, 1)


def test_planner_sizes_are_checked():
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        planner(max_prefill_tokens=0)
    with pytest.raises(ValueError, match=r"at least one page \(16 tokens\), got 15"):
        planner(geometry=Geometry(page_size=16, sliding_window=64), max_prefill_tokens=15)


# --------------------------------------------------------------------- steps
def test_prefill_runs_first_then_every_running_request_decodes_in_uid_order():
    p = planner()
    p.add_request(5, 40, 3)
    p.add_request(2, 20, 1)
    p.add_request(9, 30, 2)
    step = p.plan(roomy())
    assert step == PrefillStep(
        (
            AdmittedChunk(5, 3, 0, 40, False, PromptAdmission(5, 40, 0)),
            AdmittedChunk(2, 2, 0, 20, False, PromptAdmission(2, 20, 0)),
            AdmittedChunk(9, 1, 0, 30, False, PromptAdmission(9, 30, 0)),
        )
    )
    # Request 2's only token came from its prefill: it is done and its slot is back.
    assert (p.num_running, p.slots.available, p.slot_of(2)) == (2, 2, None)
    assert p.inflight_tokens() == (2 + 15) + (1 + 15)

    assert p.decode.next_batch() == [DecodingRequest(5, 2), DecodingRequest(9, 1)]
    assert p.plan(roomy()) == DecodeStep((5, 9))
    assert (p.num_running, p.slot_of(9)) == (1, None), "request 9's last token was this step's"
    assert p.decode.next_batch() == [DecodingRequest(5, 1)]
    assert p.plan(roomy()) == DecodeStep((5,))
    assert p.plan(roomy()) == IdleStep()
    assert (p.num_running, p.slots.available, p.inflight_tokens()) == (0, 4, 0)


def test_a_long_prompt_is_chunked_and_stays_at_the_head_of_the_queue():
    p = planner(max_prefill_tokens=100)
    p.add_request(1, 250, 10)
    p.add_request(2, 30, 5)
    first = p.plan(roomy())
    assert first == PrefillStep(
        (AdmittedChunk(1, 3, 0, 100, True, PromptAdmission(1, 250, 0)),), blocked=NotAdmitted.BUDGET_SPENT
    )
    assert p.inflight_tokens() == (250 - 100) + 10 + 15, "the rest of the prompt, the output, a page"
    assert (p.num_waiting, p.num_waiting_new, p.waiting_tokens) == (2, 1, 35)
    assert p.pending(1).chunk.computed_len == 100
    second = p.plan(roomy())
    assert second == PrefillStep((AdmittedChunk(1, 3, 100, 100, True, None),), blocked=NotAdmitted.BUDGET_SPENT)
    third = p.plan(roomy())
    assert third == PrefillStep(
        (AdmittedChunk(1, 3, 200, 50, False, None), AdmittedChunk(2, 2, 0, 30, False, PromptAdmission(2, 30, 0)))
    )
    assert p.waiting_uids() == []


def test_the_first_request_that_does_not_fit_blocks_the_ones_behind_it():
    p = planner(max_prefill_tokens=2048)
    p.add_request(1, 800, 200)  # 1000 tokens
    p.add_request(2, 10, 10)
    assert p.plan(roomy(kv_tokens=999)) == IdleStep(NotAdmitted.KV_BUDGET)
    assert p.waiting_uids() == [1, 2], "the small request was not admitted ahead"
    step = p.plan(roomy(kv_tokens=1000 + 8 + 20))  # 8: request 1's reservation rounds up to 1008
    assert [c.uid for c in step.chunks] == [1, 2]


def test_prompts_wait_while_decoding_continues():
    p = planner()
    p.add_request(1, 10, 3)
    p.plan(roomy())
    p.add_request(2, 900, 100)
    assert p.plan(roomy(kv_tokens=1000)) == DecodeStep((1,), blocked=NotAdmitted.KV_BUDGET)


def test_one_pass_charges_each_admissions_request_slot_against_the_next():
    p = planner(max_slots=2)
    for uid in (1, 2, 3):
        p.add_request(uid, 10, 5)
    step = p.plan(roomy())
    assert [c.uid for c in step.chunks] == [1, 2]
    assert step.blocked is NotAdmitted.NO_REQUEST_SLOT


def test_one_pass_charges_three_recurrent_slots_per_admission():
    p = planner(geometry=Geometry(page_size=16, recurrent=True), recurrent_pool_slots=64)
    for uid in (1, 2, 3):
        p.add_request(uid, 10, 5)
    step = p.plan(roomy(recurrent_slots=8))
    assert [c.uid for c in step.chunks] == [1, 2]
    assert step.blocked is NotAdmitted.RECURRENT_BUDGET


def test_one_pass_charges_each_reservations_rounding_to_whole_pages():
    p = planner()
    p.add_request(1, 10, 1)  # 11 tokens, one page: 5 tokens of rounding
    p.add_request(2, 40, 1)  # 41 tokens, three pages: 7 tokens of rounding
    p.add_request(3, 7, 1)  # 8 tokens: 52 + 8 = 60 fit 64 tokens, but not 64 - 5 - 7
    step = p.plan(roomy(kv_tokens=64))
    assert [c.uid for c in step.chunks] == [1, 2]
    assert step.blocked is NotAdmitted.KV_BUDGET


def test_a_prompts_own_evictable_prefix_is_no_room_for_it():
    """The measured kv_tokens count the prompt's matched prefix as evictable;
    once the admission locks it, that room is gone (the counterexample the
    property tests found: an admission that later ran out of pages)."""
    hit = PrefixHit(cached_len=32, evictable_len=32)
    p = planner()
    p.add_request(1, 80, 40)  # 48 to compute + 40 out = 88 to reserve
    assert p.plan(roomy(kv_tokens=100), match=lambda uid: hit) == IdleStep(NotAdmitted.KV_BUDGET)
    step = p.plan(roomy(kv_tokens=120), match=lambda uid: hit)
    assert step.chunks == (AdmittedChunk(1, 3, 32, 48, False, PromptAdmission(1, 80, 32)),)


def test_a_locked_prefix_hit_reserves_only_what_is_left_to_compute():
    p = planner()
    p.add_request(1, 80, 40)
    step = p.plan(roomy(kv_tokens=88), match=lambda uid: PrefixHit(cached_len=32, evictable_len=0))
    assert step.chunks == (AdmittedChunk(1, 3, 32, 48, False, PromptAdmission(1, 80, 32)),)


def test_one_pass_charges_the_prefix_an_admission_locks_against_the_next():
    hits = {1: PrefixHit(32, 32), 2: PrefixHit(0, 0)}
    p = planner()
    p.add_request(1, 80, 48)  # 96 to reserve, page-aligned
    p.add_request(2, 40, 8)  # 48 to reserve
    step = p.plan(roomy(kv_tokens=32 + 96 + 47), match=hits.__getitem__)
    assert [c.uid for c in step.chunks] == [1]
    assert step.blocked is NotAdmitted.KV_BUDGET
    p = planner()
    p.add_request(1, 80, 48)
    p.add_request(2, 40, 8)
    step = p.plan(roomy(kv_tokens=32 + 96 + 48), match=hits.__getitem__)
    assert [c.uid for c in step.chunks] == [1, 2]


def test_a_short_prompt_is_not_matched_at_all():
    asked = []
    p = planner()
    p.add_request(1, 16, 4)
    p.add_request(2, 17, 4)
    p.plan(roomy(), match=lambda uid: asked.append(uid) or PrefixHit())
    assert asked == [2], "a prompt of one page can never hit: one token is always computed"


# -------------------------------------------------------------- window model
def window_planner(**overrides) -> StepPlanner:
    values = dict(
        geometry=Geometry(page_size=16, sliding_window=100), max_prefill_tokens=50, swa_pool_tokens=1000
    )
    values.update(overrides)
    return planner(**values)


def test_a_window_request_reserves_its_window_two_pages_and_a_chunk():
    p = window_planner()
    assert p.window_reserve(20, 10) == 32, "a short request: its whole length, in pages"
    assert p.window_reserve(1000, 10) == 112 + 32 + 64, "window 100 -> 112, two pages, chunk 50 -> 64"
    assert planner().window_reserve(1000, 10) == 0, "no window, no reservation"


def test_a_window_admission_waits_for_the_reservations_of_the_running():
    held = {}
    p = window_planner()
    p.add_request(1, 1000, 10)
    p.add_request(2, 1000, 10)
    step = p.plan(roomy(swa_tokens=208 + 207), window_held=lambda uid: held.get(uid, 0))
    assert [c.uid for c in step.chunks] == [1]
    assert step.chunks[0].chunk_len == 48, "the window continuation stops at a page"
    assert p.window_reserved() == 208
    held[1] = 48  # the first chunk's pages, now held
    step = p.plan(roomy(swa_tokens=208 + 207 - 48), window_held=lambda uid: held.get(uid, 0))
    assert step.chunks == (AdmittedChunk(1, 3, 48, 48, True, None),)
    assert step.blocked is NotAdmitted.WINDOW_BUDGET, "request 1's reservation still stands"
    held[1] = 96
    p.finish(1)
    step = p.plan(roomy(swa_tokens=208 + 207), window_held=lambda uid: held.get(uid, 0))
    assert [c.uid for c in step.chunks] == [2]
    assert p.window_reserved() == 208


def test_a_window_request_is_refused_when_the_pool_cannot_cover_its_reservation():
    p = window_planner()
    p.add_request(1, 1000, 10)
    assert p.plan(roomy(swa_tokens=207)) == IdleStep(NotAdmitted.WINDOW_BUDGET)
    assert p.plan(roomy(swa_tokens=208)).chunks[0].uid == 1


# ------------------------------------------------------------------ endings
def test_finishing_early_frees_the_slot_and_the_reservation():
    p = planner()
    p.add_request(1, 10, 100)
    p.plan(roomy())
    assert (p.num_running, p.inflight_tokens()) == (1, 99 + 15)
    assert p.finish(1) is True
    assert (p.num_running, p.slots.available, p.inflight_tokens()) == (0, 4, 0)
    assert p.finish(1) is False, "already gone"
    assert not p.is_known(1)
    p.add_request(1, 10, 1)  # the id may be reused once it is gone


def test_aborting_a_chunked_prompt_frees_its_slot_and_reservation():
    p = planner(max_prefill_tokens=100)
    p.add_request(1, 250, 10)
    p.plan(roomy())
    assert p.abort(1) is True
    assert (p.num_waiting, p.num_running, p.inflight_tokens(), p.slots.available) == (0, 0, 0, 4)


def test_aborting_a_waiting_prompt_takes_it_out_of_the_queue():
    p = planner()
    p.add_request(1, 250, 10)
    p.add_request(2, 10, 10)
    assert p.abort(1) is True
    assert (p.waiting_uids(), p.waiting_tokens, p.pending_kv_tokens()) == ([2], 20, 20)
    assert p.abort(7) is False
