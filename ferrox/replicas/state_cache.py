"""The window KV pool, the recurrent-state pool, and how one byte budget is split among the pools.

Decided here:

- **What a model needs** (:class:`PoolSpec`): how many layers read the full
  KV pool, how many read the window pool (and their window), and the shape
  of one recurrent slot (Mamba2 conv + SSM state per recurrent layer). A
  model without ``pool_spec()`` (the Llama family) is all full pool: it runs
  exactly as before, its sliding windows, if any, masked inside the full pool.
- **The window pool** is a second :class:`~ferrox.replicas.kv_cache.KVCache`
  with one layer per window layer. A sequence's window pages cover
  positions ``[swa_start, seq_len)`` (``swa_start`` page-aligned, kept by
  the scheduler); :func:`build_step_state` gives the window layers their own
  :class:`AttentionMetadata` over those pages, with lengths counted from
  ``swa_start``. Attention only depends on *relative* positions (RoPE is
  applied with the absolute positions before the cache), so the shifted
  metadata attends exactly as the unshifted one would, and the backends
  need no change.
- **The recurrent pool** (:class:`RecurrentState`): per recurrent layer, a
  conv state ``[slots, conv_dim, conv_width - 1]`` (the last inputs the
  causal conv still needs) and an SSM state ``[slots, heads, head_dim,
  state_size]`` kept in float32 (the recurrence accumulates over the whole
  sequence; transformers' chunk scan also runs it in float32). A request
  holds three slots (the scheduler's ``RECURRENT_SLOTS_PER_REQUEST``): the
  first is its live state, the other two hold its prefix snapshots (which
  boundaries: ``ferrox.scheduler.kv``); :class:`StepState` says which copies
  a step makes.
- **The split** (:func:`split_budget`): the full pool is what is left after
  the other two. The window pool gets enough pages for every request slot
  to hold its largest window reservation (``ceil_page(window) + 2 pages +
  ceil_page(max_prefill_tokens)``, the planner's bound), but at most
  :data:`MAX_SIDE_POOL_FRACTION` of the budget; the recurrent pool gets three
  slots per request slot, again at most that fraction (or exactly
  ``num_recurrent_slots`` when configured). So a window or hybrid model
  never starves its full-attention layers, and a small budget still seats
  one request in each pool if it can seat one at all.

Deliberately not here: which pages or slots belong to whom (the scheduler's
``KVManager``), and the attention math (``attention.py``) or the scan (the
model files).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrox.scheduler.admission import RECURRENT_SLOTS_PER_REQUEST

from .attention import AttentionMetadata, _to_device, build_metadata
from .kv_cache import KVCache

__all__ = [
    "PoolSpec",
    "RecurrentSpec",
    "RecurrentState",
    "ModelCaches",
    "StepState",
    "pool_spec",
    "split_budget",
    "allocate_caches",
    "build_step_state",
    "scratch_pools",
    "MAX_SIDE_POOL_FRACTION",
]

#: The most of the byte budget the window pool, or the recurrent pool, may take.
MAX_SIDE_POOL_FRACTION = 0.5



@dataclass(frozen=True)
class RecurrentSpec:
    """One recurrent slot's shape: per recurrent layer a conv state ``[conv_dim, conv_width - 1]``
    (model dtype) and an SSM state ``[num_heads, head_dim, state_size]`` (float32)."""

    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    head_dim: int
    state_size: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """``num_layers * (conv_dim * (conv_width - 1) * itemsize + heads * head_dim * state * 4)``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        conv = self.conv_dim * (self.conv_width - 1) * itemsize
        ssm = self.num_heads * self.head_dim * self.state_size * 4
        return self.num_layers * (conv + ssm)


@dataclass(frozen=True)
class PoolSpec:
    """The pools a model reads. ``full_layers`` / ``window_layers``: layers in each KV pool;
    ``sliding_window``: the window layers' window (``None`` without window layers)."""

    full_layers: int
    num_kv_heads: int
    head_dim: int
    window_layers: int = 0
    sliding_window: int | None = None
    recurrent: RecurrentSpec | None = None

    @property
    def hybrid(self) -> bool:
        """Whether the model runs with :class:`ModelCaches` and :class:`StepState`."""
        return self.window_layers > 0 or self.recurrent is not None


