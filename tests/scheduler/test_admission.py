"""The seed's admission tests (``seed/admission.rs``), ported with the same numbers and messages.

Differences are the Python API's only: ``check_admission`` returns
``NotAdmitted | None``, ``take_chunk`` returns ``AdmittedChunk | NotAdmitted``,
a double free raises ``ValueError`` and rebuilding a busy table raises
``RuntimeError`` (the seed's ``debug_assert!`` and ``assert_eq!`` panics).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ferrox.scheduler.admission import (
    AdmittedChunk,
    Capacity,
    ChunkState,
    DecodeSet,
    DecodingRequest,
    FinishReason,
    Geometry,
    NotAdmitted,
    PendingRequest,
    PrefillPass,
    PromptAdmission,
    SlotTable,
    finish_reason,
)


def geometry() -> Geometry:
    return Geometry(page_size=16)


def roomy() -> Capacity:
    return Capacity(request_slots=4, kv_tokens=100_000, swa_tokens=100_000, recurrent_slots=64)


def test_slots_are_handed_out_last_in_first_out():
    table = SlotTable(3)
    assert table.available == 3
    assert table.allocate() == 2
    assert table.allocate() == 1
    table.free(2)
    assert table.allocate() == 2, "the most recent slot comes back"
    assert table.allocate() == 0
    assert table.allocate() is None


def test_a_slot_freed_twice_is_an_error():
    table = SlotTable(3)
    slot = table.allocate()
    table.free(slot)
    with pytest.raises(ValueError, match="slot 2 was freed twice"):
        table.free(slot)
    assert table.available == 3, "the failed free changed nothing"


def test_a_slot_that_was_never_handed_out_cannot_be_freed():
    table = SlotTable(3)
    with pytest.raises(ValueError, match="slot 1 was freed twice"):
        table.free(1)


def test_a_slot_table_with_a_live_request_may_not_be_rebuilt():
    table = SlotTable(3)
    table.allocate()
    with pytest.raises(RuntimeError, match="only be rebuilt while idle"):
        table.rebuild(8)


def test_an_idle_slot_table_rebuilds_to_the_new_size():
    table = SlotTable(3)
    table.free(table.allocate())
    table.rebuild(8)
    assert (table.capacity, table.available) == (8, 8)
    assert table.allocate() == 7


def test_inflight_tokens_reserve_a_page_per_running_request():
    """The page reservation is not slack: the next token may open a fresh
    page, and pages are allocated whole."""
    decode = DecodeSet()
    decode.admit([DecodingRequest(uid=1, remaining=100), DecodingRequest(uid=2, remaining=50)])
    assert decode.inflight_tokens(16) == 150 + 2 * 15
    assert decode.inflight_tokens(1) == 150, "no page, no reservation"


def test_a_finished_request_leaves_the_decode_set():
    decode = DecodeSet()
    decode.admit([DecodingRequest(uid=1, remaining=1)])
    assert decode.runnable
    decode.admit([DecodingRequest(uid=1, remaining=0)])
    assert not decode.runnable
    assert decode.next_batch() == []
    assert decode.inflight_tokens(16) == 0


def test_decode_batches_come_out_in_uid_order():
    decode = DecodeSet()
    decode.admit([DecodingRequest(uid=7, remaining=4), DecodingRequest(uid=2, remaining=4)])
    assert [r.uid for r in decode.next_batch()] == [2, 7]


def test_readmitting_a_decoding_request_replaces_its_budget():
    decode = DecodeSet()
    decode.admit([DecodingRequest(uid=3, remaining=10)])
    decode.admit([DecodingRequest(uid=3, remaining=4)])
    assert len(decode) == 1
    assert decode.inflight_tokens(1) == 4
    assert decode.remove(3) == DecodingRequest(3, 4)
    assert decode.remove(3) is None
    assert decode.inflight_tokens(16) == 0


def test_admission_reserves_the_whole_prompt_and_output():
    """The reservation covers the whole output budget, so a request never
    gets half-generated and then dropped."""
    pass_ = PrefillPass(8192, 0, geometry())
    request = PendingRequest(1, 1000, 500)
    capacity = replace(roomy(), request_slots=1, kv_tokens=1400)  # 1000 + 500 = 1500 > 1400
    assert pass_.check_admission(request, 0, capacity) is NotAdmitted.KV_BUDGET

    capacity = replace(capacity, kv_tokens=1500)
    assert pass_.check_admission(request, 0, capacity) is None
    chunk = pass_.take_chunk(request, 0, 0, capacity)
    assert isinstance(chunk, AdmittedChunk)
    assert pass_.reserved_tokens == 1500
    assert chunk.chunk_len == 1000, "the budget covers the whole prompt"
    assert not chunk.chunked


def test_a_prefix_hit_shrinks_the_reservation():
    """A prefix hit shrinks what must be computed *and* what must be reserved."""
    pass_ = PrefillPass(8192, 0, geometry())
    request = PendingRequest(1, 1000, 500)
    capacity = replace(roomy(), kv_tokens=800)
    assert pass_.check_admission(request, 0, capacity) is NotAdmitted.KV_BUDGET
    assert pass_.check_admission(request, 800, capacity) is None

    chunk = pass_.take_chunk(request, 800, 0, capacity)
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len == 200
    assert chunk.computed_len == 800
    assert pass_.reserved_tokens == 700


def test_no_free_slot_refuses_before_anything_else_is_computed():
    pass_ = PrefillPass(8192, 0, geometry())
    capacity = replace(roomy(), request_slots=0)
    assert pass_.check_admission(PendingRequest(1, 8, 8), 0, capacity) is NotAdmitted.NO_REQUEST_SLOT


def test_a_recurrent_model_seats_three_slots_per_request():
    pass_ = PrefillPass(8192, 0, replace(geometry(), recurrent=True))
    request = PendingRequest(1, 64, 8)
    assert pass_.check_admission(request, 0, replace(roomy(), recurrent_slots=3)) is None
    assert pass_.check_admission(request, 0, replace(roomy(), recurrent_slots=2)) is NotAdmitted.RECURRENT_BUDGET


def test_a_window_model_needs_a_seat_in_the_window_pool():
    pass_ = PrefillPass(8192, 0, replace(geometry(), sliding_window=512))
    request = PendingRequest(1, 2000, 100)
    assert pass_.check_admission(request, 0, replace(roomy(), swa_tokens=16)) is NotAdmitted.WINDOW_BUDGET
    assert pass_.check_admission(request, 0, replace(roomy(), swa_tokens=528)) is None


def test_a_long_prompt_is_chunked_and_charged_once():
    """A long prompt is cut into chunks, and the reservation is taken once
    rather than per chunk."""
    pass_ = PrefillPass(256, 0, geometry())
    request = PendingRequest(1, 1000, 100)
    capacity = roomy()

    first = pass_.take_chunk(request, 0, 3, capacity)
    assert isinstance(first, AdmittedChunk)
    assert first.chunk_len == 256
    assert first.chunked
    assert first.admission == PromptAdmission(uid=1, prompt_tokens=1000, cached_tokens=0), (
        "the whole prompt is reported, not the chunk"
    )
    assert pass_.reserved_tokens == 1100
    assert pass_.token_budget == 0

    # The continuation, next pass.
    pass_ = PrefillPass(256, 1100, geometry())
    continued = replace(request, chunk=ChunkState(computed_len=256, slot=3, swa_evicted_len=0, locked_prefix_len=0))
    second = pass_.take_chunk(continued, 0, 3, capacity)
    assert isinstance(second, AdmittedChunk)
    assert second.computed_len == 256
    assert second.chunk_len == 256
    assert second.admission is None, "reported once, on the first chunk"
    assert pass_.reserved_tokens == 1100, "a continuation reserves nothing new"


def test_a_pass_with_no_budget_left_takes_no_chunk():
    pass_ = PrefillPass(256, 0, geometry())
    assert isinstance(pass_.take_chunk(PendingRequest(1, 256, 1), 0, 0, roomy()), AdmittedChunk)
    assert pass_.take_chunk(PendingRequest(2, 8, 1), 0, 1, roomy()) is NotAdmitted.BUDGET_SPENT
    assert pass_.reserved_tokens == 257, "the refused chunk reserved nothing"


def test_a_window_continuation_stops_on_a_page_boundary():
    """A window model's continuation must stop on a page boundary, or the
    window pool is charged for the same page twice."""
    geometry = Geometry(page_size=128, sliding_window=512)
    # A budget that is not a multiple of the page size.
    pass_ = PrefillPass(724, 0, geometry)
    request = PendingRequest(1, 2000, 100)
    chunk = pass_.take_chunk(request, 0, 0, roomy())
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len == 640, "5 whole pages, not 724"
    assert chunk.chunked
    assert pass_.reserved_swa == 640


def test_the_last_chunk_may_end_mid_page():
    """... but the *final* chunk may be ragged: there is nothing after it to
    charge twice."""
    geometry = Geometry(page_size=128, sliding_window=512)
    pass_ = PrefillPass(8192, 0, geometry)
    request = PendingRequest(1, 700, 100)
    chunk = pass_.take_chunk(request, 0, 0, roomy())
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len == 700
    assert not chunk.chunked
    assert pass_.reserved_swa == 768, "the ragged page is charged whole"


def test_a_chunk_that_cannot_reach_a_page_boundary_is_refused():
    """A pass with too little window budget to reach one page has nothing
    useful to run, and says so rather than running a partial page."""
    geometry = Geometry(page_size=128, sliding_window=512)
    pass_ = PrefillPass(8192, 0, geometry)
    request = PendingRequest(1, 2000, 100)
    capacity = replace(roomy(), swa_tokens=64)  # less than one page
    assert pass_.take_chunk(request, 0, 0, capacity) is NotAdmitted.NO_WHOLE_PAGE
    assert (pass_.token_budget, pass_.reserved_tokens, pass_.reserved_swa) == (8192, 0, 0), (
        "a refusal leaves no trace"
    )


def test_a_sliding_window_request_reclaims_its_own_state():
    """A long-running window request reclaims its own window as it slides,
    and that memory counts toward its next chunk."""
    geometry = Geometry(page_size=128, sliding_window=512)
    capacity = replace(roomy(), swa_tokens=256)
    deep = PendingRequest(
        1, 8192, 100, chunk=ChunkState(computed_len=4096, slot=0, swa_evicted_len=0, locked_prefix_len=0)
    )
    pass_ = PrefillPass(8192, 0, geometry)
    chunk = pass_.take_chunk(deep, 0, 0, capacity)
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len > 256, (
        f"the request's own slid-out window paid for more than the pool had ({chunk.chunk_len})"
    )
    # 4096 - (512 + 128) = 3456 slid out, plus the pool's 256: 3712 tokens, 29 pages.
    assert chunk.chunk_len == 3712

    # A request that has already given that state up gets only what the pool has.
    already = replace(deep, chunk=ChunkState(computed_len=4096, slot=0, swa_evicted_len=4096, locked_prefix_len=0))
    pass_ = PrefillPass(8192, 0, geometry)
    chunk = pass_.take_chunk(already, 0, 0, capacity)
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len == 256


def test_a_locked_prefix_is_never_reclaimed_as_the_window_slides():
    geometry = Geometry(page_size=128, sliding_window=512)
    capacity = replace(roomy(), swa_tokens=256)
    locked = PendingRequest(
        1, 8192, 100, chunk=ChunkState(computed_len=4096, slot=0, swa_evicted_len=0, locked_prefix_len=4096)
    )
    chunk = PrefillPass(8192, 0, geometry).take_chunk(locked, 0, 0, capacity)
    assert isinstance(chunk, AdmittedChunk)
    assert chunk.chunk_len == 256, "the tree owns the first 4096 tokens; the request may not free them"


def test_one_pass_charges_each_admission_against_the_last():
    """The pass's reservations accumulate: the second prompt is checked
    against a budget the first already spent."""
    capacity = replace(roomy(), kv_tokens=1000)
    pass_ = PrefillPass(8192, 0, geometry())
    first = PendingRequest(1, 400, 200)
    assert pass_.check_admission(first, 0, capacity) is None
    assert isinstance(pass_.take_chunk(first, 0, 0, capacity), AdmittedChunk)

    second = PendingRequest(2, 400, 200)
    assert pass_.check_admission(second, 0, capacity) is NotAdmitted.KV_BUDGET, (
        "600 already reserved leaves 400 for a request that needs 600"
    )


def test_stopping_beats_running_out_of_budget():
    """A model that ends its turn on its last budgeted token finished on its
    own terms."""
    assert finish_reason(True, False, True) is FinishReason.STOP
    assert finish_reason(False, True, True) is FinishReason.STOP
    assert finish_reason(False, False, True) is FinishReason.LENGTH
    assert finish_reason(False, False, False) is None
    assert FinishReason.STOP.as_str() == "stop"
    assert FinishReason.LENGTH.as_str() == "length"


# Beyond the seed: the decode set's whole-set step, which the planner uses.


def test_advancing_the_decode_set_spends_one_token_of_every_budget():
    decode = DecodeSet()
    decode.admit([DecodingRequest(9, 1), DecodingRequest(4, 3), DecodingRequest(6, 1)])
    assert decode.advance() == ((4, 6, 9), [6, 9]), "the batch, then who it finished, both in uid order"
    assert decode.next_batch() == [DecodingRequest(4, 2)]
    assert decode.inflight_tokens(16) == 2 + 15
    decode.admit([DecodingRequest(2, 2)])
    assert decode.advance() == ((2, 4), [])
    assert decode.next_batch() == [DecodingRequest(2, 1), DecodingRequest(4, 1)]
    assert decode.remove(4) == DecodingRequest(4, 1)
    assert decode.advance() == ((2,), [2])
    assert decode.is_empty() and decode.inflight_tokens(16) == 0
    assert decode.advance() == ((), [])


def test_a_readmitted_request_ends_on_its_new_budget():
    decode = DecodeSet()
    decode.admit([DecodingRequest(1, 1)])
    decode.admit([DecodingRequest(1, 3)])
    assert decode.advance() == ((1,), [])
    assert decode.get(1) == DecodingRequest(1, 2)
    assert decode.advance() == ((1,), [])
    assert decode.advance() == ((1,), [1])
    assert decode.get(1) is None
