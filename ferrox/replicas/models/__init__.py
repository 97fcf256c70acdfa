"""Which ferrox model class serves which Hugging Face architecture.

Decided here: the registry from a config's ``architectures`` entries (first
choice) or its ``model_type`` (fallback, for configs built in code without
``architectures``) to the paged implementation that runs it. Both are plain
dicts so a new family is one entry each.

Deliberately not here: loading weights or building the model (the loader and
the runner do that); any guessing beyond the two tables (an unknown
architecture is an error, not a best effort).
"""

from __future__ import annotations

from ferrox.replicas.models.bamba import BambaForCausalLM
from ferrox.replicas.models.llama import LlamaForCausalLM
from ferrox.replicas.models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "get_model_class",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "BambaForCausalLM",
]

ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    # Interleaved sliding-window / full layers on two KV pools.
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Mamba2 / attention hybrid, state in the recurrent pool.
    "BambaForCausalLM": BambaForCausalLM,
}

MODEL_TYPES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "bamba": BambaForCausalLM,
}


def get_model_class(config) -> type:
    """The model class for a transformers config.

    Looks up each of ``config.architectures`` in :data:`ARCHITECTURES`, then
    ``config.model_type`` in :data:`MODEL_TYPES`. Raises ``ValueError`` naming
    the architectures and model type when neither is supported.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model architecture {architectures or None} (model_type {model_type!r}); "
        f"supported architectures: {', '.join(ARCHITECTURES)}"
    )
