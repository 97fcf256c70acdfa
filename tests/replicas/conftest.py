"""Fixtures shared by the replica tests: the embedded SmolLM2, tiny random configs, a paged driver.

- ``smollm2_files``: ``resolve_model(DEFAULT_MODEL)`` with the default cache
  (``$FERROX_CACHE_DIR`` or ``~/.cache/ferrox/models``), once per session;
  the first run of a fresh machine converts the GGUF (some seconds).
- ``tiny_config``: a factory of small transformers configs of each Llama
  family member, fp32-friendly, for parity against transformers.
- ``hf_and_ferrox``: a factory building the transformers model with a fixed
  seed, giving every weight a scale that makes logits O(1) (transformers'
  0.02 init would make any two models agree to 1e-4), and loading the same
  state dict into ferrox's model.
- ``PagedDriver``: runs a ferrox model over sequences that own scattered,
  non-contiguous pages, the way the engine will.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from ferrox.replicas.attention import build_metadata
from ferrox.replicas.kv_cache import KVCache
from ferrox.replicas.loader import DEFAULT_MODEL, resolve_model
from ferrox.replicas.models.llama import LlamaForCausalLM

# The 2-core test box is shared; keep torch modest.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_files():
    return resolve_model(DEFAULT_MODEL, progress=False)


_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)


def make_tiny_config(kind: str) -> transformers.PretrainedConfig:
    """A tiny config: ``llama`` (GQA 4:2), ``llama-tied``, ``llama3-rope``, ``linear-rope``,
    ``qwen2`` (qkv bias), ``qwen2-mixed-window`` (window on layer 1 only), ``mistral-window`` (window 5)."""
    if kind == "llama":
        return transformers.LlamaConfig(**_BASE, rope_theta=10000.0)
    if kind == "llama-tied":
        return transformers.LlamaConfig(**_BASE, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "llama3-rope":
        return transformers.LlamaConfig(
            **_BASE,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    if kind == "linear-rope":
        return transformers.LlamaConfig(
            **_BASE, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**_BASE, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "qwen2-mixed-window":
        return transformers.Qwen2Config(
            **_BASE,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        )
    if kind == "mistral-window":
        return transformers.MistralConfig(**_BASE, rope_theta=10000.0, sliding_window=5, head_dim=16)
    raise ValueError(kind)


@pytest.fixture
def tiny_config():
    return make_tiny_config


_HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def build_hf_and_ferrox(config, seed: int = 0, page_size: int = 4):
    """(transformers model, ferrox model) with identical random weights, fp32, eval mode."""
    torch.manual_seed(seed)
    hf = _HF_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:  # RMSNorm gains: random so a swapped norm cannot pass
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    ours = LlamaForCausalLM(config, torch.float32, "cpu")
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.fixture
def hf_and_ferrox():
    return build_hf_and_ferrox


class PagedDriver:
    """Feeds token chunks of several sequences through a ferrox model over a paged cache.

    Pages are handed out from a shuffled free list, so every sequence's
    pages are scattered and out of order.
    """

    def __init__(self, model: LlamaForCausalLM, num_pages: int = 48, page_size: int = 4, seed: int = 1):
        self.model = model
        self.page_size = page_size
        self.cache = KVCache.allocate(
            model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
        )
        free = list(range(num_pages))
        random.Random(seed).shuffle(free)
        self.free = free
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one forward pass over ``{seq_id: new token ids}``; return each sequence's logits ``[len(chunk), V]``."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in chunks.items():
            done = self.lengths.get(seq, 0)
            total = done + len(tokens)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * self.page_size < total:
                pages.append(self.free.pop())
            query_lens.append(len(tokens))
            seq_lens.append(total)
            tables.append(list(pages))
            ids.extend(tokens)
            positions.extend(range(done, total))
            self.lengths[seq] = total
        meta = build_metadata(query_lens, seq_lens, tables, self.page_size, "cpu")
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), self.cache, meta
        )
        logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq, q in zip(chunks, query_lens):
            out[seq] = logits[start : start + q]
            start += q
        return out


@pytest.fixture
def paged_driver():
    return PagedDriver
