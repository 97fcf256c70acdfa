"""The CPU fast mode: dtype "auto", the GGUF int4 path, and the engine thread that owns torch.

The int4 path is exercised with an explicit ``quantization="gguf_int4"`` and
``dtype="bfloat16"``, so it runs (slower) on CPUs without AMX too; what
"auto" picks is checked by faking the CPU probe.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ferrox.replicas import runner as runner_module
from ferrox.replicas.attention import build_metadata
from ferrox.replicas.config import EngineConfig
from ferrox.replicas.engine import LLMEngine
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.loader import Q4Weight, load_q4_weights, load_weights_iter
from ferrox.replicas.quant import INT4_MAX_TOKENS, Int4Linear, resolve_quantization
from ferrox.replicas.runner import resolve_dtype
from ferrox.replicas.types import SamplingParams

CPU = torch.device("cpu")


def _random_q4(n: int, k: int, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    minimum = (-torch.rand(n, k // 32, generator=g) * 0.2).half()
    return Q4Weight(codes, scale, minimum)


# ------------------------------------------------------------------ dtype and setting


def test_auto_dtype_is_bfloat16_on_a_cpu_with_amx_and_float32_without(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("float32", CPU) == torch.float32


def test_auto_quantization_is_int4_only_where_it_can_run():
    assert resolve_quantization("auto", CPU, torch.bfloat16, True) == "gguf_int4"
    assert resolve_quantization("auto", CPU, torch.float32, True) == "none"
    assert resolve_quantization("auto", torch.device("cuda"), torch.bfloat16, True) == "none"
    assert resolve_quantization("auto", CPU, torch.bfloat16, False) == "none"
    assert resolve_quantization("none", CPU, torch.bfloat16, True) == "none"


def test_an_explicit_int4_that_cannot_run_says_why():
    with pytest.raises(ValueError) as info:
        resolve_quantization("gguf_int4", CPU, torch.float32, False)
    assert str(info.value) == (
        "quantization='gguf_int4' cannot run: dtype is torch.float32, the int4 path runs bfloat16 activations "
        "(set dtype='bfloat16'); the model is not a Llama-family GGUF whose linear weights are all Q4_0/Q4_1"
    )
    with pytest.raises(ValueError, match="unknown quantization 'int8'; choose one of auto, none, gguf_int4"):
        resolve_quantization("int8", CPU, torch.bfloat16, True)


# ------------------------------------------------------------------ the kernel


def test_an_int4_linear_equals_the_gguf_weights_up_to_bfloat16_scales_and_output():
    # The kernel reads s and z in bfloat16 (relative error <= 2**-8 each, so a
    # weight is off by <= 2**-8 * (8|s| + |z|) since |q - 8| <= 8) and rounds
    # its output to bfloat16 (<= 2**-8 relative); float32 accumulation over
    # K = 128 adds far less than the 1e-5 slack.
    parts = [_random_q4(64, 128, 0), _random_q4(32, 128, 1)]
    linear = Int4Linear.from_q4(parts)
    assert linear.out_features == 96
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = linear(x).double()
    exact_w = torch.cat([p.dequantize() for p in parts]).double()
    exact = x.double() @ exact_w.t()
    scale = torch.cat([p.scale for p in parts]).double()
    zero = torch.cat([p.min for p in parts]).double() + 8 * scale
    weight_err = (2**-8 * (8 * scale.abs() + zero.abs())).repeat_interleave(32, dim=1)
    bound = 1.01 * (x.double().abs() @ weight_err.t()) + 2**-8 * exact.abs() + 1e-5
    assert bool(((y - exact).abs() <= bound).all())
    # ... and it is not the other plausible convention (q * s + z).
    assert float((y - exact).abs().max()) < 0.05 < float((exact - x.double() @ (exact_w + 8 * scale.repeat_interleave(32, 1)).t()).abs().max())


def test_q4_parts_must_share_an_input_size_that_is_a_multiple_of_32():
    with pytest.raises(ValueError, match=r"share one input size that is a multiple of 32, got \[64, 128\]"):
        Int4Linear.from_q4([_random_q4(8, 64, 0), _random_q4(8, 128, 1)])


# ------------------------------------------------------------------ the converted SmolLM2


def test_the_kept_q4_codes_dequantize_to_exactly_the_converted_smollm2_weights(smollm2_files):
    q4 = load_q4_weights(smollm2_files)
    assert len(q4) == 210  # 7 linear weights x 30 layers, all Q4_1; the Q8_0 embedding is not kept
    dense = dict(load_weights_iter(smollm2_files))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(q4[name].dequantize(), dense[name]), name


def _smollm2_model(smollm2_files, quantized: bool):
    from ferrox.replicas.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(smollm2_files.config, dtype=torch.bfloat16, device=CPU)
    model.load_weights(load_weights_iter(smollm2_files))
    if quantized:
        model.load_q4(load_q4_weights(smollm2_files))
    return model


def _hidden(model, n: int) -> torch.Tensor:
    kv = KVCache.allocate(model.num_layers, 2, 16, model.num_kv_heads, model.head_dim, torch.bfloat16, CPU)
    meta = build_metadata([n], [n], [[0]], 16, CPU)
    ids = torch.arange(100, 100 + n)
    return model(ids, meta.positions(), kv, meta)


def test_steps_above_the_int4_limit_run_the_dense_weights(smollm2_files):
    dense = _smollm2_model(smollm2_files, quantized=False)
    int4 = _smollm2_model(smollm2_files, quantized=True)
    assert INT4_MAX_TOKENS == 4
    big = INT4_MAX_TOKENS + 1
    assert torch.equal(_hidden(int4, big), _hidden(dense, big))
    assert not torch.equal(_hidden(int4, INT4_MAX_TOKENS), _hidden(dense, INT4_MAX_TOKENS))


def test_the_int4_engine_decodes_the_float32_engines_greedy_tokens(smollm2_files):
    # Observed on the 2-core AMX box: all 24 greedy tokens of each prompt (12 kept here,
    # fewer chances of a near tie on another CPU) agree with the float32 engine
    # (prefill runs dense bfloat16, decode int4).
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, settings in (("fp32", dict(dtype="float32")), ("int4", dict(dtype="bfloat16", quantization="gguf_int4"))):
        engine = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20, torch_threads=1, max_num_seqs=4, **settings))
        try:
            assert engine.runner.quantization == ("gguf_int4" if name == "int4" else "none")
            ids = [engine.tokenizer(text).input_ids for text in prompts]
            outputs[name] = [engine.generate(i, params).token_ids for i in ids]
        finally:
            engine.shutdown()
    assert outputs["int4"] == outputs["fp32"]
    assert outputs["fp32"][0][:8] == [7042, 30, 198, 198, 504, 2988, 314, 42]


# ------------------------------------------------------------------ the engine thread


def test_the_engine_loads_its_weights_in_its_loop_thread(monkeypatch):
    built_in = []
    original = runner_module.ModelRunner.__init__

    def recording(self, *args, **kwargs):
        built_in.append(threading.current_thread().name)
        original(self, *args, **kwargs)

    monkeypatch.setattr(runner_module.ModelRunner, "__init__", recording)
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=16 << 20, torch_threads=1), replica_id="where")
    try:
        assert built_in == ["ferrox-engine-where"]
        assert engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)).usage.completion_tokens == 2
    finally:
        engine.shutdown()


def test_a_runner_that_fails_to_build_fails_the_constructor():
    with pytest.raises(RuntimeError, match="the KV budget of 1024 bytes holds no page"):
        LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=1024, torch_threads=1))
