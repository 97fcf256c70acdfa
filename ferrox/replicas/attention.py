"""Paged attention over varlen batches: the metadata and the backends.

Decided here:

- What one forward pass tells the attention layers (:class:`AttentionMetadata`):
  each sequence's query length this step and its context length after it, its
  page table, and the flat cache slot of every new token. Sequences are
  *varlen*: a prefill chunk of 300 tokens and a dozen one-token decodes share
  one batch, their query tokens concatenated in batch order.
- The attention semantics every backend implements: the new tokens' K and V
  are written into the paged cache first, then query ``i`` of a sequence, at
  absolute position ``p``, attends to that sequence's keys at positions
  ``<= p``, and, when a sliding window ``W`` is set, ``> p - W``. That is
  exactly transformers' causal mask and its ``sliding_window_overlay``
  (``kv_idx > q_idx - sliding_window``) used by Mistral and Qwen2.
- Two backends behind :class:`AttentionBackend`:

  * ``sdpa``, the reference, on CPU and CUDA: K/V are gathered page by page
    out of the cache and fed to ``torch.nn.functional.scaled_dot_product_attention``.
    All one-token decodes of a batch go through ONE call, over K/V padded to
    ``[B, Hkv, max_len, D]`` with a length mask; grouped-query attention is
    done without copying K/V, by folding the ``G = Hq / Hkv`` query heads that
    share a KV head into the query-length axis (``[B, Hkv, G, D]``: a
    one-token decode's G queries all sit at the same position, so one mask
    row serves them). The decode group's K/V are gathered into two buffers
    the backend keeps across layers and steps, and its bool mask becomes an
    additive bias once per step; a lone decode whose pages are consecutive
    page ids reads its keys as a slice of the cache, with no gather at all.
    Prefill sequences are attended one by one; a fresh prefill attends over
    its own new K/V without reading the cache back.
  * ``flash``: vllm-flash-attn's ``flash_attn_varlen_func`` reading the cache
    through a block table, CUDA only, from the optional ``flash`` extra.

- Everything a backend derives from the metadata (gather indices, masks) is
  computed once per forward pass from the *host* copies of the lengths and
  cached on the metadata object, so the per-layer work is a handful of
  kernel launches and never waits on the device.

Deliberately not here: deciding which tokens run this step (the scheduler),
allocating pages (the pools), RoPE and projections (the model), and any
per-layer choice of window (the model passes ``sliding_window`` per call).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "AttentionBackend",
    "SdpaBackend",
    "FlashBackend",
    "build_metadata",
    "get_backend",
    "BACKEND_NAMES",
]

BACKEND_NAMES = ("sdpa", "flash", "auto")


@dataclass
class AttentionMetadata:
    """Per-forward-pass attention inputs for a varlen batch of ``B`` sequences and ``T`` tokens.

    Device tensors:

    - ``query_start_loc``: int32 ``[B+1]``, cumulative query lengths; the query
      tokens of sequence ``b`` are rows ``query_start_loc[b]:query_start_loc[b+1]``.
    - ``seq_lens``: int32 ``[B]``, context length of each sequence AFTER this
      step (tokens already in the cache plus this step's query tokens).
    - ``page_table``: int32 ``[B, max_pages_per_seq]``, the page ids of each
      sequence in position order; unused entries are 0.
    - ``slot_mapping``: int64 ``[T]``, the flat cache slot of each new token,
      ``page_id * page_size + position % page_size``.

    Host copies (so no backend ever syncs the device): ``query_lens``,
    ``seq_lens_host``, ``max_query_len``, ``max_seq_len``.

    ``sliding_window``: a default window for callers that want one; the
    model passes its per-layer window to the backend explicitly.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    sliding_window: int | None = None
    # Derived gather plans, keyed by (backend, window, page_size); filled
    # lazily by the backends and shared by all layers of one forward pass.
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def positions(self) -> torch.Tensor:
        """int64 ``[T]`` absolute position of every query token, on the metadata's device."""
        plan = self._plans.get("positions")
        if plan is None:
            plan = _to_device(_positions_host(self.query_lens, self.seq_lens_host), self.device)
            self._plans["positions"] = plan
        return plan


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without stalling the host on queued GPU work (pinned, non-blocking)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _positions_host(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    if all(q == 1 for q in query_lens):
        return torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64)
    parts = [torch.arange(s - q, s, dtype=torch.int64) for q, s in zip(query_lens, seq_lens)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` for one varlen step.

    ``query_lens[b]``: tokens of sequence ``b`` computed this step (>= 1).
    ``seq_lens[b]``: its context length after this step (>= ``query_lens[b]``).
    ``page_tables[b]``: its page ids in position order; must cover
    ``ceil(seq_lens[b] / page_size)`` pages (more entries are allowed: pages
    reserved for later tokens). The new tokens sit at positions
    ``seq_lens[b] - query_lens[b] .. seq_lens[b] - 1``; each one's slot is
    ``page_tables[b][pos // page_size] * page_size + pos % page_size``.

    Raises ``ValueError`` on mismatched list lengths, a query length below 1
    or above the sequence length, or a page table too short for its sequence.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if not (len(query_lens) == len(seq_lens) == len(page_tables)):
        raise ValueError(
            "query_lens, seq_lens and page_tables must have one entry per sequence, got "
            f"{len(query_lens)}, {len(seq_lens)} and {len(page_tables)}"
        )
    query_lens = [int(q) for q in query_lens]
    seq_lens = [int(s) for s in seq_lens]
    slots: list[int] = []
    slot_parts: list[torch.Tensor] = []
    for b, (q, s, pages) in enumerate(zip(query_lens, seq_lens, page_tables)):
        if q < 1 or q > s:
            raise ValueError(f"sequence {b}: query length {q} must be in [1, seq_len={s}]")
        need = -(-s // page_size)
        if len(pages) < need:
            raise ValueError(
                f"sequence {b}: {s} tokens need {need} pages of {page_size}, "
                f"but its page table has {len(pages)}"
            )
        if q == 1:
            pos = s - 1
            slots.append(int(pages[pos // page_size]) * page_size + pos % page_size)
        else:
            if slots:
                slot_parts.append(torch.tensor(slots, dtype=torch.int64))
                slots = []
            pos = torch.arange(s - q, s, dtype=torch.int64)
            table = torch.tensor(pages[: need], dtype=torch.int64)
            slot_parts.append(table[pos // page_size] * page_size + pos % page_size)
    if slots:
        slot_parts.append(torch.tensor(slots, dtype=torch.int64))
    slot_mapping = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.int64)

    max_pages = max((len(p) for p in page_tables), default=0)
    max_pages = max(max_pages, 1)
    table_rows = [list(map(int, p)) + [0] * (max_pages - len(p)) for p in page_tables]
    page_table = torch.tensor(table_rows, dtype=torch.int32).reshape(len(page_tables), max_pages)

    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    device = torch.device(device)
    meta = AttentionMetadata(
        query_start_loc=_to_device(torch.tensor(starts, dtype=torch.int32), device),
        seq_lens=_to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        page_table=_to_device(page_table, device),
        slot_mapping=_to_device(slot_mapping, device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    meta._plans["host_page_table"] = page_table
    meta._plans["host_page_rows"] = table_rows
    return meta


class AttentionBackend(Protocol):
    """One attention implementation over the paged cache.

    ``forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_k_layer
    [num_pages, page_size, Hkv, D], kv_v_layer, meta, scale, sliding_window)
    -> [T, Hq, D]``: writes ``k``/``v`` into the layer's cache at
    ``meta.slot_mapping``, then attends causally (see the module docstring
    for the exact visibility rule). ``Hq`` must be a multiple of ``Hkv``;
    query head ``h`` reads KV head ``h // (Hq // Hkv)`` (transformers'
    ``repeat_kv`` order).
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_k_layer: torch.Tensor,
        kv_v_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...


def _write_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k_layer: torch.Tensor,
    kv_v_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = kv_k_layer.shape[-2], kv_k_layer.shape[-1]
    kv_k_layer.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_v_layer.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


# --------------------------------------------------------------------------- sdpa


@dataclass
class _DecodePlan:
    """All one-token decodes of a batch, attended in one call."""

    count: int
    token_index: torch.Tensor | None  # rows of q holding these decodes; None when they are all of q
    pages: torch.Tensor  # int64 [count * pages_per_row], flattened [count, pages_per_row]
    pages_per_row: int
    key_offset: int  # single decode: first key row inside the gathered pages
    key_len: int  # single decode: number of keys
    mask: torch.Tensor | None  # bool [count, 1, 1, pages_per_row * page_size]; None for a single decode
    # Single decode whose pages are consecutive ids: its first flat cache slot,
    # so its keys are a view of the cache and nothing is gathered.
    slot_start: int | None = None
    # The mask as an additive float bias (0 / -inf), per dtype: sdpa would
    # otherwise convert the bool mask in every layer.
    biases: dict = field(default_factory=dict)


@dataclass
class _PrefillPlan:
    """One sequence with more than one query token."""

    start: int  # its rows in q: start .. end-1
    end: int
    fresh: bool  # nothing cached before this step: attend over the new k/v directly
    pages: torch.Tensor | None  # int64 page ids covering the keys (None when fresh)
    key_offset: int  # first key row inside the gathered pages
    key_len: int
    mask: torch.Tensor | None  # bool [query_len, key_len]; None means plain causal (is_causal)


@dataclass
class _SdpaPlan:
    all_decode: bool
    decode: _DecodePlan | None
    prefills: list[_PrefillPlan]


def _first_key_position(computed: int, window: int | None) -> int:
    """The earliest position any query of this step can see: query at ``computed`` sees ``> computed - window``."""
    if window is None:
        return 0
    return max(0, computed - window + 1)


def _build_sdpa_plan(meta: AttentionMetadata, window: int | None, page_size: int) -> _SdpaPlan:
    device = meta.device
    query_lens, seq_lens = meta.query_lens, meta.seq_lens_host
    # build_metadata leaves a host copy of the page table; metadata built by
    # hand pays one device read here, once per forward pass.
    host_table = meta._plans.get("host_page_table")
    if host_table is None:
        host_table = meta.page_table.cpu()
        meta._plans["host_page_table"] = host_table

    decode_rows: list[int] = []
    decode_tokens: list[int] = []
    prefills: list[_PrefillPlan] = []
    start = 0
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q == 1:
            decode_rows.append(b)
            decode_tokens.append(start)
        else:
            computed = s - q
            w = window if (window is not None and window < s) else None
            fresh = computed == 0
            if fresh:
                mask = None
                if w is not None:
                    qpos = torch.arange(q)
                    kpos = torch.arange(s)
                    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
                    mask = _to_device(mask, device)
                prefills.append(_PrefillPlan(start, start + q, True, None, 0, s, mask))
            else:
                first = _first_key_position(computed, w)
                first_page = first // page_size
                last_page = (s - 1) // page_size
                pages = _to_device(host_table[b, first_page : last_page + 1].to(torch.int64), device)
                key_offset = first - first_page * page_size
                key_len = s - first
                kpos = torch.arange(first, s)
                qpos = torch.arange(computed, s)
                allowed = kpos[None, :] <= qpos[:, None]
                if w is not None:
                    allowed &= kpos[None, :] > qpos[:, None] - w
                prefills.append(
                    _PrefillPlan(start, start + q, False, pages, key_offset, key_len, _to_device(allowed, device))
                )
        start += q

    decode = None
    if decode_rows:
        n = len(decode_rows)
        firsts = []
        first_pages = []
        counts = []
        for b in decode_rows:
            s = seq_lens[b]
            w = window if (window is not None and window < s) else None
            first = _first_key_position(s - 1, w)
            fp = first // page_size
            firsts.append(first)
            first_pages.append(fp)
            counts.append((s - 1) // page_size - fp + 1)
        per_row = max(counts)
        table_rows = meta._plans.get("host_page_rows")
        if table_rows is None:
            table_rows = host_table.tolist()
        rows = torch.tensor(
            [
                # Pad with the row's own last page: masked, but never another sequence's data.
                table_rows[b][fp : fp + c] + [table_rows[b][fp + c - 1]] * (per_row - c)
                for b, fp, c in zip(decode_rows, first_pages, counts)
            ],
            dtype=torch.int64,
        )
        slot_start = None
        if n == 1:
            s = seq_lens[decode_rows[0]]
            mask = None
            key_offset = firsts[0] - first_pages[0] * page_size
            key_len = s - firsts[0]
            row = table_rows[decode_rows[0]][first_pages[0] : first_pages[0] + counts[0]]
            if all(b - a == 1 for a, b in zip(row, row[1:])):
                slot_start = int(row[0]) * page_size + key_offset
        else:
            key_offset, key_len = 0, per_row * page_size
            kpos = torch.tensor(first_pages, dtype=torch.int64)[:, None] * page_size + torch.arange(
                per_row * page_size
            )
            lens = torch.tensor([seq_lens[b] for b in decode_rows], dtype=torch.int64)[:, None]
            starts = torch.tensor(firsts, dtype=torch.int64)[:, None]
            mask = _to_device(((kpos < lens) & (kpos >= starts)).view(n, 1, 1, -1), device)
        all_decode = n == len(query_lens)
        decode = _DecodePlan(
            count=n,
            token_index=None if all_decode else _to_device(torch.tensor(decode_tokens, dtype=torch.int64), device),
            pages=_to_device(rows.view(-1), device),
            pages_per_row=per_row,
            key_offset=key_offset,
            key_len=key_len,
            mask=mask,
            slot_start=slot_start,
        )
    return _SdpaPlan(all_decode=decode is not None and decode.count == len(query_lens), decode=decode, prefills=prefills)


class SdpaBackend:
    """The reference backend: ``scaled_dot_product_attention`` over K/V gathered from pages.

    Works on any device torch runs on. Cost per layer: two ``index_copy_``
    writes, one page gather per K and V for the whole decode group, one
    SDPA call for the decode group and one per prefill sequence.
    """

    name = "sdpa"

    def __init__(self) -> None:
        # Reusable K and V gather buffers for decode batches (see _gather).
        self._buffers: list[torch.Tensor | None] = [None, None]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_k_layer: torch.Tensor,
        kv_v_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        _write_cache(k, v, kv_k_layer, kv_v_layer, meta.slot_mapping)
        page_size = kv_k_layer.shape[1]
        key = ("sdpa", sliding_window, page_size)
        plan = meta._plans.get(key)
        if plan is None:
            plan = _build_sdpa_plan(meta, sliding_window, page_size)
            meta._plans[key] = plan

        if plan.all_decode:
            return self._decode(q, kv_k_layer, kv_v_layer, plan.decode, scale)

        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            out[d.token_index] = self._decode(q[d.token_index], kv_k_layer, kv_v_layer, d, scale)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(q, k, v, kv_k_layer, kv_v_layer, p, scale)
        return out

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor, which: int) -> torch.Tensor:
        """``cache[pages]`` written into a buffer kept across layers and steps (no fresh
        multi-megabyte allocation, and its page faults, per layer)."""
        shape = (pages.shape[0], *cache.shape[1:])
        buf = self._buffers[which]
        if buf is None or buf.dtype != cache.dtype or buf.device != cache.device or buf.numel() < math.prod(shape):
            buf = torch.empty(math.prod(shape), dtype=cache.dtype, device=cache.device)
            self._buffers[which] = buf
        out = buf[: math.prod(shape)].view(shape)
        torch.index_select(cache, 0, pages, out=out)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_k_layer: torch.Tensor,
        kv_v_layer: torch.Tensor,
        d: _DecodePlan,
        scale: float,
    ) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = kv_k_layer.shape
        groups = num_heads // num_kv_heads
        # [n, Hkv, G, D]: the G query heads of one KV head share one position,
        # so they ride the query-length axis and K/V are never repeated.
        query = q.reshape(n, num_kv_heads, groups, head_dim)
        if d.slot_start is not None:
            # One sequence on consecutive pages: its keys are a slice of the cache.
            end = d.slot_start + d.key_len
            keys = kv_k_layer.view(-1, num_kv_heads, head_dim)[d.slot_start : end].unsqueeze(0)
            values = kv_v_layer.view(-1, num_kv_heads, head_dim)[d.slot_start : end].unsqueeze(0)
            out = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
            return out.reshape(n, num_heads, head_dim)
        rows = d.pages_per_row * page_size
        keys = self._gather(kv_k_layer, d.pages, 0).view(n, rows, num_kv_heads, head_dim)
        values = self._gather(kv_v_layer, d.pages, 1).view(n, rows, num_kv_heads, head_dim)
        mask = d.mask
        if mask is None:
            keys = keys[:, d.key_offset : d.key_offset + d.key_len]
            values = values[:, d.key_offset : d.key_offset + d.key_len]
        else:
            bias = d.biases.get(q.dtype)
            if bias is None:
                bias = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
                d.biases[q.dtype] = bias
            mask = bias
        out = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
        )
        return out.reshape(n, num_heads, head_dim)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_k_layer: torch.Tensor,
        kv_v_layer: torch.Tensor,
        p: _PrefillPlan,
        scale: float,
    ) -> torch.Tensor:
        num_heads = q.shape[1]
        num_kv_heads, head_dim = kv_k_layer.shape[-2], kv_k_layer.shape[-1]
        if p.fresh:
            keys, values = k[p.start : p.end], v[p.start : p.end]
        else:
            keys = kv_k_layer.index_select(0, p.pages).view(-1, num_kv_heads, head_dim)
            values = kv_v_layer.index_select(0, p.pages).view(-1, num_kv_heads, head_dim)
            keys = keys[p.key_offset : p.key_offset + p.key_len]
            values = values[p.key_offset : p.key_offset + p.key_len]
        query = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        if p.mask is None:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        else:
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=p.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        return out[0].transpose(0, 1)


# --------------------------------------------------------------------------- flash

_FLASH_HINT = (
    "the 'flash' attention backend needs a CUDA device and vllm-flash-attn: "
    "install the `flash` extra (pip install 'ferrox[flash]'; it pins torch 2.4.0), "
    "or use attention_backend='sdpa'"
)


class FlashBackend:
    """vllm-flash-attn's varlen kernel reading the paged cache through a block table.

    CUDA only, fp16/bf16 only, and the kernel requires ``page_size`` to be a
    multiple of 16. Causal masking is bottom-right aligned, which is exactly
    "query i of a sequence sits at position seq_len - query_len + i"; the
    window maps to ``window_size=(W - 1, 0)`` (keys ``>= p - W + 1``).
    """

    name = "flash"

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"{_FLASH_HINT} (device is {device})")
        try:
            from vllm_flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
        except Exception as exc:  # ImportError, or a CUDA/torch ABI mismatch raised at import
            raise RuntimeError(f"{_FLASH_HINT} (import failed: {exc})") from exc
        self._fn = flash_attn_varlen_func
        # vllm-flash-attn 2.6 takes cu_seqlens_k with a block table; later
        # releases require seqused_k instead. Support both.
        self._uses_seqused_k = "seqused_k" in inspect.signature(flash_attn_varlen_func).parameters

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_k_layer: torch.Tensor,
        kv_v_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        _write_cache(k, v, kv_k_layer, kv_v_layer, meta.slot_mapping)
        page_size = kv_k_layer.shape[1]
        if page_size % 16:
            raise ValueError(f"the flash backend needs page_size to be a multiple of 16, got {page_size}")
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        kwargs = dict(
            q=q,
            k=kv_k_layer,
            v=kv_v_layer,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=meta.page_table,
        )
        if self._uses_seqused_k:
            kwargs["seqused_k"] = meta.seq_lens
        else:
            cu_k = meta._plans.get("flash_cu_seqlens_k")
            if cu_k is None:
                starts = [0]
                for s in meta.seq_lens_host:
                    starts.append(starts[-1] + s)
                cu_k = _to_device(torch.tensor(starts, dtype=torch.int32), meta.device)
                meta._plans["flash_cu_seqlens_k"] = cu_k
            kwargs["cu_seqlens_k"] = cu_k
        return self._fn(**kwargs)


# --------------------------------------------------------------------------- selection


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Return the attention backend called ``name`` for ``device``.

    ``"sdpa"``: :class:`SdpaBackend`, any device. ``"flash"``:
    :class:`FlashBackend`; raises ``RuntimeError`` naming the ``flash``
    extra when vllm-flash-attn is not importable or ``device`` is not CUDA.
    ``"auto"``: flash if usable, else sdpa. Any other name: ``ValueError``.
    """
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash":
        return FlashBackend(device)
    if name == "auto":
        try:
            return FlashBackend(device)
        except RuntimeError:
            return SdpaBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
