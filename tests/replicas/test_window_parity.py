"""ferrox's two-pool Qwen3 (interleaved sliding-window and full layers) equals transformers.

Every check runs ferrox's model over pages handed out by the scheduler's real
``KVManager`` (window pages freed as the window slides) and compares with
transformers' ``Qwen3ForCausalLM`` on the same random weights, fp32, eager,
over the whole sequence without a cache. Window 8, page 4: a prompt of 37
tokens spans the window four times over, and 40 decodes run past it.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_models import PoolDriver, build_pair, hf_logits, window_config

TOL = 1e-4
WINDOW = 8
PAGE = 4


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(96) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return build_pair(window_config(WINDOW))


def _run(driver: PoolDriver, prompt: list[int], chunks: list[int], decodes: int) -> tuple[list[int], torch.Tensor]:
    outs, pos = [], 0
    for n in chunks:
        outs.append(driver.step({"a": prompt[pos : pos + n]})["a"])
        pos += n
    assert pos == len(prompt)
    tokens = list(prompt)
    for _ in range(decodes):
        nxt = int(outs[-1][-1].argmax())
        tokens.append(nxt)
        outs.append(driver.step({"a": [nxt]})["a"])
    return tokens, torch.cat(outs)


@pytest.mark.parametrize(
    "length, chunks",
    [
        (5, [5]),  # shorter than the window
        (37, [37]),  # one chunk, four windows long
        (37, [4, 8, 12, 13]),  # page-aligned chunks; the second straddles the window edge at 8
        (21, [6, 3, 12]),  # ragged chunks, each crossing a page and the window edge
    ],
)
def test_prefill_and_forty_decodes_past_the_window_match_transformers_at_every_position(pair, length, chunks):
    hf, ours = pair
    driver = PoolDriver(ours, page_size=PAGE)
    tokens, ours_all = _run(driver, _prompt(length), chunks, decodes=40)
    ref = hf_logits(hf, tokens)
    assert ours_all.shape == ref.shape == (length + 40, 96)
    diff = (ours_all - ref).abs().max(dim=-1).values
    assert diff.max().item() <= TOL, f"worst position {int(diff.argmax())} differs by {diff.max().item()}"
    assert ref.abs().max().item() > 0.5  # logits O(1): the bound is not a tautology


def test_the_window_pool_holds_only_what_the_window_needs_and_frees_it_at_the_end(pair):
    _, ours = pair
    driver = PoolDriver(ours, page_size=PAGE, num_swa_pages=16)
    _run(driver, _prompt(37), [4, 8, 12, 13], decodes=40)
    held = driver.window_pages_held["a"]
    # Chunks end at 4, 12, 24, 37. Before each step the pages of positions
    # older than window + one page of the last step's end were given back:
    # [0,4) 1 page; [0,12) 3; [0,24) 6; [12,37) 7; then [24,38) 4 while decoding.
    assert held[:4] == [1, 3, 6, 7]
    assert held[4:] == [4] * 40
    # The bound: window + the chunk + 2 pages, whatever the length.
    for pages, chunk in zip(held, [4, 8, 12, 13] + [1] * 40):
        assert pages <= WINDOW // PAGE + -(-chunk // PAGE) + 2
    driver.release("a")
    assert driver.kv.swa_pages.num_free == 16
    driver.kv.check_idle()


def test_the_window_changes_the_logits_so_the_window_parity_is_not_vacuous(pair):
    _, windowed = pair
    full_cfg = window_config(WINDOW)
    full_cfg.layer_types = ["full_attention"] * full_cfg.num_hidden_layers
    hf_full, _ = build_pair(full_cfg)
    tokens = _prompt(20)
    ours = PoolDriver(windowed, page_size=PAGE).step({"a": tokens})["a"]
    full = hf_logits(hf_full, tokens)
    assert (ours[:WINDOW] - full[:WINDOW]).abs().max().item() <= TOL
    assert (ours[WINDOW:] - full[WINDOW:]).abs().max().item() > 1e-2


def test_a_varlen_batch_of_a_prefill_chunk_and_two_decodes_equals_each_sequence_alone(pair):
    _, ours = pair
    a, b, c = _prompt(24, 1), _prompt(13, 2), _prompt(30, 3)
    together = PoolDriver(ours, page_size=PAGE)
    together.step({"a": a[:12]})
    together.step({"b": b, "c": c})
    batch = together.step({"a": a[12:], "b": [13], "c": [21]})
    for name, steps in (("a", [a[:12], a[12:]]), ("b", [b, [13]]), ("c", [c, [21]])):
        alone = PoolDriver(ours, page_size=PAGE)
        for chunk in steps:
            last = alone.step({name: chunk})[name]
        assert (batch[name] - last).abs().max().item() <= 1e-5, name
