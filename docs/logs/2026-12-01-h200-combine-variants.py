"""Issue 5: the split partials of the tree-attention kernel (what the combine kernel reads) in the storage dtype
(bfloat16) instead of float32, and the combine kernel at 1, 2, 4 (the default) and 8 warps, in one process on the
8B shape (batch 1, CUDA graphs, context 1024): one model, a TreeVerifier captured per variant, ten alternations of
60 calls each of (variant x 1 node, 65 nodes), medians and each variant's ratio of 65 nodes to 1, as
2026-11-30-h200-verify-ratio-64-nodes.py measures it; each variant's logits against the default's. From the
repository root on the H200: python3 docs/logs/2026-12-01-h200-combine-variants.py --out combine-variants.json
(the measuring is verify_variants.measure, shared with -tree-splits-variants.py)."""
import math, os, sys
import torch
import triton
from treeserve.kernels import tree_attention as ta
from verify_variants import measure

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # for a check on the CPU


def variant(partials_dtype, combine_warps):
    """ta.tree_attention with the partials' dtype and the combine's warps as given (same kernels otherwise)."""
    def attend(q, keys, values, block_tables, prefix_lens, tree_sizes, tree_mask, scale=None, splits=None):
        batch, rows, heads, head_dim = q.shape
        kv_heads = keys.shape[2]
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        group = heads // kv_heads
        padded_group = triton.next_power_of_2(group)
        block_t, row_blocks, splits = ta.launch_shape(batch, rows, heads, kv_heads, q.device, splits)
        out = torch.empty_like(q)
        causal = tree_mask is None
        mask = prefix_lens.new_zeros(1, 1, 1, dtype=torch.int8) if causal else tree_mask.to(torch.int8).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        sizes = tree_sizes.to(torch.int32).contiguous()
        if splits > 1:
            dtype = q.dtype if partials_dtype == "storage" else torch.float32
            part_acc = q.new_empty(splits, batch, rows, heads, head_dim, dtype=dtype)
            width = triton.cdiv(2 * heads, 16) * 16
            part_stat = q.new_empty(splits, batch, rows, width, dtype=torch.float32)[..., :2 * heads]
            part_stat = part_stat.unflatten(-1, (heads, 2))
        else:
            part_acc = part_stat = out.new_empty(1, 1, 1, 1, 2, dtype=torch.float32)
        padded_dim = max(16, triton.next_power_of_2(head_dim))
        ta._tree_attention_kernel[(batch, kv_heads, row_blocks * splits)](
            q, keys, values, out, part_acc, part_stat, tables, prefix_lens.to(torch.int32).contiguous(), sizes,
            mask, scale, q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
            tables.stride(0), mask.stride(0), mask.stride(1), *part_acc.stride()[:4], *part_stat.stride()[:4],
            rows, splits, GROUP=group, PADDED_GROUP=padded_group, BLOCK_SIZE=keys.shape[1], HEAD_DIM=head_dim,
            PADDED_DIM=padded_dim, BLOCK_T=block_t, BLOCK_N=ta.TUNING["block_n"], CAUSAL=causal,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=INTERPRET and q.dtype != torch.float32,
            INTERPRET=INTERPRET,
            NUM_STAGES=ta.TUNING["num_stages"], num_warps=ta.TUNING["num_warps"])
        if splits > 1:
            ta._combine_splits_kernel[(batch, rows, kv_heads)](
                part_acc, part_stat, out, sizes, *part_acc.stride()[:4], *part_stat.stride()[:4],
                out.stride(0), out.stride(1), out.stride(2), splits, GROUP=group, PADDED_GROUP=padded_group,
                PADDED_SPLITS=ta.padded_splits(splits), HEAD_DIM=head_dim, PADDED_DIM=padded_dim,
                num_warps=combine_warps)
        return out
    return attend


VARIANTS = {"default": None, "bf16_partials": ("storage", 4), "combine_1w": ("float32", 1),
            "combine_2w": ("float32", 2), "combine_8w": ("float32", 8), "bf16_partials_2w": ("storage", 2)}

if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    measure({name: {} if setting is None else {(ta, "tree_attention"): variant(*setting)}
             for name, setting in VARIANTS.items()}, VARIANTS,
            "python3 docs/logs/2026-12-01-h200-combine-variants.py --out " + out, out)