def pool_spec(model) -> PoolSpec:
    """The model's own ``pool_spec()``, or all-full-pool for models without one (Llama family)."""
    fn = getattr(model, "pool_spec", None)
    if fn is not None:
        return fn()
    return PoolSpec(model.num_layers, model.num_kv_heads, model.head_dim)


@dataclass
class RecurrentState:
    """``conv``: ``[layers, slots, conv_dim, conv_width - 1]`` in the model dtype;
    ``ssm``: ``[layers, slots, heads, head_dim, state_size]`` float32. Zeroed."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def allocate(cls, spec: RecurrentSpec, num_slots: int, dtype: torch.dtype, device) -> "RecurrentState":
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        conv = torch.zeros((spec.num_layers, num_slots, spec.conv_dim, spec.conv_width - 1), dtype=dtype, device=device)
        ssm = torch.zeros(
            (spec.num_layers, num_slots, spec.num_heads, spec.head_dim, spec.state_size), dtype=torch.float32, device=device
        )
        return cls(conv, ssm)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot ``src`` into slot ``dst`` (a snapshot or a restore)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])


@dataclass
class ModelCaches:
    """Every pool a window or hybrid model reads: ``full`` (its full-attention layers),
    ``window`` (its window layers) and ``recurrent``; absent pools are ``None``."""

    full: KVCache | None
    window: KVCache | None = None
    recurrent: RecurrentState | None = None


@dataclass
class StepState:
    """What the window and recurrent layers need of one step, beside the main metadata.

    ``window_meta``: metadata over each sequence's window pages, lengths
    counted from its ``swa_start`` (``None`` without window layers).
    ``live_slots``: int64 ``[B]`` each sequence's live recurrent slot (device),
    ``live_slots_host`` the same as a list; ``fresh[b]``: its state starts
    from zero this step (the first chunk of a prompt with nothing cached).
    Prefix snapshots (the scheduler's ``restore_slot`` / ``snapshots``):
    ``restores`` are ``(cached slot, live slot)`` copies made before the
    forward pass, ``end_snapshots`` ``(live slot, slot)`` copies made after
    it, and ``mid_snapshots[b] = (offset, slot)`` asks the mixer to store
    sequence ``b``'s state after its first ``offset`` query tokens, inside
    the chunk.
    """

    window_meta: AttentionMetadata | None = None
    live_slots: torch.Tensor | None = None
    live_slots_host: list[int] | None = None
    fresh: list[bool] | None = None
    restores: list[tuple[int, int]] | None = None
    end_snapshots: list[tuple[int, int]] | None = None
    mid_snapshots: dict[int, tuple[int, int]] | None = None


def split_budget(
    budget: int,
    spec: PoolSpec,
    page_size: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_prefill_tokens: int,
    num_recurrent_slots: int | None = None,
) -> tuple[int, int, int]:
    """``(full pages, window pages, recurrent slots)`` for ``budget`` bytes (see the module docstring).

    Raises ``RuntimeError`` when the budget holds no full page, or no window
    page / three recurrent slots for a model that needs them.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_kv_token_layer = 2 * spec.num_kv_heads * spec.head_dim * itemsize
    full_page = max(spec.full_layers, 1) * page_size * per_kv_token_layer
    side = int(budget * MAX_SIDE_POOL_FRACTION)
    swa_pages = 0
    if spec.window_layers:
        window_page = spec.window_layers * page_size * per_kv_token_layer
        ceil_page = lambda n: -(-n // page_size)  # noqa: E731
        per_request = ceil_page(spec.sliding_window or 0) + 2 + ceil_page(max_prefill_tokens)
        swa_pages = min(max_num_seqs * per_request, side // window_page)
        if swa_pages < 1:
            raise RuntimeError(f"the budget of {budget} bytes holds no window page of {window_page} bytes")
        budget -= swa_pages * window_page
    slots = 0
    if spec.recurrent is not None:
        per_slot = spec.recurrent.bytes_per_slot(dtype)
        if num_recurrent_slots is not None:
            slots = int(num_recurrent_slots)
        else:
            slots = min(RECURRENT_SLOTS_PER_REQUEST * max_num_seqs, side // per_slot)
        if slots < RECURRENT_SLOTS_PER_REQUEST:
            raise RuntimeError(
                f"the recurrent pool holds {slots} slots of {per_slot} bytes; a request needs "
                f"{RECURRENT_SLOTS_PER_REQUEST}"
            )
        budget -= slots * per_slot
    pages = int(budget // full_page)
    if pages < 1:
        raise RuntimeError(
            f"the KV budget holds no page of {full_page} bytes; raise kv_cache_bytes or gpu_memory_utilization"
        )
    return pages, swa_pages, slots


def allocate_caches(
    spec: PoolSpec,
    num_pages: int,
    num_swa_pages: int,
    num_recurrent_slots: int,
    page_size: int,
    dtype: torch.dtype,
    device,
) -> ModelCaches:
    """Zeroed pools for ``spec`` (a pool the model does not read is ``None``)."""
    full = (
        KVCache.allocate(spec.full_layers, num_pages, page_size, spec.num_kv_heads, spec.head_dim, dtype, device)
        if spec.full_layers
        else None
    )
    window = (
        KVCache.allocate(spec.window_layers, num_swa_pages, page_size, spec.num_kv_heads, spec.head_dim, dtype, device)
        if spec.window_layers
        else None
    )
    recurrent = (
        RecurrentState.allocate(spec.recurrent, num_recurrent_slots, dtype, device) if spec.recurrent else None
    )
    return ModelCaches(full, window, recurrent)


def build_step_state(seqs, spec: PoolSpec, page_size: int, device) -> StepState:
    """The :class:`StepState` of scheduled sequences (``ScheduledSeq``-like: ``query_tokens``,
    ``seq_len``, ``computed_len``, ``swa_pages``, ``swa_start``, ``recurrent_slots``)."""
    state = StepState()
    if spec.window_layers:
        state.window_meta = build_metadata(
            [len(s.query_tokens) for s in seqs],
            [s.seq_len - s.swa_start for s in seqs],
            [list(s.swa_pages) for s in seqs],
            page_size,
            device,
        )
    if spec.recurrent is not None:
        live = [int(s.recurrent_slots[0]) for s in seqs]
        state.live_slots_host = live
        state.live_slots = _to_device(torch.tensor(live, dtype=torch.int64), torch.device(device))
        state.fresh = [s.computed_len == 0 for s in seqs]
        restores: list[tuple[int, int]] = []
        ends: list[tuple[int, int]] = []
        mids: dict[int, tuple[int, int]] = {}
        for b, s in enumerate(seqs):
            if getattr(s, "restore_slot", -1) >= 0:
                restores.append((int(s.restore_slot), live[b]))
            for offset, slot in getattr(s, "snapshots", ()):
                if offset == len(s.query_tokens):
                    ends.append((live[b], int(slot)))
                elif 0 < offset < len(s.query_tokens) and b not in mids:
                    mids[b] = (int(offset), int(slot))
                else:
                    raise ValueError(f"snapshot offset {offset} outside the sequence's {len(s.query_tokens)} query tokens")
        state.restores, state.end_snapshots, state.mid_snapshots = restores, ends, mids
    return state


def scratch_pools(spec: PoolSpec, num_tokens: int, page_size: int, dtype: torch.dtype, device) -> tuple[ModelCaches, StepState]:
    """Pools and a :class:`StepState` for one fresh ``num_tokens``-token prefill on pages
    ``0..``, for measuring a forward pass's activation peak (the runner's CUDA sizing)."""
    pages = -(-num_tokens // page_size)
    caches = allocate_caches(spec, pages, pages, RECURRENT_SLOTS_PER_REQUEST, page_size, dtype, device)

    class _Seq:
        query_tokens = range(num_tokens)
        computed_len = 0
        seq_len = num_tokens
        swa_start = 0
        swa_pages = list(range(pages))
        recurrent_slots = [0, 1, 2]

    return caches, build_step_state([_Seq()], spec, page_size, device)
