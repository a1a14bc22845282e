"""Issue 5, next after the combine's warps: how many key-range splits a 65-row tree's attention should take now
that its combine runs at one warp (the launch sweep chose 2 programs per multiprocessor, 6 splits at 65 rows on the
H200, when the combine ran at 4 warps). In one process on the 8B shape (batch 1, CUDA graphs, context 1024): one
model, a TreeVerifier captured per variant, the 65-row launches given 4, 6 (the default), 8, 10 or 13 splits (the
combine's warps by its rule), ten alternations of 60 calls each of (variant x 1 node, 65 nodes), medians and each
variant's ratio of 65 nodes to 1, as 2026-11-30-h200-verify-ratio-64-nodes.py measures it; logits against the
default's (verify_variants.measure, shared with -combine-variants.py). From the repository root on the H200:
python3 docs/logs/2026-12-01-h200-tree-splits-variants.py --out tree-splits-variants.json"""
import sys
from treeserve.kernels import tree_attention as ta
from verify_variants import TREE, measure

VARIANTS = {"default": None, "splits_4": 4, "splits_8": 8, "splits_10": 10, "splits_13": 13}


def with_tree_splits(original, splits):
    """ta.tree_attention, with `splits` key-range splits for a 65-row tree's launch (others as they are)."""
    def attend(q, keys, values, block_tables, prefix_lens, tree_sizes, tree_mask, scale=None, launch_splits=None):
        if tree_mask is not None and q.shape[1] == TREE:
            launch_splits = splits
        return original(q, keys, values, block_tables, prefix_lens, tree_sizes, tree_mask, scale, launch_splits)
    return attend


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    measure({name: {} if splits is None else {(ta, "tree_attention"): with_tree_splits(ta.tree_attention, splits)}
             for name, splits in VARIANTS.items()}, VARIANTS,
            "python3 docs/logs/2026-12-01-h200-tree-splits-variants.py --out " + out, out)
