"""The paged Llama-family decoder: Llama, SmolLM2, Qwen2 (qkv bias), Mistral (sliding window).

Decided here: one implementation of the Llama block (RMSNorm, grouped-query
attention with rotary position embeddings, SiLU-gated MLP) that runs varlen
batches against the paged KV cache through an attention backend, and how
Hugging Face parameter names map onto it. Its logits equal transformers'
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` on the
same weights (tests/replicas/test_llama_parity.py holds them to 1e-4 in fp32).

Why it looks the way it does: on a CPU a 135M-parameter decode step is a
few dozen small matmuls, so Python and dispatch overhead matter as much as
FLOPs. q/k/v are one fused ``[Hq*D + 2*Hkv*D, H]`` matmul and gate/up one
``[2*I, H]`` matmul (``load_weights`` still takes the HF names and copies
each into its rows); layers are plain parameter holders and the whole
stack runs in one loop in :meth:`LlamaForCausalLM.forward`, with no
``nn.Module.__call__`` per layer; the residual adds ride on the output
matmuls (``addmm`` with ``beta=1``); RoPE's cos/sin tables are computed
once per forward pass and shared by every layer; every weight matrix is
stored column-major (``[out, in]`` as the transpose of a contiguous
``[in, out]``), the layout CPU BLAS multiplies fastest (:func:`_empty_matrix`). On the 2-core CPU box
a SmolLM2-135M decode step in float32 is within a few milliseconds of
the bare cost of its 121 matmuls (about 540 MB of weights read per step).

Formulas, each as transformers implements it:

- RMSNorm: ``w * (x / sqrt(mean(x^2) + eps))`` computed in float32, cast
  back before the weight multiply (``LlamaRMSNorm``).
- RoPE: ``inv_freq = 1 / theta^(2i/D)`` for ``i < D/2``; a position ``p``
  rotates the pair ``(x[i], x[i + D/2])`` by ``p * inv_freq[i]``
  (``rotate_half`` layout, not interleaved). Scalings: ``linear`` divides
  ``inv_freq`` by ``factor``; ``llama3`` (Llama 3.1) divides low frequencies
  by ``factor`` and blends the band between ``low_freq_factor`` and
  ``high_freq_factor`` (``_compute_llama3_parameters``). Other types raise
  ``NotImplementedError`` naming the type.
- Sliding window (Mistral; Qwen2 per ``layer_types``): query at position
  ``p`` sees keys at ``p - W < k <= p``.

In a bfloat16 (or float16) model the **residual stream stays float32**:
each block's normed input is cast to the model dtype for its matmuls and
its output is added into the float32 stream (the float32 model instead
fuses that add into the matmul). transformers keeps the stream in the
model dtype; on SmolLM2 that rounds away enough of thirty layers' small
updates to flip near-tied greedy choices (its bfloat16 logits are 0.20 off
float32 on average on a chat prompt, a bfloat16 stream here 0.23, the
float32 stream 0.13; tests/replicas/test_loader.py), for an elementwise
cost that does not show in a decode step.

Optionally (:meth:`LlamaForCausalLM.load_q4`, ``quantization="gguf_int4"``)
the linear layers are also held as a GGUF's own 4-bit codes and steps of at
most ``int4_max_tokens`` query tokens run them through the weight-only int4
kernel (``ferrox.replicas.quant`` says when and why); bigger steps run the
dense weights, which stay loaded.

Deliberately not here: sampling, the KV page bookkeeping, tensor
parallelism, quantized formats other than GGUF Q4_0/Q4_1, and rope types whose frequencies depend on the sequence length (dynamic,
yarn, longrope).
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ferrox.replicas.attention import AttentionMetadata, get_backend
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.quant import INT4_MAX_TOKENS, Int4Linear

__all__ = ["LlamaForCausalLM", "rope_parameters", "rope_inv_freq"]

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """The config's RoPE parameters as one dict with ``rope_type`` and ``rope_theta``.

    Reads transformers >= 5 ``config.rope_parameters`` or the older
    ``config.rope_theta`` plus ``config.rope_scaling`` (whose type key is
    ``rope_type`` or, older still, ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, scaled per the config's rope type.

    Raises ``NotImplementedError`` naming any rope type other than
    default/linear/llama3, or a partial rotary factor other than 1.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} is not supported by ferrox's Llama model "
            f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise NotImplementedError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    base = float(params["rope_theta"])
    # Same expression and dtype path as transformers, so fp32 cos/sin match bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _layer_windows(config, num_layers: int) -> list[int | None]:
    """Per-layer sliding window: ``config.sliding_window`` on the layers ``layer_types`` marks sliding (all, without ``layer_types``)."""
    window = getattr(config, "sliding_window", None)
    # Qwen2 configs carry a sliding_window value even when use_sliding_window is off.
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    if window is None:
        return [None] * num_layers
    window = int(window)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return [window] * num_layers
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


