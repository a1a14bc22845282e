"""Issue 5, next after the combine's warps: how many key-range splits a 65-row tree's attention should take now
that its combine runs at one warp (the launch sweep chose 2 programs per multiprocessor, 6 splits at 65 rows on the
H200, when the combine ran at 4 warps). In one process on the 8B shape (batch 1, CUDA graphs, context 1024): one
model, a TreeVerifier captured per variant, the 65-row launches given 4, 6 (the default), 8, 10 or 13 splits (the
combine's warps by its rule), ten alternations of 60 calls each of (variant x 1 node, 65 nodes), medians and each
variant's ratio of 65 nodes to 1, as 2026-11-30-h200-verify-ratio-64-nodes.py measures it; logits against the
default's. From the repository root on the H200:
python3 docs/logs/2026-12-01-h200-tree-splits-variants.py --out tree-splits-variants.json"""
import json, random, statistics, sys, time
import torch
from treeserve.kernels import tree_attention as ta
from treeserve.models.paged_kv import PagedKVCache
from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
from treeserve.verifier.graphs import TreeVerifier

TREE_ROWS = 65
VARIANTS = {"default": None, "splits_4": 4, "splits_8": 8, "splits_10": 10, "splits_13": 13}


def with_tree_splits(original, splits):
    """ta.tree_attention, with `splits` key-range splits for a 65-row tree's launch (others as they are)."""
    def attend(q, keys, values, block_tables, prefix_lens, tree_sizes, tree_mask, scale=None, launch_splits=None):
        if tree_mask is not None and q.shape[1] == TREE_ROWS:
            launch_splits = splits
        return original(q, keys, values, block_tables, prefix_lens, tree_sizes, tree_mask, scale, launch_splits)
    return attend


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    context, calls, alternations = 1024, 60, 10
    cfg = SHAPES["llama3-8b"]
    model = random_model(cfg, "cuda", torch.bfloat16)
    rng = random.Random(0)
    trees = {size: chain_or_tree(size, rng, cfg.vocab_size) for size in (1, TREE_ROWS)}
    original = ta.tree_attention
    steps = {}
    for name, splits in VARIANTS.items():
        ta.tree_attention = original if splits is None else with_tree_splits(original, splits)  # read at capture
        pool = PagedKVCache(cfg, (context + TREE_ROWS) // 16 + 4, 16, model.dtype, "cuda")
        pool.data.normal_(generator=torch.Generator("cuda").manual_seed(0))
        verifier = TreeVerifier(model, pool, 1, TREE_ROWS, graphs=True)
        verifier.capture()
        sequence = pool.sequence(); sequence.reserve(context); sequence.keep(list(range(context)))
        for size, tree in trees.items():
            args = ([sequence], [tree.tokens], [torch.tensor(tree.depths()) + context], [tree.ancestor_mask()])
            steps[name, size] = (lambda v, a: lambda: v.verify(*a))(verifier, args)
            for _ in range(10):
                steps[name, size]()
    ta.tree_attention = original
    torch.cuda.synchronize()
    with torch.inference_mode():
        logits = {key: step()[0][0].tensor().float().clone() for key, step in steps.items()}
    agreement = {f"{name}_{size}": float((logits[name, size] - logits["default", size]).abs().max())
                 for name in VARIANTS for size in (1, TREE_ROWS)}
    print("max |logit difference| against default:", agreement, flush=True)
    rows = []
    for alternation in range(alternations):
        medians = {}
        for key, step in steps.items():
            times = []
            for _ in range(calls):
                torch.cuda.synchronize(); started = time.perf_counter(); step(); torch.cuda.synchronize()
                times.append((time.perf_counter() - started) * 1000)
            medians[key] = statistics.median(times)
        row = {f"{name}_{size}_ms": round(ms, 4) for (name, size), ms in medians.items()}
        row.update({f"ratio_{name}": round(medians[name, TREE_ROWS] / medians[name, 1], 4) for name in VARIANTS})
        rows.append(row)
        print(row, flush=True)
    summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print("median:", summary, flush=True)
    json.dump({"command": "python3 docs/logs/2026-12-01-h200-tree-splits-variants.py --out " + out,
               "context": context, "calls": calls, "variants": VARIANTS, "rows": rows, "median": summary,
               "max_logit_difference": agreement}, open(out, "w"), indent=1)
