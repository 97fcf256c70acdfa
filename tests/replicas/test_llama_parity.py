"""ferrox's paged Llama family equals transformers, and the attention plumbing under it is exact.

Every parity check compares against transformers' own model on the same
random weights (fp32, eager attention) run over the whole sequence without
a cache, so the paged path (scattered pages, varlen batches, chunked
prefill, sliding windows) is held to the unpaged reference.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from ferrox.replicas.attention import build_metadata, get_backend
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.models import get_model_class
from ferrox.replicas.models.llama import LlamaForCausalLM

TOL = 1e-4
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50, 27]  # 13 tokens: longer than every window below


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


KINDS = ["llama", "llama-tied", "llama3-rope", "linear-rope", "qwen2", "qwen2-mixed-window", "mistral-window"]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_eight_decodes_match_transformers_at_every_step(kind, tiny_config, hf_and_ferrox, paged_driver):
    hf, ours = hf_and_ferrox(tiny_config(kind))
    driver = paged_driver(ours, page_size=4)

    steps = [driver.step({"a": PROMPT})["a"]]
    tokens = list(PROMPT)
    for _ in range(8):
        nxt = int(steps[-1][-1].argmax())
        tokens.append(nxt)
        steps.append(driver.step({"a": [nxt]})["a"])

    ref = hf_logits(hf, tokens)
    ours_all = torch.cat(steps)
    assert ours_all.shape == ref.shape == (len(PROMPT) + 8, 96)
    for position in range(len(tokens)):
        diff = (ours_all[position] - ref[position]).abs().max().item()
        assert diff <= TOL, f"{kind}: position {position} differs by {diff}"
    # The weights make logits O(1), so 1e-4 is a real bound, not a tautology.
    assert ref.abs().max().item() > 0.5


def test_the_mistral_window_changes_the_logits_so_the_window_parity_is_not_vacuous(tiny_config, hf_and_ferrox, paged_driver):
    windowed = tiny_config("mistral-window")
    full = tiny_config("mistral-window")
    full.sliding_window = None
    _, ours_windowed = hf_and_ferrox(windowed)
    hf_full, _ = hf_and_ferrox(full)
    tokens = PROMPT
    windowed_logits = paged_driver(ours_windowed).step({"a": tokens})["a"]
    full_logits = hf_logits(hf_full, tokens)
    # Identical up to the window (positions 0..4 see everything either way) ...
    assert (windowed_logits[:5] - full_logits[:5]).abs().max().item() <= TOL
    # ... and different once the window bites.
    assert (windowed_logits[5:] - full_logits[5:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen2-mixed-window"])
def test_a_varlen_batch_of_a_prefill_chunk_and_two_decodes_equals_each_sequence_alone(kind, tiny_config, hf_and_ferrox, paged_driver):
    hf, ours = hf_and_ferrox(tiny_config(kind))
    a = [7, 1, 30, 44, 12, 9, 80, 3, 61, 22]  # prefilled 6, then a 4-token chunk
    b = [11, 52, 6, 19, 40, 2, 73]  # prefilled, then decodes one token
    c = [90, 4, 4, 18, 33, 27, 5, 66, 12, 8, 1, 49]  # prefilled, then decodes one token

    together = paged_driver(ours, seed=3)
    together.step({"a": a[:6]})
    together.step({"b": b, "c": c})
    batch = together.step({"a": a[6:], "b": [13], "c": [21]})

    for seq, first, rest in (("a", a[:6], a[6:]), ("b", b, [13]), ("c", c, [21])):
        alone = paged_driver(ours, seed=5)
        alone.step({seq: first})
        single = alone.step({seq: rest})[seq]
        assert (batch[seq] - single).abs().max().item() <= 1e-5, seq

    # And the batch still matches transformers.
    assert (batch["a"] - hf_logits(hf, a)[6:]).abs().max().item() <= TOL
    assert (batch["b"][0] - hf_logits(hf, b + [13])[-1]).abs().max().item() <= TOL
    assert (batch["c"][0] - hf_logits(hf, c + [21])[-1]).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_a_prompt_prefilled_in_three_chunks_equals_the_whole_prefill(kind, tiny_config, hf_and_ferrox, paged_driver):
    _, ours = hf_and_ferrox(tiny_config(kind))
    whole = paged_driver(ours, seed=7)
    chunked = paged_driver(ours, seed=8)

    whole_logits = whole.step({"s": PROMPT})["s"]
    chunk_logits = torch.cat(
        [chunked.step({"s": PROMPT[:5]})["s"], chunked.step({"s": PROMPT[5:9]})["s"], chunked.step({"s": PROMPT[9:]})["s"]]
    )
    assert (chunk_logits - whole_logits).abs().max().item() <= 1e-5
    # The caches now hold the same context: the next decode agrees too.
    nxt = int(whole_logits[-1].argmax())
    assert (whole.step({"s": [nxt]})["s"] - chunked.step({"s": [nxt]})["s"]).abs().max().item() <= 1e-5


def test_pages_that_slid_out_of_the_window_are_never_read(tiny_config, hf_and_ferrox, paged_driver):
    # The window pool frees a request's slid-out pages while it runs and hands
    # them to others. Fill them with NaN: any read of them, masked or not,
    # would poison the output (0 * NaN is NaN).
    hf, ours = hf_and_ferrox(tiny_config("mistral-window"))
    driver = paged_driver(ours, page_size=4, seed=11)
    short = [31, 32, 33]
    driver.step({"a": PROMPT, "y": short, "z": [9, 8, 7, 6, 5, 4, 3, 2]})
    # a's next query sits at position 13 and sees positions 9..13: its pages 0 and 1 are dead.
    dead = driver.pages["z"][0:2]
    driver.pages["a"][0:2] = dead
    driver.cache.k[:, dead] = float("nan")
    driver.cache.v[:, dead] = float("nan")
    out = driver.step({"a": [42], "y": [43]})  # one batched decode, y's row padded
    assert (out["a"][0] - hf_logits(hf, PROMPT + [42])[-1]).abs().max().item() <= TOL
    assert (out["y"][0] - hf_logits(hf, short + [43])[-1]).abs().max().item() <= TOL


def test_a_decode_batch_is_one_padded_attention_call_and_matches_transformers(tiny_config, hf_and_ferrox, paged_driver):
    hf, ours = hf_and_ferrox(tiny_config("llama"))
    driver = paged_driver(ours, seed=9)
    prompts = {"x": PROMPT[:3], "y": PROMPT, "z": PROMPT[:8]}
    driver.step(prompts)
    out = driver.step({"x": [1], "y": [2], "z": [3]})
    for seq, nxt in (("x", 1), ("y", 2), ("z", 3)):
        ref = hf_logits(hf, prompts[seq] + [nxt])[-1]
        assert (out[seq][0] - ref).abs().max().item() <= TOL


# ----------------------------------------------------------------------------- the plumbing


def test_build_metadata_maps_each_new_token_to_its_page_slot():
    meta = build_metadata(query_lens=[3, 1], seq_lens=[5, 6], page_tables=[[7, 2], [4, 9, 1]], page_size=4, device="cpu")
    # seq 0: positions 2,3 on page 7, position 4 on page 2; seq 1: position 5 on page 9.
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 6]
    assert meta.page_table.tolist() == [[7, 2, 0], [4, 9, 1]]
    assert meta.page_table.dtype == torch.int32
    assert (meta.query_lens, meta.seq_lens_host, meta.max_query_len, meta.max_seq_len) == ([3, 1], [5, 6], 3, 6)
    assert meta.positions().tolist() == [2, 3, 4, 5]


def test_build_metadata_rejects_a_page_table_too_short_for_its_sequence():
    with pytest.raises(ValueError, match="9 tokens need 3 pages of 4"):
        build_metadata([1], [9], [[0, 1]], 4, "cpu")


def test_bytes_per_page_counts_k_and_v_over_all_layers():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32, 16-token pages.
    assert KVCache.bytes_per_page(30, 16, 3, 64, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4 == 737280
    assert KVCache.bytes_per_page(30, 16, 3, 64, torch.bfloat16) == 368640
    cache = KVCache.allocate(2, 5, 4, 3, 8, torch.float32, "cpu")
    assert cache.k.shape == cache.v.shape == (2, 5, 4, 3, 8)
    assert cache.k.numel() * 4 * 2 == KVCache.bytes_per_page(2, 4, 3, 8, torch.float32) * 5


def test_the_flash_backend_on_cpu_raises_and_names_the_flash_extra():
    with pytest.raises(RuntimeError, match=r"`flash` extra"):
        get_backend("flash", "cpu")


def test_auto_falls_back_to_sdpa_on_cpu_and_unknown_backends_are_refused():
    assert get_backend("auto", "cpu").name == "sdpa"
    assert get_backend("sdpa", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        get_backend("xformers", "cpu")


def test_the_registry_maps_each_family_and_refuses_others_by_name(tiny_config):
    for kind in ("llama", "qwen2", "mistral-window"):
        assert get_model_class(tiny_config(kind)) is LlamaForCausalLM
    gpt2 = transformers.GPT2Config()
    with pytest.raises(ValueError, match="GPT2LMHeadModel|gpt2"):
        get_model_class(gpt2)


def test_an_unsupported_rope_type_is_refused_by_name(tiny_config):
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        LlamaForCausalLM(config, torch.float32, "cpu")


def test_load_weights_refuses_missing_and_unexpected_names(tiny_config, hf_and_ferrox):
    hf, ours = hf_and_ferrox(tiny_config("llama"))
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        ours.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match=r"unexpected weights: model\.layers\.0\.self_attn\.q_norm\.weight"):
        ours.load_weights(state.items())


def test_the_engine_facing_attributes_describe_the_model(tiny_config, hf_and_ferrox):
    _, ours = hf_and_ferrox(tiny_config("mistral-window"))
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.vocab_size, ours.sliding_window) == (2, 2, 16, 96, 5)
    _, mixed = hf_and_ferrox(tiny_config("qwen2-mixed-window"))
    # One full-attention layer means the model needs the full KV pool.
    assert mixed.sliding_window is None and mixed.layer_windows == [None, 5]
    _, llama = hf_and_ferrox(tiny_config("llama"))
    assert llama.sliding_window is None
