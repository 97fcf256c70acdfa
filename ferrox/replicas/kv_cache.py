"""The paged KV cache tensors of one replica.

Decided here: the memory layout of the full-attention KV cache, one tensor
for K and one for V, each ``[num_layers, num_pages, page_size, num_kv_heads,
head_dim]``, and how many bytes one page costs across all layers. A *page*
is the unit the scheduler reserves and frees; the same page id addresses the
same slot range in every layer, so one page table per sequence serves the
whole model. A token's *slot* is ``page_id * page_size + offset_in_page``:
viewing one layer's cache as ``[num_pages * page_size, num_kv_heads,
head_dim]`` turns writes into a single ``index_copy_`` and lets the
vllm-flash-attn kernels read the cache through a block table unchanged
(their paged layout is exactly ``[num_blocks, block_size, num_kv_heads,
head_dim]``).

Deliberately not here: which pages belong to whom (the page pools and the
scheduler decide that), how many pages fit in device memory (the engine
measures it and calls :meth:`KVCache.bytes_per_page`), and any window or
recurrent state pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """K and V pages for every layer of one model.

    ``k`` and ``v``: ``[num_layers, num_pages, page_size, num_kv_heads,
    head_dim]``, in the model's dtype, on the model's device.
    ``page_size``: tokens per page.
    """

    k: torch.Tensor
    v: torch.Tensor
    page_size: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "KVCache":
        """Allocate zeroed K and V caches.

        Zeroed rather than ``empty`` so that slots read but masked out (the
        padded tail of a batched gather) never hold NaN or Inf bit patterns:
        a masked score is replaced before softmax, but ``0 * NaN`` in the
        value product would still poison the output.

        Raises ``ValueError`` if any dimension is not positive.
        """
        dims = dict(
            num_layers=num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for key, value in dims.items():
            if int(value) < 1:
                raise ValueError(f"{key} must be at least 1, got {value}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k=k, v=v, page_size=page_size)

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Bytes one page occupies, K and V together, summed over all layers.

        ``2 * num_layers * page_size * num_kv_heads * head_dim * itemsize``.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[num_pages, page_size, num_kv_heads, head_dim]`` K and V views of one layer."""
        return self.k[index], self.v[index]
