"""A contiguous per-sequence KV cache and the attention that writes to and reads from it.

Layout: keys/values (layers, kv_heads, capacity, head_dim). Slots [0, length) hold committed tokens; a forward
writes its N tokens at [length, length + N) without committing them, and `keep` then moves the accepted ones
down to the end of the committed prefix, which drops the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treeserve.errors import TreeserveError
from treeserve.models.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def keep(self, pending_rows: list[int]) -> None:
        """Commit rows of the last forward (indices into its N tokens, ascending) and drop the others."""
        count = len(pending_rows)
        if count == 0:
            return
        start = self.length
        if pending_rows != list(range(count)):
            src = torch.tensor(pending_rows, device=self.keys.device) + start
            # Advanced indexing copies first, so overlapping source and destination are safe.
            self.keys[:, :, start:start + count] = self.keys[:, :, src]
            self.values[:, :, start:start + count] = self.values[:, :, src]
        self.length += count


class TreeAttention:
    """Attention for one forward of N tokens over one sequence: the committed prefix is fully visible, and
    `tree_mask` (N, N) says which of the N tokens each one sees (its ancestors and itself)."""

    def __init__(self, cache: KVCache, tree_mask: torch.Tensor):
        n = tree_mask.shape[0]
        if cache.length + n > cache.capacity:
            raise TreeserveError(f"KV cache full: {cache.length} committed + {n} new tokens > capacity {cache.capacity}")
        self.cache = cache
        self.start, self.end = cache.length, cache.length + n
        prefix = torch.ones(n, cache.length, dtype=torch.bool, device=tree_mask.device)
        self.mask = torch.cat((prefix, tree_mask), dim=1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[:, self.start:self.end] = k.transpose(0, 1)
        values[:, self.start:self.end] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None, :, :self.end], values[None, :, :self.end],
            attn_mask=self.mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # (N, H, D)


class BatchAttention:
    """Several requests' TreeAttentions in one forward: rows are split by request, each attends over its own
    cache. (A Python loop over requests; the GPU verifier replaces it with one paged-attention kernel.)"""

    def __init__(self, parts: list[TreeAttention]):
        self.parts = parts
        self.sizes = [part.end - part.start for part in parts]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](layer, q, k, v)
        return torch.cat([part(layer, *rows) for part, *rows in
                          zip(self.parts, q.split(self.sizes), k.split(self.sizes), v.split(self.sizes))])
