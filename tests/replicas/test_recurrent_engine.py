"""The engine serving a Mamba2 hybrid (tiny random Bamba) end to end, its state in the recurrent pool.

The model is written as a Hugging Face directory (safetensors + the
embedded SmolLM2 tokenizer) and loaded by the engine like any checkpoint.
With 7 recurrent slots (three per request), two requests run and a third
waits with ``RECURRENT_BUDGET`` until one ends. Greedy output is compared
token for token with transformers on the same weights, chunked prefill
(state carried across 16-token chunks) with unchunked, and prefix-cache hits
(resuming from a recurrent snapshot) with an engine that has no cache. After every test the
engine must go idle with every page and slot accounted for.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from ferrox.replicas.config import EngineConfig
from ferrox.replicas.engine import LLMEngine
from ferrox.replicas.types import SamplingParams
from ferrox.scheduler.admission import NotAdmitted
from hybrid_models import bamba_config, build_pair, hf_logits, save_tiny_model

PAGE = 16
VOCAB = 49152


def _config(path, **overrides) -> EngineConfig:
    base = dict(model=str(path), dtype="float32", page_size=PAGE, max_prefill_tokens=16, max_num_seqs=4,
                kv_cache_bytes=16 << 20, torch_threads=1, seed=0, num_recurrent_slots=7)
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_files):
    return save_tiny_model(bamba_config(vocab=VOCAB, max_pos=4096), tmp_path_factory.mktemp("bamba"), smollm2_files.path)


@pytest.fixture(scope="module")
def engine(model_dir):
    before = torch.get_num_threads()
    e = LLMEngine(_config(model_dir), replica_id="hybrid")
    yield e
    e.shutdown()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def unchunked(model_dir):
    e = LLMEngine(_config(model_dir, max_prefill_tokens=2048, num_recurrent_slots=None), replica_id="hybrid-unchunked")
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


def test_the_engine_sizes_a_recurrent_pool_and_reports_it(engine, unchunked):
    assert engine.runner.num_recurrent_slots == 7
    assert engine.scheduler.kv.recurrent.num_pages == 7
    assert engine.runner.caches.recurrent.ssm.shape == (2, 7, 8, 16, 16)  # mamba layers, slots, heads, P, N
    assert engine.runner.spec.full_layers == 1  # one attention layer on the full pool
    assert engine.refresh_snapshot().recurrent_slots_available == 7
    assert engine.refresh_snapshot().swa_tokens_available is None
    # Sized from the budget: three slots per request slot.
    assert unchunked.runner.num_recurrent_slots == 3 * 4


def test_with_seven_slots_two_requests_run_and_the_third_waits_for_recurrent_budget(engine):
    engine.reset_prefix_cache()  # no cached snapshot to evict: the pool is exactly 7 free slots
    seen: list[tuple[frozenset, NotAdmitted | None, int]] = []
    execute = engine.runner.execute

    def watching(step, states):
        seen.append((frozenset(s.uid for s in step.seqs), engine.scheduler.last_blocked,
                     engine.scheduler.kv.recurrent.num_free))
        return execute(step, states)

    engine.runner.execute = watching
    try:
        streams = [engine.add_request(_prompt(5, i), _greedy(n)) for i, n in enumerate((6, 30, 4))]
        outs = [s.result() for s in streams]
    finally:
        del engine.runner.execute
    assert [len(o.token_ids) for o in outs] == [6, 30, 4]
    first, second, third = sorted({u for uids, _, _ in seen for u in uids})
    first_end = max(i for i, (uids, _, _) in enumerate(seen) if first in uids)
    third_start = min(i for i, (uids, _, _) in enumerate(seen) if third in uids)
    # The third is never in a step before the first one ended ...
    assert third_start > first_end
    # ... and while it waited, the reason was the recurrent pool, one slot free.
    waits = [(blocked, free) for uids, blocked, free in seen[:third_start] if second in uids]
    assert waits and all(b is NotAdmitted.RECURRENT_BUDGET and f == 1 for b, f in waits)


def test_greedy_tokens_equal_transformers_on_the_same_weights(engine):
    hf, _ = build_pair(bamba_config(vocab=VOCAB, max_pos=4096))
    prompt = _prompt(70, 2)
    out = engine.generate(prompt, _greedy(12))
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    assert out.token_ids == tokens[len(prompt):]


def test_chunked_and_unchunked_prefill_give_identical_greedy_tokens(engine, unchunked):
    prompts = [_prompt(n, 10 + n) for n in (9, 100, 257)]
    a = [engine.generate(p, _greedy(16)).token_ids for p in prompts]
    b = [s.result().token_ids for s in [unchunked.add_request(p, _greedy(16)) for p in prompts]]
    assert a == b


@pytest.fixture(scope="module")
def uncached(model_dir):
    e = LLMEngine(_config(model_dir, enable_prefix_caching=False, num_recurrent_slots=None), replica_id="hybrid-uncached")
    yield e
    e.shutdown()


@pytest.mark.parametrize("name", ["engine", "unchunked"])
def test_a_repeated_prompt_resumes_from_its_snapshot_with_identical_greedy_tokens(name, request, uncached):
    """The prompt snapshot (state after 64 of 80 tokens) is taken at a chunk's
    end in the chunked engine and inside the one chunk in the unchunked one."""
    e = request.getfixturevalue(name)
    e.reset_prefix_cache()
    prompt = _prompt(80, 3)
    reference = uncached.generate(prompt, _greedy(20))
    first = e.generate(prompt, _greedy(20))
    second = e.generate(prompt, _greedy(20))
    assert (reference.usage.cached_tokens, first.usage.cached_tokens, second.usage.cached_tokens) == (0, 0, 64)
    assert first.token_ids == reference.token_ids
    assert second.token_ids == reference.token_ids


@pytest.mark.parametrize("name", ["engine", "unchunked"])
def test_a_follow_up_turn_resumes_from_the_latest_snapshot_with_identical_greedy_tokens(name, request, uncached):
    e = request.getfixturevalue(name)
    e.reset_prefix_cache()
    prompt = _prompt(75, 7)
    first = e.generate(prompt, _greedy(30))  # computes 104 positions: latest boundary 96
    turn = prompt + first.token_ids + _prompt(9, 8)
    reference = uncached.generate(turn, _greedy(12))
    follow_up = e.generate(turn, _greedy(12))
    assert follow_up.usage.cached_tokens == 96
    assert follow_up.token_ids == reference.token_ids


def test_new_requests_evict_cached_snapshots_and_every_answer_stays_exact(engine, uncached):
    """7 slots: a finished request leaves snapshots at 64 and 96 cached (5
    free); two new requests need 6, so the least recently used snapshot --
    the deeper one, 96 -- is dropped; a repeat still resumes from 64."""
    engine.reset_prefix_cache()
    prompt = _prompt(80, 11)
    first = engine.generate(prompt, _greedy(20))
    kv = engine.scheduler.kv
    assert (kv.recurrent.num_free, kv.cache.side_count(1)) == (5, 2)
    conversation = prompt + first.token_ids[:19] + [7]
    others = [_prompt(20, 12), _prompt(20, 13)]
    streams = [engine.add_request(p, _greedy(8)) for p in others]
    outs = [s.result() for s in streams]
    # A's snapshot at 64 is left, and B's and C's own at 16 joined it.
    assert kv.cache.side_count(1) == 3 and kv.recurrent.num_free == 4
    assert [o.token_ids for o in outs] == [uncached.generate(p, _greedy(8)).token_ids for p in others]
    assert kv.match(conversation).cached_len == 64, "the snapshot at 96 is gone"
    again = engine.generate(prompt, _greedy(10))
    assert again.usage.cached_tokens == 64
    assert again.token_ids == uncached.generate(prompt, _greedy(10)).token_ids


def test_a_shared_prefix_without_a_snapshot_is_recomputed(engine, uncached):
    engine.reset_prefix_cache()
    engine.generate(_prompt(80, 3), _greedy(4))
    other = _prompt(80, 3)[:40] + _prompt(40, 9)  # shares 2 pages, no snapshot ends there
    out = engine.generate(other, _greedy(8))
    assert out.usage.cached_tokens == 0
    assert out.token_ids == uncached.generate(other, _greedy(8)).token_ids


def _wait_for(engine, request_id: str, phase: str) -> None:
    for _ in range(2000):
        if engine.request_phase(request_id) == phase:
            return
        time.sleep(0.002)
    raise AssertionError(f"{request_id} never reached {phase}")


def test_aborts_at_every_stage_leak_no_recurrent_slot(engine):
    prefilling = engine.add_request(_prompt(600, 4), _greedy(50))  # 38 chunks of 16
    decoding = engine.add_request(_prompt(20, 5), _greedy(3000))
    waiting = engine.add_request(_prompt(20, 6), _greedy(50))  # 6 of 7 slots are taken: it waits
    _wait_for(engine, prefilling.request_id, "prefilling")
    assert engine.request_phase(waiting.request_id) == "waiting"
    assert engine.abort(waiting.request_id)
    assert engine.abort(prefilling.request_id)
    _wait_for(engine, decoding.request_id, "decoding")
    assert engine.abort(decoding.request_id)
    assert engine.wait_idle(30)
    kv = engine.scheduler.kv
    assert kv.recurrent.num_free + kv.cache.side_count(1) == 7, "every slot free or a cached snapshot"
    # The freed slots serve again, from zero state: the same prompt gives the same tokens as before.
    before = engine.generate(_prompt(70, 2), _greedy(12)).token_ids
    assert engine.generate(_prompt(70, 2), _greedy(12)).token_ids == before
