"""The model runner: one scheduled step in, sampled tokens out.

Decided here:

- How a :class:`~ferrox.scheduler.core.ScheduledStep` becomes tensors: the
  query tokens of every sequence concatenated (varlen, each sequence its own
  query length), their positions, and attention metadata with each
  sequence's page table and slot mapping.
- Logits are computed only for the positions that sample (the last token of
  a prompt's final chunk, every decode), never for a whole prompt.
- Pool sizing: on CUDA the KV pool is what ``gpu_memory_utilization`` of the
  device leaves after the weights and a measured activation peak (a dummy
  forward of ``max_prefill_tokens`` tokens); on CPU it is
  ``kv_cache_bytes``. The page count is that budget over
  :meth:`KVCache.bytes_per_page`, never a guess. A model that declares a
  window or recurrent pool (``pool_spec()``: the Qwen3 window family, the
  Bamba hybrid) gets that budget split by ``state_cache.split_budget`` and
  runs with ``ModelCaches`` plus a per-step ``StepState`` (window page
  tables from ``swa_start``, live recurrent slots); the Llama family's path
  is unchanged.
- Threads: on CPU the runner sets torch's intra-op thread count to the
  configured ``torch_threads`` so several replicas on one machine do not
  oversubscribe its cores.

Deliberately not here: which requests run (the scheduler), sampling
parameters' semantics (``sampler.py``) and text (``detokenizer.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ferrox.scheduler.core import ScheduledStep

from .attention import build_metadata
from .config import EngineConfig
from .kv_cache import KVCache
from .loader import ModelFiles, load_q4_weights, load_weights_iter
from .models import get_model_class
from .quant import resolve_quantization
from .sampler import Sampler, SamplingState
from .state_cache import allocate_caches, build_step_state, pool_spec, scratch_pools, split_budget

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bfloat16 (Sapphire Rapids and later), as torch sees it."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe() and torch.cpu._is_avx512_bf16_supported())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weight and activation dtype for the setting ``name`` on ``device``.

    ``"auto"``: bfloat16 on CUDA; on CPU bfloat16 when the CPU has AMX-BF16
    (:func:`cpu_has_amx_bf16`), float32 otherwise -- the choice vLLM's CPU
    backend makes. Without AMX, bfloat16 matmuls are slower than float32
    ones; with it, a 64-sequence SmolLM2 decode step runs 1.8x faster in
    bfloat16 (measured on the 2-core box: 457 against 253 tok/s).
    Raises ``KeyError`` for a name other than auto/float32/bfloat16/float16.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_amx_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class StepOutput:
    """Sampled token per sampling sequence (uid -> token id) and timings (s)."""

    sampled: dict[int, int]
    forward_s: float


class ModelRunner:
    """Owns the model weights, the KV pool tensors and the sampler of one replica."""

    def __init__(self, config: EngineConfig, files: ModelFiles) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu" and config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        hf_config = files.config
        cls = get_model_class(hf_config)
        backend = config.attention_backend
        if backend == "auto":
            backend = "auto" if self.device.type == "cuda" else "sdpa"
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = cls(hf_config, dtype=self.dtype, device=self.device, attention_backend=backend)
        self.model.load_weights(load_weights_iter(files))
        self.model.eval()
        # Weight-only int4 over the GGUF's own Q4 codes (quant.py): only where it can run.
        q4 = {}
        if config.quantization != "none" and hasattr(self.model, "load_q4"):
            q4 = load_q4_weights(files)
        supports = bool(q4) and self.model.q4_supported(q4)
        self.quantization = resolve_quantization(config.quantization, self.device, self.dtype, supports)
        if self.quantization == "gguf_int4":
            self.model.load_q4(q4)
        del q4
        self.load_s = time.perf_counter() - t0
        self.page_size = config.page_size
        self.vocab_size = int(self.model.vocab_size)
        self.sampler = Sampler(self.vocab_size, self.device)
        if config.seed is not None:
            self.sampler.generator.manual_seed(config.seed)
        # Window / recurrent pools (state_cache.py): only for models that
        # declare them; the Llama family keeps the single full pool below.
        self.spec = pool_spec(self.model)
        self.hybrid = self.spec.hybrid
        self.sliding_window = self.spec.sliding_window if self.spec.window_layers else None
        self.recurrent = self.spec.recurrent is not None
        self.num_swa_pages = 0
        self.num_recurrent_slots = 0
        self.num_pages = self._size_pool()
        if self.hybrid:
            self.caches = allocate_caches(
                self.spec, self.num_pages, self.num_swa_pages, self.num_recurrent_slots,
                self.page_size, self.dtype, self.device,
            )
            self.kv = self.caches.full
        else:
            self.kv = KVCache.allocate(
                self.model.num_layers,
                self.num_pages,
                self.page_size,
                self.model.num_kv_heads,
                self.model.head_dim,
                self.dtype,
                self.device,
            )
        log.info(
            "runner ready: %s on %s/%s (quantization %s), %d pages of %d tokens (%d KV tokens), weights loaded in %.2fs",
            files.name, self.device, self.dtype, self.quantization, self.num_pages, self.page_size,
            self.num_pages * self.page_size, self.load_s,
        )

    # -------------------------------------------------------------- sizing
    def bytes_per_page(self) -> int:
        return KVCache.bytes_per_page(
            max(self.spec.full_layers, 1), self.page_size, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )

    def _size_pool(self) -> int:
        per_page = self.bytes_per_page()
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = self.config.kv_cache_bytes
        if self.hybrid:
            pages, self.num_swa_pages, self.num_recurrent_slots = split_budget(
                int(budget), self.spec, self.page_size, self.dtype, self.config.max_num_seqs,
                self.config.max_prefill_tokens, getattr(self.config, "num_recurrent_slots", None),
            )
            return pages
        pages = int(budget // per_page)
        if pages < 1:
            raise RuntimeError(
                f"the KV budget of {budget} bytes holds no page of {per_page} bytes; "
                "raise kv_cache_bytes or gpu_memory_utilization"
            )
        return pages

    @torch.inference_mode()
    def _cuda_kv_budget(self) -> int:
        """vLLM's rule: utilization * total - (weights + activation peak + others' use)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        # Measure the activation peak with one dummy forward over a one-page cache.
        n = self.config.max_prefill_tokens
        meta = build_metadata([n], [n], [list(range(-(-n // self.page_size)))], self.page_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        if self.hybrid:
            scratch, extra = scratch_pools(self.spec, n, self.page_size, self.dtype, self.device)
            hidden = self.model(ids, meta.positions(), scratch, meta, extra)
        else:
            scratch = KVCache.allocate(
                self.model.num_layers, -(-n // self.page_size), self.page_size,
                self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device,
            )
            hidden = self.model(ids, meta.positions(), scratch, meta)
        self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free_after - torch.cuda.memory_allocated(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - max(used_by_others, 0)
        log.info("CUDA memory: total %.1f GiB, activation+weights peak %.2f GiB, KV budget %.2f GiB",
                 total / 2**30, peak / 2**30, budget / 2**30)
        return budget

    # ------------------------------------------------------------- running
    @torch.inference_mode()
    def execute(self, step: ScheduledStep, states: dict[int, SamplingState]) -> StepOutput:
        """Run one step's forward pass and sample every sequence that samples.

        ``states`` holds the sampling state of each uid in the step that
        samples. Returns uid -> sampled token id.
        """
        t0 = time.perf_counter()
        seqs = step.seqs
        tokens: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_uids: list[int] = []
        offset = 0
        for s in seqs:
            tokens.extend(s.query_tokens)
            q = len(s.query_tokens)
            query_lens.append(q)
            seq_lens.append(s.seq_len)
            tables.append(list(s.pages))
            offset += q
            if s.samples and s.uid in states:
                sample_rows.append(offset - 1)
                sample_uids.append(s.uid)
        meta = build_metadata(query_lens, seq_lens, tables, self.page_size, self.device)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.hybrid:
            state = build_step_state(seqs, self.spec, self.page_size, self.device)
            rec = self.caches.recurrent
            if state.restores:
                for src, dst in state.restores:
                    rec.copy_slot(src, dst)  # type: ignore[union-attr]
            hidden = self.model(input_ids, meta.positions(), self.caches, meta, state)
            if state.end_snapshots:
                for src, dst in state.end_snapshots:
                    rec.copy_slot(src, dst)  # type: ignore[union-attr]
        else:
            hidden = self.model(input_ids, meta.positions(), self.kv, meta)
        sampled: dict[int, int] = {}
        if sample_rows:
            if len(sample_rows) == hidden.shape[0]:
                picked = hidden
            else:
                picked = hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(picked)
            next_ids = self.sampler(logits, [states[u] for u in sample_uids]).tolist()
            sampled = dict(zip(sample_uids, next_ids))
        return StepOutput(sampled, time.perf_counter() - t0)
