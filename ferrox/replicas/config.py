"""Engine configuration of one replica.

Decided here: the settings a replica's engine reads, with the same names and
defaults as ``ferrox.cluster.config.EngineArgs`` (which the cluster turns
into this), so ``ferrox generate`` and a Serve replica behave alike.
Deliberately a plain dataclass: replicas must not import the cluster layer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineConfig:
    """See ``ferrox.cluster.config.EngineArgs`` for each field's meaning and range."""

    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    #: ``"auto"`` | ``"none"`` | ``"gguf_int4"``: weight-only int4 matmuls on a GGUF's
    #: Q4 codes for small steps (``ferrox.replicas.quant``).
    quantization: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    torch_threads: int | None = None
    max_waiting_requests: int = 1024
    seed: int = 0
    cache_dir: str | None = None
    #: Recurrent-state slots for a Mamba-hybrid model (three per request);
    #: ``None`` sizes the pool from the byte budget (``state_cache.split_budget``).
    num_recurrent_slots: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown engine settings: {sorted(unknown)}")
        return cls(**data)
