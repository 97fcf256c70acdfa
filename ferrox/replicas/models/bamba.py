"""Bamba: Mamba2 layers interleaved with attention layers, state in the recurrent pool.

Decided here: the Bamba block (pre-norm mixer -- a Mamba2 mixer or
grouped-query attention with half-width RoPE -- then pre-norm SiLU-gated
MLP) over a varlen batch, with the Mamba2 conv and SSM state of each
sequence living in its *live* recurrent slot
(``ferrox.replicas.state_cache.RecurrentState``) and the attention layers
on the full KV pool. Its logits equal transformers' ``BambaForCausalLM``
(its pure-torch path) on the same weights; tests/replicas/test_mamba_parity.py
holds them to 1e-4 in fp32, including chunked prefill that carries the
state across chunks and 40 decode steps.

The Mamba2 mixer, as transformers' ``BambaMixer.torch_forward`` computes it
(Dao & Gu 2024, "Transformers are SSMs", the SSD form):

- ``in_proj(x)`` splits into ``gate [I]``, ``xBC [I + 2 G N]`` and ``dt [H]``;
- ``xBC`` goes through a depthwise causal conv of width ``K`` (zero history
  for a fresh sequence, else the last ``K - 1`` inputs kept in the slot),
  then SiLU, and splits into ``x [H, P]``, ``B [G, N]``, ``C [G, N]``
  (each of the ``H`` heads reads group ``h // (H / G)``);
- ``dt = clamp(softplus(dt + dt_bias), time_step_limit)``,
  ``A = -exp(A_log)``; the state ``h [H, P, N]`` evolves as
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T`` and ``y_t = h_t C_t + D x_t``.
  A decode step applies that once; a prefill chunk uses the equivalent
  quadratic (chunked) form over blocks of up to :data:`SCAN_BLOCK` tokens,
  carrying ``h`` across blocks and across scheduler chunks;
- ``y * silu(gate)`` is RMS-normalised per group of ``I / G`` channels, times
  the norm weight, then ``out_proj``.

A prefix snapshot that falls inside a prefill chunk (``StepState.mid_snapshots``)
splits that sequence's scan at the snapshot's offset and stores the state
there; snapshots at a step's start or end are whole-slot copies the runner
makes (``RecurrentState.copy_slot``).

Deliberately not here: the fused CUDA kernels (``mamba_ssm``,
``causal_conv1d``): the scan is plain torch on every device.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from ferrox.replicas.attention import AttentionMetadata, get_backend
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.state_cache import ModelCaches, PoolSpec, RecurrentSpec, StepState

from ._hf_params import HFParams, rms_norm

__all__ = ["BambaForCausalLM", "SCAN_BLOCK", "ssd_scan"]

#: Tokens per block of the quadratic scan form (memory ~ block^2 * heads floats).
SCAN_BLOCK = 256


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[h, t, s] = sum_{s < r <= t} a[h, r]`` for ``s <= t``, ``-inf`` above the diagonal
    (transformers' ``segment_sum``: masked cumsum, not a difference of cumsums)."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), -1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), 0), -torch.inf)


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over one sequence of ``L`` tokens, all float32.

    ``x [L, H, P]``, ``dt [L, H]`` (already softplus'd), ``A [H]``,
    ``B, C [L, H, N]`` (groups already expanded to heads), ``h0 [H, P, N]``.
    Returns ``y [L, H, P]`` (without the ``D`` skip) and the final state.
    """
    ys = []
    h = h0
    for start in range(0, x.shape[0], SCAN_BLOCK):
        xb, dtb = x[start : start + SCAN_BLOCK], dt[start : start + SCAN_BLOCK]
        Bb, Cb = B[start : start + SCAN_BLOCK], C[start : start + SCAN_BLOCK]
        a = (dtb * A).transpose(0, 1)  # [H, l]
        acs = torch.cumsum(a, dim=-1)  # [H, l]
        decay = torch.exp(_segsum(a))  # [H, l, l]
        xdt = xb * dtb[..., None]  # [l, H, P]
        scores = torch.einsum("thn,shn->hts", Cb, Bb) * decay
        y = torch.einsum("hts,shp->thp", scores, xdt)
        y = y + torch.einsum("thn,hpn->thp", Cb, h) * torch.exp(acs).transpose(0, 1)[..., None]
        to_end = torch.exp(acs[:, -1:] - acs).transpose(0, 1)  # [l, H]
        h = h * torch.exp(acs[:, -1])[:, None, None] + torch.einsum("shn,shp->hpn", Bb * to_end[..., None], xdt)
        ys.append(y)
    return torch.cat(ys), h