def _empty(shape, dtype, device) -> nn.Parameter:
    """An uninitialised parameter; a 2-D one is stored column-major (see :func:`_empty_matrix`)."""
    if len(shape) == 2:
        return _empty_matrix(shape, dtype, device)
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _empty_matrix(shape, dtype, device) -> nn.Parameter:
    """A ``[out, in]`` weight whose storage is ``[in, out]`` row-major: the transpose of a contiguous matrix.

    ``F.linear(x, w)`` computes ``x @ w.T``; with this layout ``w.T`` is a
    plain contiguous ``[in, out]`` operand, and CPU BLAS runs that product
    15-25% faster than the transposed-operand form (measured on the 2-core
    box for SmolLM2's shapes, batch 1 and 64). Shapes, names and values are
    unchanged; only the strides differ, so ``load_weights`` and indexing by
    rows work as before. The embedding lookup reads strided rows, a few
    microseconds per token, against milliseconds saved on the tied head.
    """
    rows, cols = shape
    return nn.Parameter(torch.empty((cols, rows), dtype=dtype, device=device).t(), requires_grad=False)


class _LlamaLayer(nn.Module):
    """The parameters of one decoder block, fused where the matmuls allow."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate: int,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
        dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__()
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        self.input_norm = _empty((hidden,), dtype, device)
        self.qkv_weight = _empty((qkv_rows, hidden), dtype, device)
        self.qkv_bias = _empty((qkv_rows,), dtype, device) if qkv_bias else None
        self.o_weight = _empty((hidden, num_heads * head_dim), dtype, device)
        self.o_bias = _empty((hidden,), dtype, device) if o_bias else None
        self.post_norm = _empty((hidden,), dtype, device)
        self.gate_up_weight = _empty((2 * intermediate, hidden), dtype, device)
        self.gate_up_bias = _empty((2 * intermediate,), dtype, device) if mlp_bias else None
        self.down_weight = _empty((hidden, intermediate), dtype, device)
        self.down_bias = _empty((hidden,), dtype, device) if mlp_bias else None


class LlamaForCausalLM(nn.Module):
    """Paged causal LM for the Llama family.

    ``config``: a transformers ``LlamaConfig``, ``Qwen2Config`` or
    ``MistralConfig`` (or any config with the same fields). ``dtype`` and
    ``device``: where the (uninitialised) parameters live; fill them with
    :meth:`load_weights`. ``attention_backend``: a name for
    :func:`ferrox.replicas.attention.get_backend`.

    Attributes the engine reads: ``num_layers``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``sliding_window`` (the window when every
    layer slides with the same window, else ``None``: a model with any
    full-attention layer needs the full KV pool) and ``layer_windows`` (per
    layer).

    Raises ``ValueError`` for a hidden activation other than SiLU, head
    counts that do not divide, or the flash backend with a dtype other than
    float16/bfloat16; ``NotImplementedError`` for unsupported rope types;
    ``RuntimeError`` (from :func:`get_backend`) when ``flash`` is unusable.
    """

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: str = "sdpa",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama family model (only silu)")
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.intermediate_size = int(config.intermediate_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        model_type = getattr(config, "model_type", "llama")
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or model_type == "qwen2"
        o_bias = attention_bias
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        self.layer_windows = _layer_windows(config, self.num_layers)
        distinct = set(self.layer_windows)
        self.sliding_window = self.layer_windows[0] if len(distinct) == 1 else None

        if attention_backend == "auto" and dtype not in (torch.float16, torch.bfloat16):
            attention_backend = "sdpa"  # flash kernels have no float32 path
        self.backend = get_backend(attention_backend, device)
        if self.backend.name == "flash" and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flash attention backend runs float16/bfloat16 only, not {dtype}")
        self.register_buffer("inv_freq", rope_inv_freq(config, self.head_dim).to(device), persistent=False)

        self.embed_tokens = _empty((self.vocab_size, self.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            _LlamaLayer(
                self.hidden_size,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.intermediate_size,
                qkv_bias,
                o_bias,
                mlp_bias,
                dtype,
                device,
            )
            for _ in range(self.num_layers)
        )
        self.norm = _empty((self.hidden_size,), dtype, device)
        self.lm_head = None if self.tie_word_embeddings else _empty((self.vocab_size, self.hidden_size), dtype, device)
        # Per layer (qkv, o, gate_up, down) as int4, once load_q4 ran.
        self.int4: list[tuple[Int4Linear, Int4Linear, Int4Linear, Int4Linear]] | None = None
        self.int4_max_tokens = INT4_MAX_TOKENS

    # ------------------------------------------------------------------ forward

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers computes it: in float32, cast to the model
        dtype, then times the gain. ``x`` is the residual stream (float32 for
        every model dtype); the result is in the model dtype."""
        if self.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(self.dtype)

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for int64 ``positions [T]``: ``cos`` and signed ``sin``, each ``[T, 1, head_dim]`` in the model dtype.

        With ``roll(x) = cat(x2, x1)`` (the halves swapped), transformers'
        ``x * cos + rotate_half(x) * sin`` is ``x * cos + roll(x) * sin_signed``
        where ``sin_signed = cat(-sin, sin)``.
        """
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)[:, None, :]
        return cos, sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden_size]`` (after the last RMSNorm) for a varlen batch.

        ``input_ids`` and ``positions``: int64 ``[T]``, the query tokens of
        every sequence concatenated in ``meta``'s order, each with its
        absolute position. Writes each layer's K/V for these tokens into
        ``kv_cache`` at ``meta.slot_mapping``.
        """
        num_tokens = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half = d // 2
        q_width = hq * d
        k_end = (hq + hkv) * d
        inter = self.intermediate_size
        cos, sin = self.rope_cos_sin(positions)
        backend = self.backend
        scale = self.scale
        kv_k, kv_v = kv_cache.k, kv_cache.v
        windows = self.layer_windows
        norm = self._norm

        int4 = self.int4 if self.int4 is not None and num_tokens <= self.int4_max_tokens else None
        # The residual stream stays float32 whatever the model dtype (a
        # bfloat16 stream loses the small updates of 30 layers; see the module
        # docstring). In float32 the residual adds ride on the matmuls (addmm
        # with beta=1) where there is no bias; otherwise each block's output
        # is added into the float32 stream.
        fused = self.dtype == torch.float32
        x = F.embedding(input_ids, self.embed_tokens).float()
        for i, layer in enumerate(self.layers):
            if int4 is None:
                qkv = F.linear(norm(x, layer.input_norm), layer.qkv_weight, layer.qkv_bias)
            else:
                qkv_q4, o_q4, gate_up_q4, down_q4 = int4[i]
                qkv = qkv_q4(norm(x, layer.input_norm))
                if layer.qkv_bias is not None:
                    qkv = qkv + layer.qkv_bias
            qk = qkv[:, :k_end].view(num_tokens, hq + hkv, d)
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
            v = qkv[:, k_end:].view(num_tokens, hkv, d)
            attn = backend.forward(qk[:, :hq], qk[:, hq:], v, kv_k[i], kv_v[i], meta, scale, windows[i])
            attn = attn.reshape(num_tokens, q_width)
            if int4 is not None:
                x = x + o_q4(attn) if layer.o_bias is None else x + o_q4(attn) + layer.o_bias
            elif layer.o_bias is None and fused:
                x = torch.addmm(x, attn, layer.o_weight.t())
            else:
                x = x + F.linear(attn, layer.o_weight, layer.o_bias)
            if int4 is None:
                gate_up = F.linear(norm(x, layer.post_norm), layer.gate_up_weight, layer.gate_up_bias)
            else:
                gate_up = gate_up_q4(norm(x, layer.post_norm))
                if layer.gate_up_bias is not None:
                    gate_up = gate_up + layer.gate_up_bias
            act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
            if int4 is not None:
                x = x + down_q4(act) if layer.down_bias is None else x + down_q4(act) + layer.down_bias
            elif layer.down_bias is None and fused:
                x = torch.addmm(x, act, layer.down_weight.t())
            else:
                x = x + F.linear(act, layer.down_weight, layer.down_bias)
        return norm(x, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab_size]`` for hidden states ``[N, hidden_size]`` (rows of :meth:`forward`'s output)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    # ------------------------------------------------------------------ weights

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF name -> (parameter, first row, row count) it fills."""
        hq, hkv, d, inter = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        targets: dict[str, tuple[torch.Tensor, int, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, self.vocab_size),
            "model.norm.weight": (self.norm, 0, self.hidden_size),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = (self.lm_head, 0, self.vocab_size)
        qkv_rows = {"q_proj": (0, hq * d), "k_proj": (hq * d, hkv * d), "v_proj": ((hq + hkv) * d, hkv * d)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = (layer.input_norm, 0, self.hidden_size)
            targets[p + "post_attention_layernorm.weight"] = (layer.post_norm, 0, self.hidden_size)
            for name, (start, rows) in qkv_rows.items():
                targets[p + f"self_attn.{name}.weight"] = (layer.qkv_weight, start, rows)
                if layer.qkv_bias is not None:
                    targets[p + f"self_attn.{name}.bias"] = (layer.qkv_bias, start, rows)
            targets[p + "self_attn.o_proj.weight"] = (layer.o_weight, 0, self.hidden_size)
            if layer.o_bias is not None:
                targets[p + "self_attn.o_proj.bias"] = (layer.o_bias, 0, self.hidden_size)
            targets[p + "mlp.gate_proj.weight"] = (layer.gate_up_weight, 0, inter)
            targets[p + "mlp.up_proj.weight"] = (layer.gate_up_weight, inter, inter)
            targets[p + "mlp.down_proj.weight"] = (layer.down_weight, 0, self.hidden_size)
            if layer.gate_up_bias is not None:
                targets[p + "mlp.gate_proj.bias"] = (layer.gate_up_bias, 0, inter)
                targets[p + "mlp.up_proj.bias"] = (layer.gate_up_bias, inter, inter)
                targets[p + "mlp.down_proj.bias"] = (layer.down_bias, 0, self.hidden_size)
        return targets

    _Q4_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                  ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))

    def q4_supported(self, q4: dict) -> bool:
        """Whether ``q4`` (Hugging Face weight name -> ``Q4Weight``, from
        :func:`ferrox.replicas.loader.load_q4_weights`) covers every linear weight of every layer."""
        return all(
            f"model.layers.{i}.{name}.weight" in q4 for i in range(self.num_layers) for group in self._Q4_GROUPS for name in group
        )

    def load_q4(self, q4: dict) -> None:
        """Keep every layer's linear weights also as int4 (fused as the dense ones: qkv, o, gate_up, down).

        ``q4``: as for :meth:`q4_supported`; its shapes must match the
        config. Raises ``ValueError`` naming a missing weight or a shape
        mismatch. Afterwards steps of at most ``int4_max_tokens`` query
        tokens use them.
        """
        dense = {"self_attn.q_proj": (self.num_heads * self.head_dim, self.hidden_size),
                 "self_attn.k_proj": (self.num_kv_heads * self.head_dim, self.hidden_size),
                 "self_attn.v_proj": (self.num_kv_heads * self.head_dim, self.hidden_size),
                 "self_attn.o_proj": (self.hidden_size, self.num_heads * self.head_dim),
                 "mlp.gate_proj": (self.intermediate_size, self.hidden_size),
                 "mlp.up_proj": (self.intermediate_size, self.hidden_size),
                 "mlp.down_proj": (self.hidden_size, self.intermediate_size)}
        layers = []
        for i in range(self.num_layers):
            fused = []
            for group in self._Q4_GROUPS:
                parts = []
                for name in group:
                    key = f"model.layers.{i}.{name}.weight"
                    if key not in q4:
                        raise ValueError(f"no Q4 codes for {key}")
                    if tuple(q4[key].codes.shape) != dense[name]:
                        raise ValueError(f"{key}: Q4 codes of shape {tuple(q4[key].codes.shape)}, expected {dense[name]}")
                    parts.append(q4[key])
                fused.append(Int4Linear.from_q4(parts, self.dtype))
            layers.append(tuple(fused))
        self.int4 = layers

    # Names a checkpoint may carry that hold nothing this model needs:
    # rotary buffers some exporters save, and the head of a tied model.
    _IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (cast to its dtype and device).

        Every parameter must be named exactly once. Raises ``ValueError``
        listing unexpected names, missing names, or a shape that does not
        match the config. ``lm_head.weight`` is accepted and ignored when the
        embeddings are tied, as transformers does.
        """
        targets = self._weight_targets()
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if self._IGNORED.search(name) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            param, start, rows = target
            expected = (rows, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")
            param.data[start : start + rows].copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if unexpected or missing:
            parts = []
            if unexpected:
                parts.append(f"unexpected weights: {', '.join(sorted(unexpected)[:20])}")
            if missing:
                parts.append(f"missing weights: {', '.join(missing[:20])}")
            total = f" ({len(unexpected)} unexpected, {len(missing)} missing)"
            raise ValueError("; ".join(parts) + total)
