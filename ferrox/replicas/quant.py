"""Weight-only int4 matmuls over a GGUF model's own Q4 codes, for small batches on CPU.

Decided here:

- What ``EngineConfig.quantization`` means (:func:`resolve_quantization`):
  ``"none"`` runs every matmul on the dense weights; ``"gguf_int4"`` also
  keeps each Llama-family linear layer as the GGUF file's 4-bit codes and
  runs steps of at most :data:`INT4_MAX_TOKENS` query tokens through torch's
  ``_weight_int4pack_mm_for_cpu``; ``"auto"`` is ``"gguf_int4"`` exactly when
  it can run (CPU, bfloat16 weights, the kernel present in this torch, a
  model whose every linear weight is Q4_0/Q4_1) and ``"none"`` otherwise.
  vLLM's GGUF support likewise keeps GGUF weights quantized instead of
  dequantizing them.
- Why small batches only: a decode step of one sequence is a chain of
  matrix-vector products bound by memory bandwidth, and 4-bit weights are an
  eighth of float32's bytes. Measured on the 2-core AMX box (SmolLM2-135M,
  120 linear layers, weights streamed from memory): one token 11-13 ms int4
  against 27 ms float32 and 36 ms dense bfloat16; at 16 tokens int4 is
  already slower than dense bfloat16 (45 against 37 ms) and at 64 three
  times slower (136 against 45 ms; AMX tiles make the dense bfloat16 GEMM
  cheap, the int4 kernel unpacks per row block). So a step with more query
  tokens than :data:`INT4_MAX_TOKENS` (big decode batches, any prefill
  chunk) uses the dense bfloat16 weights, kept alongside.
- Exactness: the codes are the GGUF file's, and the GGUF weight is
  ``W = scale * q + min`` per block of 32 along the input dimension
  (:class:`~ferrox.replicas.loader.Q4Weight`). The kernel computes
  ``(q - 8) * s + z`` with ``s`` and ``z`` in the activation dtype
  (checked numerically: an identity input returns exactly that, rounded to
  bfloat16), so ``s = scale`` and ``z = min + 8 * scale`` (exact in float32)
  and the only departure from the GGUF weights is rounding ``s`` and ``z``
  to bfloat16 (8 significant bits against float16's 11: a relative error
  of at most ``2**-8`` on each, so at most ``2**-8 * (8 * |s| + |z|)`` on a
  weight), on top of the bfloat16 rounding of the output that every
  bfloat16 matmul has. The dense path's bfloat16 weights are
  rounded from the exact float32 dequantization, so the two paths agree to
  bfloat16 precision, not bit for bit.

Deliberately not here: activation quantization, other GGUF types (Q8_0,
K-quants; their weights run dense), int4 on CUDA, and the tied output head
(the GGUF's embedding is Q8_0, and its matmul stays dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .loader import Q4Weight

__all__ = ["INT4_MAX_TOKENS", "QUANTIZATION_NAMES", "Int4Linear", "int4_kernel_available", "resolve_quantization"]

QUANTIZATION_NAMES = ("auto", "none", "gguf_int4")

#: Steps with at most this many query tokens use the int4 weights (see the module docstring).
INT4_MAX_TOKENS = 4

_GROUP = 32


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU weight-only int4 kernel and its packing op."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def resolve_quantization(name: str, device: torch.device, dtype: torch.dtype, model_supports: bool) -> str:
    """``"none"`` or ``"gguf_int4"`` for the setting ``name`` (see the module docstring).

    ``model_supports``: the model can take int4 weights and the files hold
    Q4 codes for every one of its linear weights. Raises ``ValueError`` for
    an unknown name, or for ``"gguf_int4"`` where it cannot run (naming why).
    """
    if name not in QUANTIZATION_NAMES:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZATION_NAMES)}")
    if name == "none":
        return "none"
    reasons = []
    if device.type != "cpu":
        reasons.append(f"device is {device.type}, the int4 kernel is CPU-only")
    if dtype != torch.bfloat16:
        reasons.append(f"dtype is {dtype}, the int4 path runs bfloat16 activations (set dtype='bfloat16')")
    if not int4_kernel_available():
        reasons.append(f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu")
    if not model_supports:
        reasons.append("the model is not a Llama-family GGUF whose linear weights are all Q4_0/Q4_1")
    if not reasons:
        return "gguf_int4"
    if name == "gguf_int4":
        raise ValueError("quantization='gguf_int4' cannot run: " + "; ".join(reasons))
    return "none"


@dataclass
class Int4Linear:
    """One linear layer as packed int4 codes: ``y [M, N] = x [M, K] @ W.T`` with ``W`` from Q4 blocks.

    ``packed``: the kernel's layout from ``_convert_weight_to_int4pack_for_cpu``.
    ``scales_and_zeros``: ``[K/32, N, 2]`` in the activation dtype
    (``s = scale``, ``z = min + 8 * scale``). ``out_features``: ``N``.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int

    @classmethod
    def from_q4(cls, parts: Sequence[Q4Weight], dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """Stack ``parts`` along the output rows (q/k/v, gate/up) and pack them.

        Raises ``ValueError`` when the parts disagree on the input size or it
        is not a multiple of 32.
        """
        ks = {p.codes.shape[1] for p in parts}
        if len(ks) != 1 or next(iter(ks)) % _GROUP:
            raise ValueError(f"Q4 parts must share one input size that is a multiple of {_GROUP}, got {sorted(ks)}")
        codes = torch.cat([p.codes for p in parts]).to(torch.int32)
        scale = torch.cat([p.scale for p in parts]).float()
        zero = torch.cat([p.min for p in parts]).float() + 8.0 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous()
        return cls(packed, scales_and_zeros, codes.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, _GROUP, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2
