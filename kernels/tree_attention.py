"""Tree attention over a paged KV cache.

Work split: one program per (request, key/value head, block of tree rows, key range). Its query rows are the
block's tree rows times every query head of the key/value head (GQA), so each key and value is read once per
row block, not once per query head; and the key range splits long contexts over several programs (flash-
decoding), so one request's short tree still spreads over the GPU. Split results meet in a second small kernel.
The split count depends only on the shapes, never on the lengths, so a captured CUDA graph stays valid.

Layout: the cache of one layer is `keys`/`values` (num_blocks, block_size, kv_heads, head_dim); sequence b owns
the blocks listed in `block_tables[b]`, and its token at position p lives in block block_tables[b, p //
block_size] at offset p % block_size. The first `prefix_lens[b]` positions are the committed prefix, visible to
every query; the next `tree_sizes[b]` positions hold the tree being verified (their keys/values already
written), and `tree_mask[b, i, j]` says whether tree node i sees tree node j (its ancestors and itself); a
`tree_mask` of None means causal among the new rows (a prompt), so a prefill carries no n x n mask. Query rows
beyond a sequence's tree are padding: their output is zero. Nothing here grows with prefix x tree: the mask is
tree x tree.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, n0, best, total, acc, k_ptr, v_ptr, tables_ptr, mask_ptr, b, kv_head, t, row_ok, dims, dim_ok,
                 prefix, end, scale, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_tb,
                 stride_mb, stride_mi, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over keys n0 .. n0 + BLOCK_N (those below `end`): the running maximum, sum and output."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    block = tl.load(tables_ptr + b * stride_tb + cols // BLOCK_SIZE, mask=col_ok, other=0)
    slot = cols % BLOCK_SIZE
    k = tl.load(k_ptr + block[:, None] * stride_kn + slot[:, None] * stride_ks + kv_head * stride_kh
                + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    v = tl.load(v_ptr + block[:, None] * stride_vn + slot[:, None] * stride_vs + kv_head * stride_vh
                + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    # The prefix is visible to every row; a new column only where the row's tree mask (or causality) says so.
    in_tree = cols - prefix
    if CAUSAL:
        tree_bit = (in_tree[None, :] <= t[:, None]).to(tl.int8)
    else:
        tree_bit = tl.load(mask_ptr + b * stride_mb + t[:, None] * stride_mi + in_tree[None, :],
                           mask=row_ok[:, None] & (in_tree[None, :] >= 0) & col_ok[None, :], other=0)
    visible = col_ok[None, :] & ((cols[None, :] < prefix) | (tree_bit != 0))
    # Products in the storage dtype (tensor cores for bfloat16), sums in float32.
    scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * scale,
                      float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    # Rows that have seen nothing yet keep a -inf maximum; shift by 0 there to avoid inf - inf.
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    p = tl.exp(scores - shift[:, None])
    rescale = tl.exp(best - shift)
    total = total * rescale + tl.sum(p, axis=1)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
    return new_best, total, acc


# Integer arguments that vary with a prompt's shape are not specialised on (Triton compiles a variant for a value of
# 1 and for a multiple of 16): otherwise a fresh server compiled, mid-request, for a prompt whose block table or
# row count happened to meet a new case. Compiled variants then follow the constexprs alone, which `warm_up`
# launches one by one.
@triton.jit(do_not_specialize=["stride_tb", "rows", "splits"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_stat_ptr, tables_ptr, prefix_ptr, size_ptr, mask_ptr, scale,
    stride_qb, stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_tb, stride_mb, stride_mi,
    stride_as, stride_ab, stride_at, stride_ah, stride_ss, stride_sb, stride_st, stride_sh, rows, splits,
    GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # `splits` is a runtime value, not a constexpr: it varies with the shapes, and each new constexpr value
    # would compile the kernel again (seconds) in the middle of a request.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_block = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    prefix = tl.load(prefix_ptr + b)
    size = tl.load(size_ptr + b)
    length = prefix + size

    # Query row m is tree row t of query head kv_head * GROUP + g.
    m = tl.arange(0, BLOCK_T * PADDED_GROUP)
    t = row_block * BLOCK_T + m // PADDED_GROUP
    g = m % PADDED_GROUP
    head = kv_head * GROUP + g
    row_ok = (t < size) & (g < GROUP)
    dims = tl.arange(0, PADDED_DIM)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # This program's key range: an equal share of the sequence, whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    best = tl.full((BLOCK_T * PADDED_GROUP,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_T * PADDED_GROUP,), tl.float32)
    acc = tl.zeros((BLOCK_T * PADDED_GROUP, PADDED_DIM), tl.float32)
    if INTERPRET:  # the interpreter cannot take a range bound loaded from memory
        n0 = start
        while n0 < end:
            best, total, acc = _attend_tile(
                q, n0, best, total, acc, k_ptr, v_ptr, tables_ptr, mask_ptr, b, kv_head, t, row_ok, dims, dim_ok,
                prefix, end, scale, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_tb,
                stride_mb, stride_mi, BLOCK_SIZE, BLOCK_N, CAUSAL, PRECISION, UPCAST)
            n0 += BLOCK_N
    else:  # a range the compiler pipelines: the next tile's loads overlap this tile's math
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            best, total, acc = _attend_tile(
                q, n0, best, total, acc, k_ptr, v_ptr, tables_ptr, mask_ptr, b, kv_head, t, row_ok, dims, dim_ok,
                prefix, end, scale, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_tb,
                stride_mb, stride_mi, BLOCK_SIZE, BLOCK_N, CAUSAL, PRECISION, UPCAST)
    if splits == 1:  # every row of the block, padding rows as zeros (the output is never cleared beforehand)
        out = tl.where(row_ok[:, None], acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=((t < rows) & (g < GROUP))[:, None] & dim_ok[None, :])
    else:  # unnormalised partial results, with their maximum and sum, for _combine_splits_kernel
        tl.store(part_acc_ptr + split * stride_as + b * stride_ab + t[:, None] * stride_at
                 + head[:, None] * stride_ah + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        stats = part_stat_ptr + split * stride_ss + b * stride_sb + t * stride_st + head * stride_sh
        tl.store(stats, best, mask=row_ok)
        tl.store(stats + 1, total, mask=row_ok)


@triton.jit(do_not_specialize=["splits"])
def _combine_splits_kernel(
    part_acc_ptr, part_stat_ptr, out_ptr, size_ptr,
    stride_as, stride_ab, stride_at, stride_ah, stride_ss, stride_sb, stride_st, stride_sh,
    stride_ob, stride_ot, stride_oh, splits,
    GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, PADDED_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PADDED_DIM: tl.constexpr,
):
    """One program per (request, row, key/value head): the split partials of the head's query group."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    head = tl.program_id(2) * GROUP + tl.arange(0, PADDED_GROUP)  # (G,)
    head_ok = tl.arange(0, PADDED_GROUP) < GROUP
    dims = tl.arange(0, PADDED_DIM)
    dim_ok = dims < HEAD_DIM
    out_at = out_ptr + b * stride_ob + t * stride_ot + head[:, None] * stride_oh + dims[None, :]
    if t < tl.load(size_ptr + b):
        s = tl.arange(0, PADDED_SPLITS)
        stat_ok = (s < splits)[:, None] & head_ok[None, :]  # (S, G)
        stats = part_stat_ptr + s[:, None] * stride_ss + b * stride_sb + t * stride_st + head[None, :] * stride_sh
        best = tl.load(stats, mask=stat_ok, other=float("-inf"))
        total = tl.load(stats + 1, mask=stat_ok, other=0.0)
        overall = tl.max(best, axis=0)  # (G,)
        overall = tl.where(overall == float("-inf"), 0.0, overall)
        weight = tl.where(best == float("-inf"), 0.0, tl.exp(best - overall[None, :]))  # a split that saw nothing: 0
        acc = tl.load(part_acc_ptr + s[:, None, None] * stride_as + b * stride_ab + t * stride_at
                      + head[None, :, None] * stride_ah + dims[None, None, :],
                      mask=stat_ok[:, :, None] & dim_ok[None, None, :], other=0.0)  # (S, G, D)
        denominator = tl.sum(total * weight, axis=0)
        out = tl.sum(acc * weight[:, :, None], axis=0) / tl.where(denominator > 0, denominator, 1.0)[:, None]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:  # a padding row: zeros (the output is never cleared beforehand)
        tl.store(out_at, tl.zeros((PADDED_GROUP, PADDED_DIM), out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & dim_ok[None, :])


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


# Launch settings, chosen by `python -m treeserve.bench.attention_sweep` (docs/benchmarks.md): query rows per
# program (tree rows x grouped heads), keys per tile, warps, pipeline stages, and how many programs per streaming
# multiprocessor the key-range splits aim for. Run the sweep on another GPU and set the best here.
# The combine kernel's warps follow its work: about `combine_values_per_thread` split partials per thread (each
# program merges padded splits x grouped heads x head_dim of them), 1 to 4 warps: a large tree's few splits merge
# fastest with one warp, a decode step's many splits with more.
TUNING = {"query_rows": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2,
          "combine_values_per_thread": 128}


def default_splits(programs: int, device: torch.device) -> int:
    """Key-range splits so that about TUNING["programs_per_sm"] programs per streaming multiprocessor run (at
    most 32)."""
    return max(1, min(32, (TUNING["programs_per_sm"] * multiprocessors(device)) // max(1, programs)))


def launch_shape(batch: int, rows: int, heads: int, kv_heads: int, device: torch.device,
                 splits: int | None = None) -> tuple[int, int, int]:
    """(tree rows per program, row blocks, key-range splits) of a launch: BLOCK_T is 16 query rows at least
    (tl.dot's minimum), about TUNING["query_rows"] when the tree is large enough."""
    padded_group = triton.next_power_of_2(heads // kv_heads)
    block_t = max(16 // padded_group, min(triton.next_power_of_2(rows), max(1, TUNING["query_rows"] // padded_group)))
    row_blocks = triton.cdiv(rows, block_t)
    return block_t, row_blocks, splits or default_splits(batch * kv_heads * row_blocks, device)


def padded_splits(splits: int) -> int:
    """The combine kernel's split tile (a constexpr: each value is a compiled variant)."""
    return max(2, triton.next_power_of_2(splits))


def combine_warps(splits: int, padded_group: int, padded_dim: int) -> int:
    """The combine kernel's warps for this split count (one per split tile, so warm-up's variants cover them)."""
    values = padded_splits(splits) * padded_group * padded_dim
    return max(1, min(4, triton.next_power_of_2(triton.cdiv(values, 32 * TUNING["combine_values_per_thread"]))))


def compiled_variant(batch: int, rows: int, heads: int, kv_heads: int, device: torch.device) -> tuple[int, int]:
    """What decides which compiled kernels a causal launch of these shapes runs, model and dtype aside: BLOCK_T,
    and the combine's split tile (0: no combine)."""
    block_t, _, splits = launch_shape(batch, rows, heads, kv_heads, device)
    return block_t, padded_splits(splits) if splits > 1 else 0


def warm_up_variants(heads: int, kv_heads: int, device: torch.device) -> list[tuple[int, int]]:
    """Every (BLOCK_T, split tile) a launch of these heads can compile to, with rows and splits that give it: each
    BLOCK_T launch_shape gives (a power of two, so as many rows give it too), each split tile."""
    block_rows = sorted({launch_shape(1, rows, heads, kv_heads, device, 1)[0]
                         for rows in range(1, TUNING["query_rows"] + 1)})
    return [(rows, splits) for rows in block_rows for splits in (1, 2, 4, 8, 16, 32)]


def warm_up(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
            device: torch.device) -> None:
    """Compile now every variant a prefill (causal) launch of this model can meet, on a throwaway cache, rather
    than during a request."""
    variants = warm_up_variants(heads, kv_heads, device)
    blocks = triton.cdiv(max(rows for rows, _ in variants), block_size)
    keys = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    counts = lambda value: torch.tensor([value], dtype=torch.int32, device=device)  # noqa: E731
    for rows, splits in variants:
        q = torch.zeros(1, rows, heads, head_dim, dtype=dtype, device=device)
        tree_attention(q, keys, keys, table, counts(0), counts(rows), None, splits=splits)


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                   prefix_lens: torch.Tensor, tree_sizes: torch.Tensor, tree_mask: torch.Tensor | None,
                   scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """The Triton kernel for `references.tree_attention_reference` (same arguments); padding rows come out
    zero. `splits`: key-range splits per row block (default: from the shapes and the GPU)."""
    batch, rows, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = keys.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("q, keys and values must be contiguous in their last dimension")
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    padded_group = triton.next_power_of_2(group)
    block_t, row_blocks, splits = launch_shape(batch, rows, heads, kv_heads, q.device, splits)
    out = torch.empty_like(q)  # the kernels write every row, padding rows as zeros
    causal = tree_mask is None
    # Causal reads no mask; any int8 tensor stands in for the pointer.
    mask = prefix_lens.new_zeros(1, 1, 1, dtype=torch.int8) if causal else tree_mask.to(torch.int8).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    sizes = tree_sizes.to(torch.int32).contiguous()
    if splits > 1:
        part_acc = q.new_empty(splits, batch, rows, heads, head_dim, dtype=torch.float32)
        # Each row's (maximum, sum) pairs padded to a multiple of 16 floats, so that no stride of the statistics
        # is a new multiple of 16 for some row count (a compiled variant).
        width = triton.cdiv(2 * heads, 16) * 16
        part_stat = q.new_empty(splits, batch, rows, width, dtype=torch.float32)[..., :2 * heads]
        part_stat = part_stat.unflatten(-1, (heads, 2))
    else:  # unused
        part_acc = part_stat = out.new_empty(1, 1, 1, 1, 2, dtype=torch.float32)
    padded_dim = max(16, triton.next_power_of_2(head_dim))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _tree_attention_kernel[(batch, kv_heads, row_blocks * splits)](
        q, keys, values, out, part_acc, part_stat, tables, prefix_lens.to(torch.int32).contiguous(), sizes, mask,
        scale, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tables.stride(0), mask.stride(0), mask.stride(1), *part_acc.stride()[:4], *part_stat.stride()[:4], rows,
        splits, GROUP=group, PADDED_GROUP=padded_group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        PADDED_DIM=padded_dim, BLOCK_T=block_t, BLOCK_N=TUNING["block_n"], CAUSAL=causal,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 exact, not TF32
        # Triton's interpreter multiplies bfloat16 matrices wrongly (NumPy has no bfloat16): upcast there.
        UPCAST=interpret and q.dtype != torch.float32, INTERPRET=interpret, NUM_STAGES=TUNING["num_stages"],
        num_warps=TUNING["num_warps"])
    if splits > 1:
        _combine_splits_kernel[(batch, rows, kv_heads)](
            part_acc, part_stat, out, sizes, *part_acc.stride()[:4], *part_stat.stride()[:4],
            out.stride(0), out.stride(1), out.stride(2), splits, GROUP=group, PADDED_GROUP=padded_group,
            PADDED_SPLITS=padded_splits(splits), HEAD_DIM=head_dim, PADDED_DIM=padded_dim,
            num_warps=combine_warps(splits, padded_group, padded_dim))
    return out
