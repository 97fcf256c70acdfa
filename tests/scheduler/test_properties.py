"""Properties of the scheduler over random traces (hypothesis).

Each example is a replica (full-attention, window or recurrent geometry;
page sizes 1..256; a chunk budget; pools from one page up) and a trace of
arrivals with shared prompt prefixes, early stops and aborts, replayed by
the trace simulator through the real :class:`Scheduler` -- which already
checks, after every step, the pools' integrity and the per-sequence
contracts the runner relies on (query tokens, page tables, a prompt reported
once, window pages covering every key a step reads). On top of that these
tests check the promises admission makes:

- an admitted request always gets its pages, window pages and slots: no
  ``OutOfPages``, and at every step the pages the admitted requests can
  still take at most (``ceil((prompt + max_tokens - 1) / page)`` each, less
  what they hold) fit in the free and evictable pages;
- a window request never holds more window pages than it reserved, and what
  the running requests may still take fits in the free window pool;
- admission order is arrival order, and every request that fits the pools
  alone finishes, the others being refused at arrival with the reason;
- at the end every page and slot is free or cached (``check_idle``);
- a window model's continuation chunks end on page boundaries.

The hypothesis budget is bounded (``max_examples``, no deadline) so the
module runs in well under a minute on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrox.scheduler.admission import RECURRENT_SLOTS_PER_REQUEST, align_ceil
from ferrox.scheduler.radix import SIDE_STATE, SIDE_WINDOW
from ferrox.scheduler.core import ScheduledStep, Scheduler, SchedulerConfig
from ferrox.scheduler.simulator import Arrival, SimulationResult, Simulator, fake_token, prompt_tokens

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Case:
    config: SchedulerConfig
    arrivals: tuple[Arrival, ...]


@st.composite
def cases(draw, geometry=st.sampled_from(["full", "full", "window", "recurrent"]), shared: bool = False) -> Case:
    """A replica and a trace. ``shared``: roomier pools and most prompts on a
    shared prefix, arriving apart, so prefix hits are the rule."""
    kind = draw(geometry)
    page = draw(st.one_of(st.integers(1, 8), st.integers(9, 64), st.integers(65, 256)))
    chunk = draw(st.one_of(st.integers(1, 3 * page + 5), st.integers(1, 64)))
    window = num_swa = recurrent_slots = None
    if kind == "window":
        chunk = max(chunk, page)  # a window model's budget holds a page (the planner refuses less)
        window = draw(st.integers(1, 4 * page + 3))
        num_swa = draw(st.integers(1, 24))
    if kind == "recurrent":
        recurrent_slots = draw(st.integers(0, 13))
    pages = st.integers(8, 64) if shared else st.integers(1, 12) | st.integers(13, 64) | st.integers(13, 64)
    context = st.just(1 << 20) if shared else st.sampled_from([1 << 20] * 3) | st.integers(2, 12 * page)
    config = SchedulerConfig(
        page_size=page,
        num_pages=draw(pages),
        max_slots=draw(st.integers(1, 5)),
        max_prefill_tokens=chunk,
        max_model_len=draw(context),
        sliding_window=window,
        num_swa_pages=num_swa or 0,
        recurrent=kind == "recurrent",
        num_recurrent_slots=recurrent_slots or 0,
        enable_prefix_caching=shared or kind != "full" or draw(st.integers(0, 4)) > 0,
    )
    # Shared prefixes, whole pages or not, so later prompts hit earlier ones.
    prefix_len = st.integers(page, 4 * page) if shared else st.integers(1, 4 * page) | st.integers(page, 4 * page)
    prefixes = [
        prompt_tokens(1_000 + i, draw(prefix_len)) for i in range(draw(st.integers(1 if shared else 0, 2)))
    ]
    gap = draw(st.sampled_from([2, 12, 40] if shared else [0, 3, 12, 40]))  # most steps between two arrivals
    arrivals = []
    step = 0
    for uid in range(draw(st.integers(1, 9))):
        prefix = draw(st.sampled_from(prefixes)) if prefixes and draw(st.integers(0, 3)) else ()
        own = draw(st.one_of(st.integers(1, 2 * page), st.integers(1, 7 * page)))
        length = len(prefix) + own if prefix and (shared or draw(st.booleans())) else own
        output = draw(st.one_of(st.integers(1, 6), st.integers(1, 2 * page + 2)).map(lambda n: min(n, 80)))
        stop = draw(st.none() | st.integers(1, output))
        step += draw(st.integers(0, gap))
        arrivals.append(
            Arrival(
                uid,
                step=step,
                prompt=prompt_tokens(uid, length, prefix),
                output_len=output,
                stop_after=stop,
                abort_step=draw(st.none() | st.none() | st.integers(0, step + 30)),
            )
        )
    return Case(config, tuple(arrivals))


def fits_alone(config: SchedulerConfig, arrival: Arrival) -> str | None:
    """Why ``arrival`` can never run on an idle replica of ``config`` (the
    planner's arrival rules, restated), or ``None`` when it fits."""
    p = config.page_size
    total = arrival.prompt_len + arrival.output_len
    if total > config.max_model_len:
        return "context_length"
    if align_ceil(total, p) > config.num_pages * p:
        return "kv_pool"
    if config.sliding_window is not None and config.num_swa_pages:
        # Window, the page being written, the page sliding out, one chunk.
        bound = align_ceil(config.sliding_window, p) + 2 * p + align_ceil(config.max_prefill_tokens, p)
        if min(align_ceil(total, p), bound) > config.num_swa_pages * p:
            return "window_pool"
    if config.recurrent and config.num_recurrent_slots < RECURRENT_SLOTS_PER_REQUEST:
        return "recurrent_pool"
    return None


def pages_still_needed(sched: Scheduler) -> int:
    """The most full-attention pages the admitted requests can still take:
    each may grow to ``ceil((prompt + max_tokens - 1) / page)`` pages (KV for
    every token but the last sampled one)."""
    p = sched.config.page_size
    total = 0
    for uid in list(sched.kv._requests):
        req = sched._reqs[uid]
        final = -(-(req.prompt_len + req.max_tokens - 1) // p)
        total += max(final - len(sched.kv.request(uid).pages), 0)
    return total


def check_memory(sched: Scheduler, step: ScheduledStep | None) -> None:
    kv, planner = sched.kv, sched.planner
    evictable_pages = kv.cache.evictable_tokens // kv.page_size
    need = pages_still_needed(sched)
    assert need <= kv.pages.num_free + evictable_pages, (
        f"admitted requests may still take {need} pages; "
        f"{kv.pages.num_free} free + {evictable_pages} evictable"
    )
    if kv.sliding_window is not None:
        outstanding = 0
        for uid in kv._requests:
            if not planner.is_known(uid):
                continue  # its budget ends this step; the planner let go of it when planning
            reserve = planner._window_reserve[uid]
            held = kv.window_held(uid)
            assert held <= reserve, f"request {uid} holds {held} window tokens, reserved {reserve}"
            outstanding += reserve - held
        room = (kv.swa_pages.num_free + kv.cache.side_evictable(SIDE_WINDOW)) * kv.page_size
        assert outstanding <= room, (
            f"running requests may still take {outstanding} window tokens; {room} free or evictable"
        )
    if sched.config.recurrent:
        # Every slot is free, cached as a snapshot, or one of a request's three.
        assert kv.recurrent.num_free + kv.cache.side_count(SIDE_STATE) == (
            kv.recurrent.num_pages - RECURRENT_SLOTS_PER_REQUEST * kv.num_requests
        )
    assert planner.slots.capacity - planner.slots.available == planner.num_running
    if step is not None and step.kind == "decode":
        assert [s.uid for s in step.seqs] == sorted(s.uid for s in step.seqs), "decode batches in uid order"


def simulate(case: Case) -> tuple[SimulationResult, Scheduler]:
    sim = Simulator(case.config, check_plan=check_memory, check_commit=check_memory, max_steps=20_000)
    result = sim.run(case.arrivals)
    assert sim.scheduler is not None
    return result, sim.scheduler


@SETTINGS
@given(cases())
def test_an_admitted_request_always_gets_its_pages_and_the_pools_end_idle(case):
    result, sched = simulate(case)  # OutOfPages or a failed check raises here
    sched.kv.check_idle()
    assert sched.planner.num_waiting == 0 and sched.planner.num_running == 0
    assert sched.planner.slots.available == case.config.max_slots
    assert sched.planner.inflight_tokens() == 0
    assert sched.planner.waiting_tokens == 0
    assert len(result.requests) == len(case.arrivals)


@SETTINGS
@given(cases())
def test_requests_are_admitted_in_arrival_order_and_those_that_fit_alone_finish(case):
    result, _ = simulate(case)
    arrival_order = [a.uid for a in sorted(case.arrivals, key=lambda a: a.step)]
    admitted = [uid for uid in arrival_order if result.requests[uid].admission_step is not None]
    assert result.admission_order == admitted, "FIFO: no request is admitted ahead of an earlier one"
    for a in case.arrivals:
        r = result.requests[a.uid]
        refusal = fits_alone(case.config, a)
        if refusal is not None:
            assert (r.finish_reason, r.refused) == ("refused", refusal)
            continue
        assert r.arrival_step == a.step
        if r.finish_reason == "abort":
            assert a.abort_step is not None and r.finish_step == max(a.abort_step, a.step)
            continue
        if a.abort_step is not None:
            assert r.finish_step < max(a.abort_step, a.step), "it finished before the client went away"
        stop = a.stop_after if a.stop_after is not None and a.stop_after < a.output_len else None
        expected = ("stop", stop) if stop is not None else ("length", a.output_len)
        assert (r.finish_reason, r.output_tokens) == expected
        assert r.admission_step is not None and r.admission_step <= r.first_token_step <= r.finish_step
        assert 0 <= r.cached_tokens < a.prompt_len and r.cached_tokens % case.config.page_size == 0


@SETTINGS
@given(cases(geometry=st.sampled_from(["full", "window", "recurrent"]), shared=True))
def test_a_prefix_hit_covers_only_whole_pages_an_earlier_request_computed(case):
    result, sched = simulate(case)  # the memory promises are checked at every step
    sched.kv.check_idle()
    page = case.config.page_size
    for a in case.arrivals:
        r = result.requests[a.uid]
        if r.admission_step is None:
            continue
        best = 0  # the longest whole-page prefix a request released before a's admission had KV for
        for b in case.arrivals:
            rb = result.requests[b.uid]
            if rb.finish_reason in ("stop", "length") and rb.finish_step < r.admission_step:
                computed = b.prompt + tuple(fake_token(b.uid, i) for i in range(rb.output_tokens - 1))
                common = next((i for i, (x, y) in enumerate(zip(a.prompt, computed)) if x != y), None)
                if common is None:
                    common = min(len(a.prompt), len(computed))
                best = max(best, common // page * page)
        assert r.cached_tokens <= min(best, (a.prompt_len - 1) // page * page)


@SETTINGS
@given(cases(geometry=st.just("window")))
def test_a_window_models_continuation_chunks_end_on_page_boundaries(case):
    page = case.config.page_size
    ends: list[tuple[int, int]] = []

    def record(sched: Scheduler, step: ScheduledStep) -> None:
        check_memory(sched, step)
        if step.kind == "prefill":
            ends.extend((s.seq_len, s.seq_len % page) for s in step.seqs if not s.samples)

    sim = Simulator(case.config, check_plan=record, check_commit=check_memory, max_steps=20_000)
    sim.run(case.arrivals)
    assert [end for end, rem in ends if rem] == [], f"continuations ending mid-page (page {page})"
    sim.scheduler.kv.check_idle()
