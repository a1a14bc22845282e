"""PyTorch references of the kernels: the definitions the Triton kernels are tested against, and the path on
machines without Triton (no import of it here). Layouts are described in each kernel's module. The DDTree search's
reference is the drafter's own search, treeserve.drafter.trees.ddtree_select (kernels/ddtree_search.py)."""

from __future__ import annotations

import math

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 whatever the storage dtype, as the reference implementations do; then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum x + delta (in the storage dtype) and its RMSNorm."""
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for the gate and up projections side by side in the last dimension (..., 2 * I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, H, D) with cos/sin (N, 1, D) (the halves rotate together: the HF layout)."""
    return x * cos + rotate_half(x) * sin


def kv_write_reference(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """In place: keys/values (num_blocks, block_size, kv_heads, head_dim); new_* (N, kv_heads, head_dim), of the
    cache's dtype."""
    real = slots >= 0
    flat_keys, flat_values = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])
    flat_keys[slots[real].long()] = new_keys[real]
    flat_values[slots[real].long()] = new_values[real]


def kv_move_reference(cache: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """In place: cache (slabs, slots, row); slot sources[i] to slot targets[i] in every slab, every source read
    before any target is written."""
    cache[:, targets.long()] = cache[:, sources.long()]


def tree_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                             prefix_lens: torch.Tensor, tree_sizes: torch.Tensor, tree_mask: torch.Tensor | None,
                             scale: float | None = None) -> torch.Tensor:
    """q (B, T, H, D) -> (B, T, H, D), in float32 math, one sequence at a time (the definition, not fast).
    `tree_mask` None: causal among the new rows."""
    batch, rows, heads, head_dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(batch, rows, heads, head_dim, dtype=torch.float32, device=q.device)
    for b, (prefix, size) in enumerate(zip(prefix_lens.tolist(), tree_sizes.tolist())):
        length = prefix + size
        positions = torch.arange(length, device=q.device)
        blocks = block_tables[b, positions // block_size].long()
        k = keys[blocks, positions % block_size].float()  # (L, KVH, D)
        v = values[blocks, positions % block_size].float()
        visible = torch.ones(size, length, dtype=torch.bool, device=q.device)
        if tree_mask is None:
            visible[:, prefix:] = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        else:
            visible[:, prefix:] = tree_mask[b, :size, :size]
        # Query heads grouped over their key/value head: (KVH, group, size, D) against (KVH, L, D).
        grouped = q[b, :size].float().view(size, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = grouped @ k.transpose(0, 1)[:, None].transpose(-1, -2) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        attended = scores.softmax(dim=-1) @ v.transpose(0, 1)[:, None]  # (KVH, group, size, D)
        out[b, :size] = attended.permute(2, 0, 1, 3).reshape(size, heads, head_dim)
    return out.to(q.dtype)