class BambaForCausalLM(HFParams):
    """Paged Bamba (a Mamba2 / attention hybrid).

    Attributes the runner reads: ``num_layers``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``sliding_window`` (``None``) and
    :meth:`pool_spec`. Raises ``ValueError`` for an activation other than
    SiLU or a MoE config, ``NotImplementedError`` for a rope type other than
    default.
    """

    sliding_window = None

    def __init__(self, config, dtype: torch.dtype, device, attention_backend: str = "sdpa") -> None:
        super().__init__(dtype, torch.device(device))
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the Bamba model (only silu)")
        h = self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.eps = float(config.rms_norm_eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // self.num_heads)
        self.scale = self.head_dim**-0.5
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"rope type {rope_type!r} is not supported by the Bamba model (only default)")
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        self.rot_dim = int(self.head_dim * partial)
        inv = 1.0 / (theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float) / self.rot_dim))
        self.register_buffer("inv_freq", inv.to(self.device), persistent=False)

        # Mamba2 geometry.
        self.m_heads = int(config.mamba_n_heads)
        self.m_head_dim = int(config.mamba_d_head)
        self.m_groups = int(config.mamba_n_groups)
        self.m_state = int(config.mamba_d_state)
        self.m_conv = int(config.mamba_d_conv)
        self.m_inner = int(config.mamba_expand * h)
        self.conv_dim = self.m_inner + 2 * self.m_groups * self.m_state
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        self.dt_limit = (float(limit[0]), float(limit[1]))

        if attention_backend == "auto" and dtype not in (torch.float16, torch.bfloat16):
            attention_backend = "sdpa"
        self.backend = get_backend(attention_backend, self.device)

        types = list(config.layers_block_type)
        self.kinds = ["mamba" if t == "linear_attention" else "attention" for t in types[: self.num_layers]]
        self._pool_index: list[int] = []
        counts = {"mamba": 0, "attention": 0}
        for kind in self.kinds:
            self._pool_index.append(counts[kind])
            counts[kind] += 1
        self.num_mamba_layers, self.num_attention_layers = counts["mamba"], counts["attention"]

        attn_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        proj_bias = bool(getattr(config, "mamba_proj_bias", False))
        conv_bias = bool(getattr(config, "mamba_conv_bias", True))
        hq, hkv, d, inter = self.num_heads, self.num_kv_heads, self.head_dim, int(config.intermediate_size)
        p = self.p
        self.embed = p("model.embed_tokens.weight", (self.vocab_size, h))
        self.norm_w = p("model.final_layernorm.weight", (h,))
        self.lm_head = None if self.tie_word_embeddings else p("lm_head.weight", (self.vocab_size, h))
        self.layers: list[dict] = []
        for i, kind in enumerate(self.kinds):
            pre = f"model.layers.{i}."
            L = {
                "in_norm": p(pre + "input_layernorm.weight", (h,)),
                "ff_norm": p(pre + "pre_ff_layernorm.weight", (h,)),
                "gate": p(pre + "feed_forward.gate_proj.weight", (inter, h)),
                "up": p(pre + "feed_forward.up_proj.weight", (inter, h)),
                "down": p(pre + "feed_forward.down_proj.weight", (h, inter)),
            }
            for name, rows in (("gate", inter), ("up", inter), ("down", h)):
                L[name + "_b"] = p(pre + f"feed_forward.{name}_proj.bias", (rows,)) if mlp_bias else None
            if kind == "attention":
                a = pre + "self_attn."
                for name, shape in (("q", (hq * d, h)), ("k", (hkv * d, h)), ("v", (hkv * d, h)), ("o", (h, hq * d))):
                    L[name] = p(a + f"{name}_proj.weight", shape)
                    L[name + "_b"] = p(a + f"{name}_proj.bias", (shape[0],)) if attn_bias else None
            else:
                m = pre + "mamba."
                L["in_proj"] = p(m + "in_proj.weight", (self.m_inner + self.conv_dim + self.m_heads, h))
                L["in_proj_b"] = p(m + "in_proj.bias", (L["in_proj"].shape[0],)) if proj_bias else None
                L["conv_w"] = p(m + "conv1d.weight", (self.conv_dim, 1, self.m_conv))
                L["conv_b"] = p(m + "conv1d.bias", (self.conv_dim,)) if conv_bias else None
                L["dt_bias"] = p(m + "dt_bias", (self.m_heads,))
                L["A_log"] = p(m + "A_log", (self.m_heads,))
                L["D"] = p(m + "D", (self.m_heads,))
                L["norm"] = p(m + "norm.weight", (self.m_inner,))
                L["out_proj"] = p(m + "out_proj.weight", (h, self.m_inner))
                L["out_proj_b"] = p(m + "out_proj.bias", (h,)) if proj_bias else None
            self.layers.append(L)

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(
            full_layers=self.num_attention_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            recurrent=RecurrentSpec(
                num_layers=self.num_mamba_layers,
                conv_dim=self.conv_dim,
                conv_width=self.m_conv,
                num_heads=self.m_heads,
                head_dim=self.m_head_dim,
                state_size=self.m_state,
            ),
        )

    # ----------------------------------------------------------------- mixer
    def _mamba(self, L: dict, x: torch.Tensor, j: int, caches: ModelCaches, meta: AttentionMetadata, state: StepState):
        """One Mamba2 mixer over the batch; reads and writes each sequence's live slot of layer ``j``."""
        rec = caches.recurrent
        assert rec is not None and state.live_slots_host is not None and state.fresh is not None
        conv_pool, ssm_pool = rec.conv[j], rec.ssm[j]
        H, P, G, N, K, I = self.m_heads, self.m_head_dim, self.m_groups, self.m_state, self.m_conv, self.m_inner
        proj = F.linear(x, L["in_proj"], L["in_proj_b"])
        gate, xbc, dt = proj.split([I, self.conv_dim, H], dim=-1)
        conv_w = L["conv_w"][:, 0, :]  # [conv_dim, K]
        A = -torch.exp(L["A_log"].float())
        D = L["D"].float()
        dt = F.softplus(dt.float() + L["dt_bias"].float()).clamp(self.dt_limit[0], self.dt_limit[1])
        rep = H // G
        out = torch.empty(x.shape[0], H, P, dtype=torch.float32, device=x.device)
        q_lens = meta.query_lens
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        decodes = [b for b, q in enumerate(q_lens) if q == 1 and not state.fresh[b]]
        if decodes:
            rows = torch.tensor([starts[b] for b in decodes], device=x.device)
            slots = torch.tensor([state.live_slots_host[b] for b in decodes], device=x.device)
            window = torch.cat((conv_pool.index_select(0, slots), xbc.index_select(0, rows)[:, :, None]), dim=-1)
            conv_pool.index_copy_(0, slots, window[:, :, 1:])
            c = (window * conv_w).sum(-1)
            if L["conv_b"] is not None:
                c = c + L["conv_b"]
            c = F.silu(c)
            xs, Bs, Cs = c.float().split([I, G * N, G * N], dim=-1)
            n = len(decodes)
            xs = xs.view(n, H, P)
            Bs = Bs.view(n, G, N).repeat_interleave(rep, dim=1)
            Cs = Cs.view(n, G, N).repeat_interleave(rep, dim=1)
            dts = dt.index_select(0, rows)  # [n, H]
            h = ssm_pool.index_select(0, slots)
            h = h * torch.exp(dts * A)[:, :, None, None] + (dts[:, :, None] * xs)[..., None] * Bs[:, :, None, :]
            ssm_pool.index_copy_(0, slots, h)
            out[rows] = torch.einsum("bhpn,bhn->bhp", h, Cs) + D[:, None] * xs
        decode_set = set(decodes)
        for b, q in enumerate(q_lens):
            if b in decode_set:
                continue
            s, e = starts[b], starts[b + 1]
            slot = state.live_slots_host[b]
            if state.fresh[b]:
                prev = torch.zeros(self.conv_dim, K - 1, dtype=xbc.dtype, device=x.device)
                h0 = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
            else:
                prev, h0 = conv_pool[slot], ssm_pool[slot]
            seq_in = torch.cat((prev, xbc[s:e].transpose(0, 1)), dim=-1)  # [conv_dim, K-1+q]
            c = F.conv1d(seq_in[None], L["conv_w"], L["conv_b"], groups=self.conv_dim)[0].transpose(0, 1)
            conv_pool[slot].copy_(seq_in[:, -(K - 1) :])
            c = F.silu(c)
            xs, Bs, Cs = c.float().split([I, G * N, G * N], dim=-1)
            xs = xs.view(q, H, P)
            Bs = Bs.view(q, G, N).repeat_interleave(rep, dim=1)
            Cs = Cs.view(q, G, N).repeat_interleave(rep, dim=1)
            mid = state.mid_snapshots.get(b) if state.mid_snapshots else None
            if mid is None:
                y, h_end = ssd_scan(xs, dt[s:e], A, Bs, Cs, h0)
            else:
                # A prefix snapshot inside the chunk: the state after the
                # first k tokens (conv: the K - 1 inputs before token k).
                k, snap = mid
                conv_pool[snap].copy_(seq_in[:, k : k + K - 1])
                y1, h_k = ssd_scan(xs[:k], dt[s : s + k], A, Bs[:k], Cs[:k], h0)
                ssm_pool[snap].copy_(h_k)
                y2, h_end = ssd_scan(xs[k:], dt[s + k : e], A, Bs[k:], Cs[k:], h_k)
                y = torch.cat((y1, y2))
            ssm_pool[slot].copy_(h_end)
            out[s:e] = y + D[:, None] * xs
        y = out.view(-1, I)
        # Gated group RMSNorm, in float32 as transformers' BambaRMSNormGated.
        y = y * F.silu(gate.float())
        yg = y.view(-1, G, I // G)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        y = L["norm"] * yg.view(-1, I).to(self.dtype)
        return F.linear(y.to(self.dtype), L["out_proj"], L["out_proj_b"])

    def _attention(self, L: dict, x, j: int, caches: ModelCaches, meta, cos, sin):
        t = x.shape[0]
        hq, hkv, d, r = self.num_heads, self.num_kv_heads, self.head_dim, self.rot_dim
        q = F.linear(x, L["q"], L["q_b"]).view(t, hq, d)
        k = F.linear(x, L["k"], L["k_b"]).view(t, hkv, d)
        v = F.linear(x, L["v"], L["v_b"]).view(t, hkv, d)
        half = r // 2
        q = torch.cat((torch.addcmul(q[..., :r] * cos, q[..., :r].roll(half, -1), sin), q[..., r:]), -1)
        k = torch.cat((torch.addcmul(k[..., :r] * cos, k[..., :r].roll(half, -1), sin), k[..., r:]), -1)
        pool = caches.full
        attn = self.backend.forward(q, k, v, pool.k[j], pool.v[j], meta, self.scale, None)
        return F.linear(attn.reshape(t, hq * d), L["o"], L["o_b"])

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: ModelCaches | KVCache,
        meta: AttentionMetadata,
        state: StepState | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for a varlen batch; updates each
        sequence's live recurrent slot (``state.live_slots_host``) in place."""
        if isinstance(caches, KVCache):
            caches = ModelCaches(full=caches)
        if self.num_mamba_layers and (state is None or state.live_slots_host is None or caches.recurrent is None):
            raise ValueError("a model with Mamba2 layers needs the recurrent pool and StepState.live_slots")
        freqs = positions.float()[:, None] * self.inv_freq
        cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(self.dtype)[:, None, :]
        sin_ = freqs.sin()
        sin = torch.cat((-sin_, sin_), -1).to(self.dtype)[:, None, :]
        x = F.embedding(input_ids, self.embed)
        for i, L in enumerate(self.layers):
            hn = rms_norm(x, L["in_norm"], self.eps)
            j = self._pool_index[i]
            if self.kinds[i] == "mamba":
                x = x + self._mamba(L, hn, j, caches, meta, state)  # type: ignore[arg-type]
            else:
                x = x + self._attention(L, hn, j, caches, meta, cos, sin)
            hn = rms_norm(x, L["ff_norm"], self.eps)
            act = F.silu(F.linear(hn, L["gate"], L["gate_b"])) * F.linear(hn, L["up"], L["up_b"])
            x = x + F.linear(act, L["down"], L["down_b"])
        return rms_norm(x, self.norm_w, self.eps)
