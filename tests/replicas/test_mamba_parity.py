"""ferrox's Bamba (Mamba2 layers + attention) equals transformers, with its state in the recurrent pool.

ferrox runs over slots and pages handed out by the scheduler's real
``KVManager`` (three recurrent slots per sequence, the first live) and is
compared with transformers' ``BambaForCausalLM`` (its pure-torch chunk scan)
on the same random weights, fp32, over the whole sequence without a cache.
transformers scans in chunks of 16 here, so prompts of 37 and 300 tokens
cross its chunk edges and ferrox's own scan blocks (256).
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_models import PoolDriver, bamba_config, build_pair, hf_logits

TOL = 1e-4


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(96) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return build_pair(bamba_config())


def _run(driver, prompt, chunks, decodes, name="a"):
    outs, pos = [], 0
    for n in chunks:
        outs.append(driver.step({name: prompt[pos : pos + n]})[name])
        pos += n
    assert pos == len(prompt)
    tokens = list(prompt)
    for _ in range(decodes):
        nxt = int(outs[-1][-1].argmax())
        tokens.append(nxt)
        outs.append(driver.step({name: [nxt]})[name])
    return tokens, torch.cat(outs)


@pytest.mark.parametrize(
    "length, chunks",
    [
        (5, [5]),  # shorter than a conv history and a scan chunk
        (37, [37]),
        (37, [4, 8, 12, 13]),  # the state crosses three scheduler chunks
        (21, [1, 6, 14]),  # a one-token first chunk is a fresh prefill, not a decode
        (300, [300]),  # beyond one scan block of 256
    ],
)
def test_prefill_and_forty_decodes_match_transformers_at_every_position(pair, length, chunks):
    hf, ours = pair
    driver = PoolDriver(ours, page_size=4, num_pages=128)
    tokens, ours_all = _run(driver, _prompt(length), chunks, decodes=40)
    ref = hf_logits(hf, tokens)
    assert ours_all.shape == ref.shape == (length + 40, 96)
    diff = (ours_all - ref).abs().max(dim=-1).values
    assert diff.max().item() <= TOL, f"worst position {int(diff.argmax())} differs by {diff.max().item()}"
    assert ref.abs().max().item() > 0.5


def test_a_reused_slot_starts_from_zero_state(pair):
    _, ours = pair
    driver = PoolDriver(ours, page_size=4, num_slots=3)
    _run(driver, _prompt(30, 5), [30], decodes=3, name="first")
    slots = list(driver.kv.request(driver.uids["first"]).recurrent_slots)
    driver.release("first")
    _, reused = _run(driver, _prompt(17, 6), [17], decodes=5, name="second")
    assert set(driver.kv.request(driver.uids["second"]).recurrent_slots) == set(slots)  # the same three slots
    _, fresh = _run(PoolDriver(ours, page_size=4), _prompt(17, 6), [17], decodes=5)
    assert (reused - fresh).abs().max().item() <= 1e-5


def test_a_varlen_batch_of_a_prefill_chunk_and_two_decodes_equals_each_sequence_alone(pair):
    _, ours = pair
    a, b, c = _prompt(24, 1), _prompt(13, 2), _prompt(30, 3)
    together = PoolDriver(ours, page_size=4)
    together.step({"a": a[:12]})
    together.step({"b": b, "c": c})
    batch = together.step({"a": a[12:], "b": [13], "c": [21]})
    for name, steps in (("a", [a[:12], a[12:]]), ("b", [b, [13]]), ("c", [c, [21]])):
        alone = PoolDriver(ours, page_size=4)
        for chunk in steps:
            last = alone.step({name: chunk})[name]
        assert (batch[name] - last).abs().max().item() <= 1e-5, name


def test_the_mamba_layers_carry_state_so_the_parity_is_not_vacuous(pair):
    """Cutting the prompt into two sequences (no carried state) changes the second half's logits."""
    _, ours = pair
    prompt = _prompt(24, 9)
    carried = PoolDriver(ours, page_size=4)
    carried.step({"a": prompt[:12]})
    with_state = carried.step({"a": prompt[12:]})["a"]
    cut = PoolDriver(ours, page_size=4).step({"b": prompt[12:]})["b"]
    assert (with_state - cut).abs().max().item() > 1e-2
