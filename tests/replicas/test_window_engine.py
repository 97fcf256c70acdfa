"""The engine serving an interleaved sliding-window model (tiny random Qwen3) end to end.

The model is written as a Hugging Face directory (safetensors + the
embedded SmolLM2 tokenizer) and loaded by the engine like any checkpoint.
Window 64, page 16, a 64-token prefill budget: a 2,000-token prompt runs in
32 chunks and 24 decodes, and the window pool must never hold more than
window + chunk + 2 pages for it. Greedy output is compared token for token
with transformers on the same weights. After every test the engine must go
idle with every page and slot accounted for.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from ferrox.replicas.config import EngineConfig
from ferrox.replicas.engine import LLMEngine
from ferrox.replicas.types import SamplingParams
from hybrid_models import build_pair, hf_logits, save_tiny_model, window_config

WINDOW = 64
PAGE = 16
CHUNK = 64
VOCAB = 49152  # the SmolLM2 tokenizer's


def _config(path, **overrides) -> EngineConfig:
    base = dict(model=str(path), dtype="float32", page_size=PAGE, max_prefill_tokens=CHUNK, max_num_seqs=8,
                kv_cache_bytes=16 << 20, torch_threads=1, seed=0)
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_files):
    config = window_config(WINDOW, vocab=VOCAB, max_pos=4096)
    return save_tiny_model(config, tmp_path_factory.mktemp("qwen3-window"), smollm2_files.path)


@pytest.fixture(scope="module")
def engine(model_dir):
    before = torch.get_num_threads()
    e = LLMEngine(_config(model_dir), replica_id="window")
    yield e
    e.shutdown()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def unchunked(model_dir):
    e = LLMEngine(_config(model_dir, max_prefill_tokens=2048, kv_cache_bytes=32 << 20), replica_id="window-unchunked")
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def _ends_idle_and_accounted_for(request):
    yield
    for name in ("engine", "unchunked"):
        if name in request.fixturenames:
            e = request.getfixturevalue(name)
            assert e.wait_idle(60)
            e.check_integrity()
            e.check_idle()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_engine_sizes_a_window_pool_and_tells_the_scheduler_the_window(engine):
    r = engine.runner
    assert (r.spec.full_layers, r.spec.window_layers, r.sliding_window) == (2, 2, WINDOW)
    assert r.num_swa_pages == 8 * (WINDOW // PAGE + 2 + CHUNK // PAGE)  # every slot seats its largest reservation
    assert engine.scheduler.kv.sliding_window == WINDOW
    snap = engine.refresh_snapshot()
    assert snap.swa_tokens_available == r.num_swa_pages * PAGE
    assert snap.recurrent_slots_available is None


def test_a_2000_token_prompt_never_holds_more_than_window_plus_chunk_plus_two_pages(engine):
    engine.reset_prefix_cache()
    held: list[int] = []
    kinds: list[str] = []
    execute = engine.runner.execute

    def watching(step, states):
        for s in step.seqs:  # the window pages this step runs on
            held.append(len(s.swa_pages))
            assert len(s.swa_pages) <= (WINDOW + CHUNK) // PAGE + 2, (len(held), len(s.swa_pages))
            assert engine.scheduler.kv.swa_pages.num_pages - engine.scheduler.kv.swa_pages.num_free == len(s.swa_pages)
        kinds.append(step.kind)
        return execute(step, states)

    engine.runner.execute = watching
    try:
        out = engine.generate(_prompt(2000, 1), _greedy(24))
    finally:
        del engine.runner.execute
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert kinds.count("prefill") == 2000 // CHUNK + 1  # 31 whole chunks and a ragged last one of 16
    assert len(held) == 32 + 23
    # A chunk ending at e leaves pages from align_down(e - window - page) held:
    # the next chunk runs on 80 + 64 tokens = 9 pages, one under the bound.
    assert max(held[:32]) == 9
    # Decoding: the window, the page written and the page about to go, at most.
    assert max(held[32:]) == WINDOW // PAGE + 2
    # At the end the request holds nothing; the window pages of its whole pages
    # still in its window went to the prefix cache, unlocked; the rest is free.
    kv = engine.scheduler.kv
    assert (kv.cache.side_count(0), kv.cache.side_evictable(0)) == (5, 5)
    assert kv.swa_pages.num_free == engine.runner.num_swa_pages - 5


def test_greedy_tokens_equal_transformers_on_the_same_weights(engine, model_dir):
    hf, _ = build_pair(window_config(WINDOW, vocab=VOCAB, max_pos=4096))
    prompt = _prompt(150, 2)
    out = engine.generate(prompt, _greedy(12))
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    assert out.token_ids == tokens[len(prompt):]


def test_chunked_and_unchunked_prefill_give_identical_greedy_tokens(engine, unchunked):
    prompts = [_prompt(n, 10 + n) for n in (40, 200, 333)]
    a = [s.result().token_ids for s in [engine.add_request(p, _greedy(16)) for p in prompts]]
    b = [s.result().token_ids for s in [unchunked.add_request(p, _greedy(16)) for p in prompts]]
    assert a == b


@pytest.fixture(scope="module")
def uncached(model_dir):
    e = LLMEngine(_config(model_dir, enable_prefix_caching=False), replica_id="window-uncached")
    yield e
    e.shutdown()


@pytest.mark.parametrize("name", ["engine", "unchunked"])
def test_a_repeated_prompt_within_the_window_reuses_its_pages_with_identical_greedy_tokens(name, request, uncached):
    e = request.getfixturevalue(name)
    e.reset_prefix_cache()
    prompt = _prompt(60, 3)  # shorter than window + a page: no window page slides out during its prefill
    reference = uncached.generate(prompt, _greedy(6))
    first = e.generate(prompt, _greedy(6))
    second = e.generate(prompt, _greedy(6))
    assert (reference.usage.cached_tokens, first.usage.cached_tokens, second.usage.cached_tokens) == (0, 0, 48)
    assert first.token_ids == second.token_ids == reference.token_ids


@pytest.mark.parametrize("name", ["engine", "unchunked"])
def test_a_follow_up_turn_resumes_on_the_cached_window_pages_with_identical_greedy_tokens(name, request, uncached):
    e = request.getfixturevalue(name)
    e.reset_prefix_cache()
    prompt = _prompt(300, 7)
    first = e.generate(prompt, _greedy(30))  # computes 329 positions: 20 whole pages cached
    turn = prompt + first.token_ids + _prompt(21, 8)
    reference = uncached.generate(turn, _greedy(12))
    follow_up = e.generate(turn, _greedy(12))
    assert follow_up.usage.cached_tokens == 320
    assert follow_up.token_ids == reference.token_ids


def test_a_prompt_is_reused_while_its_window_is_cached_and_recomputed_once_it_slid_out(engine, uncached):
    """A repeat resumes at 288 (the prompt's last whole page) with window pages
    from 288 - 64 - 16 = 208 on. After 4 outputs the first request still held
    them; after 100 its window had slid past 288, so nothing is usable."""
    prompt = _prompt(300, 9)
    reference = uncached.generate(prompt, _greedy(6)).token_ids
    results = []
    for outputs in (4, 100):
        engine.reset_prefix_cache()
        engine.generate(prompt, _greedy(outputs))
        again = engine.generate(prompt, _greedy(6))
        results.append((again.usage.cached_tokens, again.token_ids == reference))
    assert results == [(288, True), (0, True)]


def _wait_for(engine, request_id: str, phase: str) -> None:
    for _ in range(2000):
        if engine.request_phase(request_id) == phase:
            return
        time.sleep(0.002)
    raise AssertionError(f"{request_id} never reached {phase}")


def test_aborts_mid_prefill_and_mid_decode_give_every_window_page_back(engine):
    long = engine.add_request(_prompt(1500, 4), _greedy(50))
    _wait_for(engine, long.request_id, "prefilling")
    assert engine.abort(long.request_id)
    short = engine.add_request(_prompt(30, 5), _greedy(2000))
    _wait_for(engine, short.request_id, "decoding")
    assert engine.abort(short.request_id)
    assert engine.wait_idle(30)
    kv = engine.scheduler.kv
    assert kv.swa_pages.num_free + kv.cache.side_count(0) == engine.runner.num_swa_pages, (
        "every window page free or cached"
    )


def test_a_full_window_pool_evicts_cached_window_pages_and_answers_stay_exact(model_dir, uncached):
    """One request slot: a 10-page window pool. A finished 60-token request
    leaves 3 window pages cached (7 free); a 300-token prompt holds 9 at its
    peak, so two cached pages are dropped, the deepest first (their full
    pages stay). A repeat of the short prompt then resumes after its first
    page only, the one whose window page is left."""
    e = LLMEngine(_config(model_dir, max_num_seqs=1), replica_id="window-small")
    try:
        assert e.runner.num_swa_pages == WINDOW // PAGE + 2 + CHUNK // PAGE
        short = _prompt(60, 21)
        e.generate(short, _greedy(4))
        kv = e.scheduler.kv
        assert kv.cache.side_count(0) == 3
        long = _prompt(300, 22)
        out = e.generate(long, _greedy(8))
        assert out.token_ids == uncached.generate(long, _greedy(8)).token_ids
        assert kv.cache.side_count(0) == 1 + 5, "one of short's left; long's last 5 joined"
        again = e.generate(short, _greedy(4))
        assert again.usage.cached_tokens == 16
        assert again.token_ids == uncached.generate(short, _greedy(4)).token_ids
        e.check_integrity()
        e.check_idle()
    finally:
        e.shutdown()
