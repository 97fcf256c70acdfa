"""``ferrox bench offline``: output tokens/s of ferrox vs transformers on the same weights.

Workload W (issue 3): 64 chat prompts "Write a long story about the number
{i}.", greedy, exactly ``--max-tokens`` (128) new tokens each (EOS ignored).
Reports, in one run and side by side: output tok/s at concurrency 1 (the
first ``--single`` prompts one at a time) and at concurrency 64 (all at
once), for ferrox's engine and for ``transformers`` ``generate`` (batch 64,
left-padded), their ratios, and peak RSS. Each side names the dtype and
quantization it ran: ferrox's are the engine's (``--dtype``,
``--quantization``, "auto" by default: bfloat16 plus GGUF int4 for small
steps on a CPU with AMX-BF16), transformers runs float32 as the issue
specifies, and ``--transformers-bf16`` adds a bfloat16 transformers run for
a like-for-like comparison.

A benchmark, not a test: it prints figures and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def workload(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a long story about the number {i}."}] for i in range(n)]


def _encode(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def workload_kv_bytes(hf_config, prompts: list[list[int]], max_tokens: int, page_size: int = 16) -> int:
    """A CPU KV budget (bytes) that seats every prompt of the workload at once.

    Concurrency N means N requests decoding together, as transformers' batch
    does: each reserves its prompt plus its whole output budget, rounded up
    to pages, plus one page of slack (the scheduler's per-request margin).
    Counted as full attention in fp32 (``2 * layers * kv_heads * head_dim * 4``
    bytes per token), an overestimate for window and recurrent layers. At
    least 256 MiB.
    """
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    per_token = 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * 4
    tokens = sum(-(-(len(p) + max_tokens) // page_size) * page_size + page_size for p in prompts)
    return max(256 << 20, tokens * per_token)


def write_tiny_model(kind: str, directory) -> str:
    """Write a tiny random-weight model of a window or hybrid family as a Hugging Face
    directory (safetensors + the embedded SmolLM2 tokenizer); returns its path.

    ``kind``: ``"window"`` (Qwen3, layers sliding/full alternating, window 64)
    or ``"hybrid"`` (Bamba, Mamba2 / attention / Mamba2). Hidden size 64, so
    the figures measure the engine's per-step overhead and pools, not matmuls.
    """
    import shutil
    from pathlib import Path

    import torch
    import transformers

    from ferrox.replicas.loader import DEFAULT_MODEL, resolve_model

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=112, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
    if kind == "window":
        config = transformers.Qwen3Config(**common, num_hidden_layers=4, head_dim=16, use_sliding_window=True,
                                          sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2)
    elif kind == "hybrid":
        config = transformers.BambaConfig(**common, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8,
                                          mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (window | hybrid)")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer_dir = resolve_model(DEFAULT_MODEL).path
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return str(directory)


def run_offline(ns: argparse.Namespace) -> int:
    import torch

    from ferrox.replicas.config import EngineConfig
    from ferrox.replicas.engine import LLMEngine
    from ferrox.replicas.types import SamplingParams

    from ferrox.replicas.loader import load_tokenizer, resolve_model
    from ferrox.scheduler.radix import SIDE_STATE, SIDE_WINDOW

    threads = ns.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    rss0 = _rss_mb()
    files = resolve_model(ns.model)
    prompts = [_encode(load_tokenizer(files), m) for m in workload(ns.prompts)]
    config = EngineConfig(model=ns.model, device=ns.device, torch_threads=threads,
                          dtype=getattr(ns, "dtype", "auto"), quantization=getattr(ns, "quantization", "auto"),
                          max_num_seqs=max(64, ns.prompts), max_prefill_tokens=2048,
                          kv_cache_bytes=workload_kv_bytes(files.config, prompts, ns.max_tokens))
    engine = LLMEngine(config)
    # Peak use of the window and recurrent pools, read before every forward pass.
    kv = engine.scheduler.kv
    # Held by requests, and held in all (requests + the prefix cache's
    # window pages / snapshots, which are evictable).
    peak = {"swa": 0, "recurrent": 0, "swa_all": 0, "recurrent_all": 0}
    execute = engine.runner.execute

    def _tracking(step, states):
        swa_all = kv.swa_pages.num_pages - kv.swa_pages.num_free
        rec_all = kv.recurrent.num_pages - kv.recurrent.num_free
        peak["swa_all"] = max(peak["swa_all"], swa_all)
        peak["recurrent_all"] = max(peak["recurrent_all"], rec_all)
        peak["swa"] = max(peak["swa"], swa_all - kv.cache.side_count(SIDE_WINDOW))
        peak["recurrent"] = max(peak["recurrent"], rec_all - kv.cache.side_count(SIDE_STATE))
        return execute(step, states)

    engine.runner.execute = _tracking
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    model = engine.runner.model
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    int4 = getattr(model, "int4", None) or []
    int4_mb = sum(lin.nbytes for layer in int4 for lin in layer) / 2**20
    kv_mb = engine.runner.num_pages * engine.runner.bytes_per_page() / 2**20
    quant = engine.runner.quantization
    if quant != "none":
        quant += f" ({int4_mb:.0f} MB, steps of <= {model.int4_max_tokens} tokens)"
    print(f"model {engine.model_name}: {weights_mb:.0f} MB weights, {threads} threads, device {engine.runner.device}, "
          f"KV pool {kv_mb:.0f} MB")
    print(f"ferrox        dtype {str(engine.runner.dtype).removeprefix('torch.')}, quantization {quant}")
    weights_mb += int4_mb

    # Warm-up (first-call allocations), not timed.
    engine.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    results: dict[str, float] = {}
    t0 = time.perf_counter()
    produced = 0
    for ids in prompts[: ns.single]:
        produced += engine.generate(ids, params).usage.completion_tokens
    results["ferrox_c1"] = produced / (time.perf_counter() - t0)
    print(f"ferrox        concurrency 1 : {results['ferrox_c1']:7.1f} tok/s  ({produced} tokens)", flush=True)

    t0 = time.perf_counter()
    streams = [engine.add_request(ids, params) for ids in prompts]
    produced = sum(s.result().usage.completion_tokens for s in streams)
    elapsed = time.perf_counter() - t0
    results["ferrox_cN"] = produced / elapsed
    print(f"ferrox        concurrency {len(prompts)}: {results['ferrox_cN']:7.1f} tok/s  ({produced} tokens in {elapsed:.1f}s)",
          flush=True)
    engine.check_integrity()
    if engine.runner.num_swa_pages:
        print(f"window pool peak: {peak['swa']} of {engine.runner.num_swa_pages} pages held by requests "
              f"({peak['swa'] * engine.page_size} tokens, window {engine.runner.sliding_window}); "
              f"{peak['swa_all']} with the prefix cache's")
    if engine.runner.num_recurrent_slots:
        print(f"recurrent pool peak: {peak['recurrent']} of {engine.runner.num_recurrent_slots} slots held by "
              f"requests; {peak['recurrent_all']} with the prefix cache's snapshots")
    ferrox_rss = _rss_mb()
    print(f"peak RSS after ferrox: {ferrox_rss:.0f} MB (start {rss0:.0f} MB; weights + KV + 600 MB = "
          f"{rss0 + weights_mb + kv_mb + 600:.0f} MB)")
    engine.shutdown()

    if not ns.skip_transformers:
        from transformers import AutoTokenizer

        path = engine.files.path
        tok = AutoTokenizer.from_pretrained(path)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        runs = [("transformers", torch.float32)]
        if getattr(ns, "transformers_bf16", False):
            runs.append(("transformers", torch.bfloat16))
        for label, dtype in runs:
            print(f"{label:<13} dtype {str(dtype).removeprefix('torch.')}, quantization none", flush=True)
            key = "hf" if dtype == torch.float32 else "hf_bf16"
            results[f"{key}_c1"], results[f"{key}_cN"] = _transformers(path, dtype, prompts, ns, pad, label)
        print()
        print(f"{'':14}{'ferrox':>10}{'transformers':>14}{'ratio':>8}")
        print(f"{'concurrency 1':14}{results['ferrox_c1']:10.1f}{results['hf_c1']:14.1f}{results['ferrox_c1'] / results['hf_c1']:8.2f}")
        print(f"{'concurrency ' + str(len(prompts)):14}{results['ferrox_cN']:10.1f}{results['hf_cN']:14.1f}"
              f"{results['ferrox_cN'] / results['hf_cN']:8.2f}")
    return 0


def _transformers(path, dtype, prompts: list[list[int]], ns: argparse.Namespace, pad: int, label: str) -> tuple[float, float]:
    """transformers ``generate`` on W in ``dtype``: (tok/s at concurrency 1, tok/s at batch len(prompts))."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    gen = dict(max_new_tokens=ns.max_tokens, min_new_tokens=ns.max_tokens, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        produced = 0
        for ids in prompts[: ns.single]:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **gen)
            produced += out.shape[1] - len(ids)
        c1 = produced / (time.perf_counter() - t0)
        print(f"{label:<13} concurrency 1 : {c1:7.1f} tok/s", flush=True)
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **gen)
        elapsed = time.perf_counter() - t0
        cn = (out.shape[1] - width) * len(prompts) / elapsed
        print(f"{label:<13} batch {len(prompts)}      : {cn:7.1f} tok/s", flush=True)
    return c1, cn
