"""Qwen3 with interleaved sliding-window and full-attention layers, on two KV pools.

Decided here: the Qwen3 block (RMSNorm, grouped-query attention with a
per-head RMSNorm on q and k before RoPE, SiLU-gated MLP) where each layer's
``layer_types`` entry picks its pool: ``"full_attention"`` layers read and
write the full KV pool (every position of the sequence), ``"sliding_attention"``
layers the window pool, which holds only the pages the window still needs
(``ferrox.replicas.state_cache``). Its logits equal transformers'
``Qwen3ForCausalLM`` on the same weights (tests/replicas/test_window_parity.py
holds them to 1e-4 in fp32, prompts shorter and longer than the window,
chunks straddling the window edge, and 40 decodes past it).

Formulas, as transformers implements them: ``q = q_norm(q_proj(x))`` and
``k = k_norm(k_proj(x))`` per head (RMSNorm over ``head_dim``), then RoPE
(``rotate_half`` layout); a window layer's query at position ``p`` sees keys
``p - W < k <= p`` (``sliding_window_overlay``). A config whose
``sliding_window`` is ``None`` (``use_sliding_window=False``) has no window
layers whatever ``layer_types`` says, as in transformers.

Deliberately not here: Qwen3-MoE, rope types other than those
:func:`ferrox.replicas.models.llama.rope_inv_freq` supports, and quantized
weights.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from ferrox.replicas.attention import AttentionMetadata, get_backend
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.state_cache import ModelCaches, PoolSpec, StepState

from ._hf_params import HFParams, rms_norm
from .llama import rope_inv_freq

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(HFParams):
    """Paged Qwen3 (dense) with per-layer pools.

    Attributes the runner reads: ``num_layers``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``sliding_window`` (the window layers'
    window, ``None`` without any), ``layer_windows`` and :meth:`pool_spec`.
    """

    def __init__(self, config, dtype: torch.dtype, device, attention_backend: str = "sdpa") -> None:
        super().__init__(dtype, torch.device(device))
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the Qwen3 model (only silu)")
        h = self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // self.num_heads)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.intermediate_size = inter = int(config.intermediate_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.layer_windows: list[int | None] = [
            int(window) if (window is not None and t == "sliding_attention") else None for t in types[: self.num_layers]
        ]
        windows = {w for w in self.layer_windows if w is not None}
        self.sliding_window = windows.pop() if windows else None
        # Index of each layer inside its own pool.
        self._pool_index: list[int] = []
        counts = [0, 0]
        for w in self.layer_windows:
            kind = 0 if w is None else 1
            self._pool_index.append(counts[kind])
            counts[kind] += 1
        self.num_full_layers, self.num_window_layers = counts

        if attention_backend == "auto" and dtype not in (torch.float16, torch.bfloat16):
            attention_backend = "sdpa"
        self.backend = get_backend(attention_backend, self.device)
        self.register_buffer("inv_freq", rope_inv_freq(config, self.head_dim).to(self.device), persistent=False)

        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.embed = self.p("model.embed_tokens.weight", (self.vocab_size, h))
        self.norm_w = self.p("model.norm.weight", (h,))
        self.lm_head = None if self.tie_word_embeddings else self.p("lm_head.weight", (self.vocab_size, h))
        self.layers: list[dict] = []
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            layer = {
                "in_norm": self.p(pre + "input_layernorm.weight", (h,)),
                "post_norm": self.p(pre + "post_attention_layernorm.weight", (h,)),
                "q": self.p(pre + "self_attn.q_proj.weight", (hq * d, h)),
                "k": self.p(pre + "self_attn.k_proj.weight", (hkv * d, h)),
                "v": self.p(pre + "self_attn.v_proj.weight", (hkv * d, h)),
                "o": self.p(pre + "self_attn.o_proj.weight", (h, hq * d)),
                "q_norm": self.p(pre + "self_attn.q_norm.weight", (d,)),
                "k_norm": self.p(pre + "self_attn.k_norm.weight", (d,)),
                "gate": self.p(pre + "mlp.gate_proj.weight", (inter, h)),
                "up": self.p(pre + "mlp.up_proj.weight", (inter, h)),
                "down": self.p(pre + "mlp.down_proj.weight", (h, inter)),
            }
            for name in ("q", "k", "v", "o"):
                layer[name + "_b"] = (
                    self.p(pre + f"self_attn.{name}_proj.bias", (h if name == "o" else layer[name].shape[0],))
                    if bias
                    else None
                )
            self.layers.append(layer)

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(
            full_layers=self.num_full_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            window_layers=self.num_window_layers,
            sliding_window=self.sliding_window,
        )

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, x.roll(half, -1), sin)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: ModelCaches | KVCache,
        meta: AttentionMetadata,
        state: StepState | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for a varlen batch.

        ``meta`` addresses the full pool (absolute positions); window
        layers use ``state.window_meta`` over the window pool. A bare
        :class:`KVCache` is accepted for a model with no window layers.
        """
        if isinstance(caches, KVCache):
            caches = ModelCaches(full=caches)
        if self.num_window_layers and (state is None or state.window_meta is None or caches.window is None):
            raise ValueError("a model with window layers needs the window pool and StepState.window_meta")
        t = input_ids.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        freqs = positions.float()[:, None] * self.inv_freq
        cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(self.dtype)[:, None, :]
        sin_ = freqs.sin()
        sin = torch.cat((-sin_, sin_), -1).to(self.dtype)[:, None, :]
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            hn = rms_norm(x, layer["in_norm"], self.eps)
            q = F.linear(hn, layer["q"], layer["q_b"]).view(t, hq, d)
            k = F.linear(hn, layer["k"], layer["k_b"]).view(t, hkv, d)
            v = F.linear(hn, layer["v"], layer["v_b"]).view(t, hkv, d)
            q = self._rope(rms_norm(q, layer["q_norm"], self.eps), cos, sin)
            k = self._rope(rms_norm(k, layer["k_norm"], self.eps), cos, sin)
            window = self.layer_windows[i]
            j = self._pool_index[i]
            if window is None:
                pool, m = caches.full, meta
            else:
                pool, m = caches.window, state.window_meta  # type: ignore[union-attr]
            attn = self.backend.forward(q, k, v, pool.k[j], pool.v[j], m, self.scale, window)
            x = x + F.linear(attn.reshape(t, hq * d), layer["o"], layer["o_b"])
            hn = rms_norm(x, layer["post_norm"], self.eps)
            x = x + F.linear(F.silu(F.linear(hn, layer["gate"])) * F.linear(hn, layer["up"]), layer["down"])
        return rms_norm(x, self.norm_w, self.eps)
