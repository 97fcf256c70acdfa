"""Parameters held under their Hugging Face names, for the window and hybrid families.

Decided here: a model declares each parameter once with its checkpoint name
(``model.layers.3.mamba.in_proj.weight``); :class:`HFParams` registers it
on the module (dots become ``__``, which ``nn.Module`` accepts) and
:meth:`HFParams.load_hf` copies a checkpoint's tensors into them with the
same strictness as the Llama loader: every name exactly once, shapes
checked, unknown names refused.

Deliberately not here: fusing parameters (the Llama model does that for its
hot path; these families keep one tensor per checkpoint name).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HFParams", "rms_norm"]

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then times the gain."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = xf.to(x.dtype)
    return out if weight is None else weight * out


class HFParams(nn.Module):
    """Base class: ``self.p(name, shape)`` declares a parameter under its HF name."""

    def __init__(self, dtype: torch.dtype, device) -> None:
        super().__init__()
        self._hf: dict[str, nn.Parameter] = {}
        self._dtype = dtype
        self._device = device

    def p(self, name: str, shape, dtype: torch.dtype | None = None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype or self._dtype, device=self._device), requires_grad=False)
        self.register_parameter(name.replace(".", "__"), param)
        self._hf[name] = param
        return param

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]], tied_head: bool) -> None:
        """Copy HF-named tensors in. Raises ``ValueError`` listing unexpected or
        missing names, or a shape that does not match the config."""
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if _IGNORED.search(name) or (name == "lm_head.weight" and tied_head):
                continue
            param = self._hf.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.data.copy_(tensor)
            seen.add(name)
        missing = sorted(set(self._hf) - seen)
        if unexpected or missing:
            parts = []
            if unexpected:
                parts.append(f"unexpected weights: {', '.join(sorted(unexpected)[:20])}")
            if missing:
                parts.append(f"missing weights: {', '.join(missing[:20])}")
            raise ValueError("; ".join(parts) + f" ({len(unexpected)} unexpected, {len(missing)} missing)")

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` from the tied embedding or ``lm_head``
        (subclasses set ``self.embed`` and ``self.lm_head``, the latter ``None`` when tied)."""
        weight = self.embed if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (see :meth:`HFParams.load_hf`)."""
        self.load_hf(weights, tied_head=self.lm_head is None)
