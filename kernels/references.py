"""PyTorch references of the kernels: the definitions the Triton kernels are tested against, and the path on
machines without Triton (no import of it here). Layouts are described in each kernel's module."""

from __future__ import annotations

import math

import torch


def kv_write_reference(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """In place: keys/values (num_blocks, block_size, kv_heads, head_dim); new_* (N, kv_heads, head_dim), of the
    cache's dtype."""
    real = slots >= 0
    flat_keys, flat_values = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])
    flat_keys[slots[real].long()] = new_keys[real]
    flat_values[slots[real].long()] = new_values[real]


def tree_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                             prefix_lens: torch.Tensor, tree_sizes: torch.Tensor, tree_mask: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """q (B, T, H, D) -> (B, T, H, D), in float32 math, one sequence at a time (the definition, not fast)."""
    batch, rows, heads, head_dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(batch, rows, heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        prefix, size = int(prefix_lens[b]), int(tree_sizes[b])
        length = prefix + size
        positions = torch.arange(length, device=q.device)
        blocks = block_tables[b, positions // block_size].long()
        k = keys[blocks, positions % block_size].float()  # (L, KVH, D)
        v = values[blocks, positions % block_size].float()
        visible = torch.ones(size, length, dtype=torch.bool, device=q.device)
        visible[:, prefix:] = tree_mask[b, :size, :size]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = (q[b, :size, h].float() @ k[:, kv].T) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out[b, :size, h] = scores.softmax(dim=-1) @ v[:, kv]
    return out.to(q.dtype)
