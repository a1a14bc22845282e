"""Tree attention over a paged KV cache: one read of each sequence's keys and values per query block.

Layout: the cache of one layer is `keys`/`values` (num_blocks, block_size, kv_heads, head_dim); sequence b owns
the blocks listed in `block_tables[b]`, and its token at position p lives in block block_tables[b, p //
block_size] at offset p % block_size. The first `prefix_lens[b]` positions are the committed prefix, visible to
every query; the next `tree_sizes[b]` positions hold the tree being verified (their keys/values already
written), and `tree_mask[b, i, j]` says whether tree node i sees tree node j (its ancestors and itself). Query
rows beyond a sequence's tree are padding: their output is zero. Nothing here grows with prefix x tree: the mask
is tree x tree.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, prefix_ptr, size_ptr, mask_ptr, scale,
    stride_qb, stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_tb, stride_mb, stride_mi,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    kv_head = h // GROUP
    prefix = tl.load(prefix_ptr + b)
    size = tl.load(size_ptr + b)
    length = prefix + size

    rows = t0 + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, PADDED_DIM)
    row_ok = rows < size
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    best = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    acc = tl.zeros((BLOCK_T, PADDED_DIM), tl.float32)
    # A while loop, not range(): Triton's interpreter cannot take a range bound loaded from memory.
    n0 = 0
    while n0 < length:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        block = tl.load(tables_ptr + b * stride_tb + cols // BLOCK_SIZE, mask=col_ok, other=0)
        slot = cols % BLOCK_SIZE
        k = tl.load(k_ptr + block[:, None] * stride_kn + slot[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vn + slot[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # The prefix is visible to every row; a tree column only where the row's tree mask says so.
        in_tree = cols - prefix
        tree_bit = tl.load(mask_ptr + b * stride_mb + rows[:, None] * stride_mi + in_tree[None, :],
                           mask=row_ok[:, None] & (in_tree[None, :] >= 0) & col_ok[None, :], other=0)
        visible = col_ok[None, :] & ((cols[None, :] < prefix) | (tree_bit != 0))
        # Products in the storage dtype (tensor cores for bfloat16), sums in float32.
        scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # Rows that have seen nothing yet keep a -inf maximum; shift by 0 there to avoid inf - inf.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        p = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
        best = new_best
        n0 += BLOCK_N
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_ot + h * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                   prefix_lens: torch.Tensor, tree_sizes: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float | None = None, block_t: int = 16, block_n: int = 32) -> torch.Tensor:
    """The Triton kernel for `references.tree_attention_reference` (same arguments); padding rows come out
    zero."""
    batch, rows, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = keys.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("q, keys and values must be contiguous in their last dimension")
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros_like(q)
    mask = tree_mask.to(torch.int8).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    grid = (batch, heads, triton.cdiv(rows, block_t))
    _tree_attention_kernel[grid](
        q, keys, values, out, tables, prefix_lens.to(torch.int32).contiguous(),
        tree_sizes.to(torch.int32).contiguous(), mask, scale,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tables.stride(0), mask.stride(0), mask.stride(1),
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        PADDED_DIM=max(16, triton.next_power_of_2(head_dim)), BLOCK_T=block_t, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 exact, not TF32
        # Triton's interpreter multiplies bfloat16 matrices wrongly (NumPy has no bfloat16): upcast there.
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1" and q.dtype != torch.float32)
    return out
