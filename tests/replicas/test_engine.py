"""The replica engine end to end on the real SmolLM2: chunked prefill, prefix cache, sampling, aborts, refusals.

Two engines are shared by the whole module (loading one takes a second or
two once the GGUF conversion is cached):

- ``engine``: page size 16 and a 64-token prefill budget, so any prompt
  over 64 tokens is computed in chunks; prefix caching on; 16 request slots.
- ``uncached_engine``: the same model with prefix caching off, the
  reference for what a prefix hit must not change.

Greedy output is compared token for token with ``transformers`` running the
same weights (fp32, each prompt alone, EOS not ending generation on either
side). After every test the engine must go idle and account for every page,
slot and prefix lock (:meth:`LLMEngine.check_integrity` and
:meth:`LLMEngine.check_idle`).

Each test builds its prompts from its own tag at the start of the text, so
no test finds another test's pages in the prefix cache unless it means to.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferrox.replicas.config import EngineConfig
from ferrox.replicas.engine import LLMEngine
from ferrox.replicas.types import SamplingParams
from ferrox.scheduler.planner import RequestRefused

PAGE = 16
PREFILL_BUDGET = 64
MAX_SEQS = 16
KV_BYTES = 128 << 20  # 182 pages of 16 tokens for SmolLM2-135M in fp32
EOS = 2  # <|im_end|>

STORY = (
    "The lighthouse keeper had lived on the island for thirty years, and in all that time he had never "
    "once missed lighting the lamp at dusk. Every evening he climbed the hundred and twelve steps of the "
    "spiral stair, trimmed the wick, polished the great lens until it shone, and watched the beam sweep "
    "out across the water. Ships passed in the night, their crews trusting the light to warn them of the "
    "rocks that lay hidden beneath the waves. In the mornings he walked along the shore collecting "
    "driftwood, shells, and the occasional glass float that had drifted all the way from distant fishing "
    "villages. He kept a journal in which he recorded the weather, the ships he saw, and the birds that "
    "nested on the cliffs. One winter a terrible storm arrived without warning. The wind howled for three "
    "days, the sea rose higher than anyone could remember, and spray lashed the windows of the tower. On "
    "the second night the keeper saw a small fishing boat struggling against the current, its engine "
    "failing and its lights flickering. He signalled with his lantern, guiding the crew toward the only "
    "sheltered cove on the island, where the water was calm enough for them to drop anchor. When the storm "
    "finally passed, the fishermen rowed ashore to thank him. They brought bread, cheese, and news from the "
    "mainland, and they stayed for a week while they repaired their boat. The keeper, who had grown used to "
    "silence, found that he enjoyed their company more than he had expected. They told stories of distant "
    "harbours, of markets full of spices and cloth, of cities where the streets were lit all night long. "
    "After they left, the island seemed quieter than before, but the keeper kept lighting the lamp, evening "
    "after evening, knowing that somewhere out in the darkness someone might be depending on it."
)


# ----------------------------------------------------------------- fixtures
def _config(**overrides) -> EngineConfig:
    base = dict(
        model="SmolLM2-135M-Instruct",
        dtype="float32",
        page_size=PAGE,
        max_prefill_tokens=PREFILL_BUDGET,
        max_num_seqs=MAX_SEQS,
        kv_cache_bytes=KV_BYTES,
        torch_threads=1,  # the 2-core box is shared; one intra-op thread per engine
        seed=0,
    )
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(_threads):
    e = LLMEngine(_config(), replica_id="engine-under-test")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def uncached_engine(_threads):
    e = LLMEngine(_config(enable_prefix_caching=False, kv_cache_bytes=32 << 20), replica_id="uncached")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf_model(engine):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(engine.files.path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(autouse=True)
def _every_engine_ends_idle_and_accounted_for(request):
    yield
    for name in ("engine", "uncached_engine"):
        if name in request.fixturenames:
            e = request.getfixturevalue(name)
            assert e.wait_idle(timeout=60), f"{name} still has live requests after the test"
            e.check_integrity()
            e.check_idle()
            assert e.healthy


# ------------------------------------------------------------------ helpers
def prompt_ids(engine: LLMEngine, tag: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of "<tag>: <story>" (the story repeated as needed)."""
    ids = engine.tokenizer.encode(f"{tag}: {STORY}", add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return list(ids[:n])


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` alone; EOS does not end it (eos_token_id=None)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=EOS,
        )
    return out[0, len(prompt) :].tolist()


def wait_for_phase(engine: LLMEngine, request_id: str, phase: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.request_phase(request_id) != phase:
        assert time.monotonic() < deadline, f"{request_id} never reached {phase!r}"
        time.sleep(0.001)


# ------------------------------------------------------------ greedy parity
def test_chunked_batched_greedy_output_equals_transformers_on_each_prompt_alone(engine, hf_model):
    lengths = [5, 40, 90, 200]
    prompts = [prompt_ids(engine, f"Parity prompt {i}", n) for i, n in enumerate(lengths)]
    assert [len(p) for p in prompts] == lengths

    engine.step_log = []
    try:
        streams = [engine.add_request(p, greedy(32)) for p in prompts]
        results = [s.result() for s in streams]
        log = list(engine.step_log)
    finally:
        engine.step_log = None

    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length"
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.cached_tokens == 0
        assert result.usage.completion_tokens == len(result.token_ids) == 32
        assert result.token_ids == hf_greedy(hf_model, prompt, 32)

    # The prompts really went through in chunks: no prefill step exceeded the
    # 64-token budget, and all 335 prompt tokens ran, so the 200-token prompt
    # was split over at least four steps.
    prefills = [tokens for kind, tokens, _ in log if kind == "prefill"]
    assert max(prefills) == PREFILL_BUDGET
    assert sum(prefills) == sum(lengths) == 335
    assert len(prefills) >= 6  # ceil(335 / 64)
    decodes = [tokens for kind, tokens, _ in log if kind == "decode"]
    assert sum(decodes) == 4 * 31  # each prompt's last chunk samples its first token


# ------------------------------------------------------------- prefix cache
def test_a_request_sharing_three_full_pages_reports_48_cached_tokens_and_the_uncached_output(
    engine, uncached_engine
):
    shared = prompt_ids(engine, "Prefix cache", 3 * PAGE)
    first = shared + prompt_ids(engine, "first tail", 10)
    second = shared + prompt_ids(engine, "second tail", 7)

    warm = engine.generate(first, greedy(4))
    assert warm.usage.cached_tokens == 0

    hit = engine.generate(second, greedy(16))
    reference = uncached_engine.generate(second, greedy(16))

    assert hit.usage.cached_tokens == 48
    assert hit.usage.prompt_tokens == 55
    assert reference.usage.cached_tokens == 0
    assert hit.token_ids == reference.token_ids
    assert hit.text == reference.text
    assert len(hit.token_ids) == 16


# ----------------------------------------------------------------- sampling
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(engine):
    poem = chat_ids(engine, "Write a short poem about the sea.")
    other = chat_ids(engine, "Describe a busy market in the morning.")
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)

    alone = engine.generate(poem, seeded)
    streams = [
        engine.add_request(other, SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)),
        engine.add_request(poem, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)),
        engine.add_request(poem, seeded),
        engine.add_request(other, SamplingParams(max_tokens=12, temperature=0.7, top_k=40, ignore_eos=True)),
    ]
    batch = [s.result() for s in streams]

    assert len(alone.token_ids) == 16
    assert batch[2].token_ids == alone.token_ids
    assert batch[2].text == alone.text
    # It really sampled: the seeded draw is not the greedy continuation.
    assert alone.token_ids != engine.generate(poem, greedy(16)).token_ids
    assert [len(r.token_ids) for r in batch] == [20, 16, 16, 12]


def test_top_k_1_at_temperature_1_equals_greedy(engine):
    prompt = chat_ids(engine, "Name three colours of the rainbow.")
    top1 = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True))
    assert top1.token_ids == engine.generate(prompt, greedy(16)).token_ids


def test_a_stop_string_spanning_two_tokens_is_never_streamed(engine):
    prompt = chat_ids(engine, "Write a short poem about the sea.")
    full = engine.generate(prompt, greedy(32))
    decode = engine.tokenizer.backend_tokenizer.decode
    pieces = [decode([t]) for t in full.token_ids]
    # The first boundary after the third token where both sides have three
    # visible characters: the stop is their tail + head.
    i = next(
        k for k in range(3, len(pieces) - 1)
        if len(pieces[k].strip()) >= 3 and len(pieces[k + 1].strip()) >= 3
    )
    stop = pieces[i][-3:] + pieces[i + 1][:3]
    through_i = decode(full.token_ids[: i + 1])
    assert full.text.startswith(through_i)
    cut = len(through_i) - 3
    assert full.text.find(stop) == cut, "the stop string must first occur at that boundary"

    stream = engine.add_request(prompt, greedy(32, stop=[stop]))
    chunks = list(stream)
    streamed = "".join(c.text for c in chunks)

    # Not one character of the stop string reached the client, although its
    # first half was generated a token before the match was known.
    assert streamed == full.text[:cut]
    assert chunks[-1].finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == full.token_ids[: i + 2]
    assert chunks[-1].usage.completion_tokens == i + 2  # through the token that completed the stop


def test_ignore_eos_runs_past_eos_to_exactly_max_tokens_with_length(engine, hf_model):
    prompt = chat_ids(engine, "What is 2+2? Answer with one number.")
    natural = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert natural.finish_reason == "stop"
    assert natural.token_ids[-1] == EOS
    assert len(natural.token_ids) < 12

    forced = engine.generate(prompt, greedy(12))
    assert forced.finish_reason == "length"
    assert len(forced.token_ids) == forced.usage.completion_tokens == 12
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids
    assert forced.token_ids == hf_greedy(hf_model, prompt, 12)


# ------------------------------------------------------------------- aborts
def test_aborting_mid_prefill_returns_every_page_slot_and_prefix_lock(engine):
    head = prompt_ids(engine, "Abort in prefill", 4 * PAGE)
    engine.generate(head, greedy(1))  # head's four pages are now in the prefix cache
    long_prompt = head + prompt_ids(engine, "a long continuation", 900)

    stream = engine.add_request(long_prompt, greedy(8))
    wait_for_phase(engine, stream.request_id, "prefilling")
    assert engine.abort(stream.request_id) is True
    chunks = list(stream)

    assert [c.finish_reason for c in chunks] == ["abort"]
    assert chunks[-1].usage.prompt_tokens == 964
    assert chunks[-1].usage.cached_tokens == 64
    assert chunks[-1].usage.completion_tokens == 0
    assert engine.wait_idle(timeout=30)
    engine.check_idle()  # the locked prefix is unlocked again, every page free or cached
    snap = engine.refresh_snapshot()
    assert snap.free_slots == MAX_SEQS
    assert snap.kv_tokens_available == snap.kv_tokens_total
    assert engine.abort(stream.request_id) is False


def test_aborting_mid_decode_ends_the_stream_with_abort_and_frees_everything(engine):
    prompt = prompt_ids(engine, "Abort in decode", 30)
    stream = engine.add_request(prompt, greedy(200))
    seen = []
    aborted = False
    for chunk in stream:
        seen.append(chunk)
        if not aborted and sum(len(c.token_ids) for c in seen) >= 3:
            assert engine.abort(stream.request_id) is True
            aborted = True
    tokens = [t for c in seen for t in c.token_ids]

    assert seen[-1].finish_reason == "abort"
    assert all(c.finish_reason is None for c in seen[:-1])
    # Tokens the loop produced before the abort landed are still delivered and counted.
    assert 3 <= seen[-1].usage.completion_tokens == len(tokens) < 200
    assert engine.wait_idle(timeout=30)
    engine.check_idle()
    assert engine.refresh_snapshot().free_slots == MAX_SEQS


def test_leaving_a_stream_early_aborts_the_request(engine):
    stream = engine.add_request(prompt_ids(engine, "Early close", 20), greedy(200))
    taken = 0
    for chunk in stream:
        taken += len(chunk.token_ids)
        if taken >= 2:
            break
    # Leaving the loop closed the iterator, whose cleanup aborted the request.
    assert engine.request_phase(stream.request_id) is None
    assert engine.abort(stream.request_id) is False
    assert engine.wait_idle(timeout=30)
    engine.check_idle()


def test_an_async_stream_yields_the_sync_tokens_and_aclose_aborts(engine):
    prompt = prompt_ids(engine, "Async stream", 24)
    expected = engine.generate(prompt, greedy(6)).token_ids

    async def consume():
        done = engine.add_request(prompt, greedy(6))
        got = [t async for c in done for t in c.token_ids]
        early = engine.add_request(prompt, greedy(200))
        async for _ in early:
            break
        await early.aclose()
        # Checked inside the loop: at asyncio.run's end the abandoned
        # iterator's own cleanup would abort the request anyway.
        return got, engine.request_phase(early.request_id), engine.abort(early.request_id)

    got, phase_after_aclose, still_running = asyncio.run(consume())
    assert got == expected
    assert phase_after_aclose is None
    assert still_running is False


# ---------------------------------------------------------------- bad input
def test_bad_requests_are_refused_with_the_field_and_limit_while_others_run(engine):
    good = engine.add_request(prompt_ids(engine, "Still served", 12), greedy(24))
    ok = prompt_ids(engine, "Refused", 10)
    vocab = engine.vocab_size
    assert vocab == 49152

    with pytest.raises(ValueError, match=r"prompt must not be empty \(prompt_token_ids has 0 tokens\)"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match=r"1 id\(s\) outside the vocabulary \[0, 49152\), e.g. 49152"):
        engine.add_request(ok + [vocab], greedy(4))
    with pytest.raises(ValueError, match=r"2 id\(s\) outside the vocabulary \[0, 49152\), e.g. -1"):
        engine.add_request([-1, 5, 10**9], greedy(4))
    with pytest.raises(ValueError, match=r"max_tokens must be at least 1, got 0"):
        engine.add_request(ok, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -0.5"):
        engine.add_request(ok, SamplingParams(temperature=-0.5))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        engine.add_request(ok, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        engine.add_request(ok, SamplingParams(top_p=1.5))
    with pytest.raises(RequestRefused) as too_long:
        engine.add_request(ok, greedy(8183))
    assert str(too_long.value) == (
        "prompt (10 tokens) + max_tokens (8183) = 8193 tokens exceeds the context length of 8192 tokens"
    )
    assert (too_long.value.reason, too_long.value.requested, too_long.value.limit) == ("context_length", 8193, 8192)
    with pytest.raises(RequestRefused) as too_big:
        engine.add_request(ok, greedy(4000))
    pool = engine.kv_pool_tokens
    assert pool == engine.runner.num_pages * PAGE == 182 * PAGE
    assert str(too_big.value) == (
        f"prompt (10 tokens) + max_tokens (4000) = 4010 tokens can never fit this replica's KV pool of {pool} tokens"
    )
    assert (too_big.value.reason, too_big.value.requested, too_big.value.limit) == ("kv_pool", 4010, pool)

    result = good.result()
    assert result.finish_reason == "length"
    assert len(result.token_ids) == result.usage.completion_tokens == 24
    assert engine.refresh_snapshot().waiting_requests == 0


# ------------------------------------------------------------- concurrency
def test_sixteen_concurrent_requests_all_finish_with_exact_usage(engine):
    requests = []
    for i in range(16):
        prompt = prompt_ids(engine, f"Concurrent request {i}", 8 + 5 * i)
        if i % 2:
            params = SamplingParams(max_tokens=4 + i, temperature=0.8, seed=i if i % 4 == 1 else None, ignore_eos=True)
        else:
            params = greedy(4 + i)
        requests.append((prompt, params))
    streams = [engine.add_request(p, params) for p, params in requests]
    results = [s.result() for s in streams]

    for (prompt, params), result in zip(requests, results):
        assert result.finish_reason == "length"
        assert result.error is None
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.completion_tokens == len(result.token_ids) == params.max_tokens
        assert all(0 <= t < engine.vocab_size for t in result.token_ids)
    assert len({s.request_id for s in streams}) == 16


# ------------------------------------------------------- capacity snapshot
def test_an_idle_snapshot_is_exact_and_a_queued_request_advances_its_seq(engine):
    idle = engine.refresh_snapshot()
    assert idle.replica_id == "engine-under-test"
    assert idle.free_slots == idle.max_slots == MAX_SEQS
    assert idle.kv_tokens_total == engine.runner.num_pages * PAGE == 182 * PAGE
    assert idle.kv_tokens_available == idle.kv_tokens_total
    assert (idle.waiting_requests, idle.waiting_tokens, idle.running_requests) == (0, 0, 0)
    assert (idle.page_size, idle.max_model_len) == (PAGE, 8192)
    assert idle.healthy

    stream = engine.add_request(prompt_ids(engine, "Snapshot", 20), greedy(64))
    busy = engine.capacity_snapshot()
    assert busy.seq > idle.seq
    assert busy.waiting_requests + busy.running_requests == 1
    assert busy.kv_tokens_available < idle.kv_tokens_available
    assert engine.abort(stream.request_id) is True
    assert [c.finish_reason for c in stream][-1] == "abort"
    after = engine.refresh_snapshot()
    assert after.seq > busy.seq
    assert after.free_slots == MAX_SEQS
    assert after.kv_tokens_available == after.kv_tokens_total


def test_two_live_requests_with_the_same_request_id_both_finish(engine):
    prompt = prompt_ids(engine, "Shared id", 12)
    first = engine.add_request(prompt, greedy(6), request_id="dup-id")
    second = engine.add_request(prompt, greedy(6), request_id="dup-id")
    assert first.request_id == "dup-id"
    assert second.request_id.startswith("dup-id#") and second.request_id != "dup-id"
    a, b = first.result(), second.result()
    assert a.token_ids == b.token_ids
    assert (a.usage.completion_tokens, b.usage.completion_tokens) == (6, 6)
