"""Tiny window and Mamba2-hybrid configs, and a driver that runs them over the real page bookkeeping.

- :func:`window_config` / :func:`bamba_config`: tiny random-weight configs of
  the two families (fp32-friendly, parity against transformers).
- :func:`build_pair`: the transformers model and ferrox's, same weights,
  every weight scaled so logits are O(1) (see conftest's ``hf_and_ferrox``).
- :class:`PoolDriver`: feeds chunks of several sequences through a ferrox
  model with pages and slots handed out by the scheduler's real
  :class:`~ferrox.scheduler.kv.KVManager` -- window pages freed as the
  window slides, three recurrent slots per sequence -- so the parity tests
  exercise exactly the tables the engine will pass.
- :func:`save_tiny_model`: writes a random-weight model as a Hugging Face
  directory (safetensors + the embedded SmolLM2 tokenizer) for engine tests.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from ferrox.replicas.attention import build_metadata
from ferrox.replicas.models import get_model_class
from ferrox.replicas.state_cache import allocate_caches, build_step_state
from ferrox.scheduler.kv import KVManager


def window_config(window: int = 8, vocab: int = 96, layers: int = 4, max_pos: int = 2048) -> transformers.Qwen3Config:
    """Qwen3 with layers sliding, full, sliding, full (window ``window``)."""
    return transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def bamba_config(vocab: int = 96, chunk: int = 16, max_pos: int = 2048) -> transformers.BambaConfig:
    """Bamba with layers mamba, attention, mamba; 8 Mamba heads of 16 in 2 groups, state 16."""
    return transformers.BambaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head="auto",
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=chunk,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def build_pair(config, seed: int = 0):
    """(transformers model, ferrox model), identical random weights, fp32, eval mode."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 3 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5 - 1.0)
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 3:  # depthwise conv [C, 1, K]
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:  # norm gains: random so a swapped norm cannot pass
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    ours = get_model_class(config)(config, torch.float32, "cpu")
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


class PoolDriver:
    """Runs chunks of several sequences over pools whose pages and slots the real KVManager hands out.

    ``window_pages_held[seq]`` records, after every step, how many window
    pages that sequence held while the step ran.
    """

    def __init__(self, model, page_size: int = 4, num_pages: int = 256, num_swa_pages: int = 64, num_slots: int = 12):
        self.model = model
        self.spec = model.pool_spec()
        self.page_size = page_size
        window = self.spec.sliding_window if self.spec.window_layers else None
        self.kv = KVManager(
            page_size,
            num_pages,
            num_swa_pages=num_swa_pages if window else 0,
            sliding_window=window,
            num_recurrent_slots=num_slots if self.spec.recurrent else 0,
            enable_prefix_caching=False,
        )
        self.caches = allocate_caches(
            self.spec, num_pages, max(num_swa_pages, 1), max(num_slots, 1), page_size, torch.float32, "cpu"
        )
        self.uids: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.window_pages_held: dict[str, list[int]] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One forward pass over ``{seq: new tokens}``; each sequence's logits ``[len(chunk), V]``."""
        seqs, ids = [], []
        for name, tokens in chunks.items():
            if name not in self.uids:
                self.uids[name] = len(self.uids) + 1
                self.kv.admit(self.uids[name], tokens)
            uid = self.uids[name]
            done = self.lengths.get(name, 0)
            self.kv.allocate(uid, done + len(tokens))
            mem = self.kv.request(uid)
            seqs.append(
                SimpleNamespace(
                    query_tokens=tuple(tokens),
                    computed_len=done,
                    seq_len=done + len(tokens),
                    pages=list(mem.pages),
                    swa_pages=list(mem.swa_pages),
                    swa_start=mem.swa_start,
                    recurrent_slots=list(mem.recurrent_slots),
                )
            )
            self.window_pages_held.setdefault(name, []).append(len(mem.swa_pages))
            ids.extend(tokens)
        meta = build_metadata(
            [len(s.query_tokens) for s in seqs], [s.seq_len for s in seqs], [s.pages for s in seqs], self.page_size, "cpu"
        )
        state = build_step_state(seqs, self.spec, self.page_size, "cpu")
        hidden = self.model(torch.tensor(ids), meta.positions(), self.caches, meta, state)
        logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for name, s in zip(chunks, seqs):
            q = len(s.query_tokens)
            out[name] = logits[start : start + q]
            start += q
            self.lengths[name] = s.seq_len
            self.kv.slide(self.uids[name], s.seq_len)
        return out

    def release(self, name: str) -> None:
        self.kv.release(self.uids.pop(name), None)
        self.lengths.pop(name)


def save_tiny_model(config, directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write ``config``'s random-weight model (weights as :func:`build_pair`) and the tokenizer
    found in ``tokenizer_dir`` to ``directory``; returns it."""
    hf, _ = build_pair(config, seed)
    hf.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, Path(directory) / name)
    return Path(directory)
