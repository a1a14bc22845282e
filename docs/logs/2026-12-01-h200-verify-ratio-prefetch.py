"""Issue 5: the tree-attention kernel loading each tile's keys and values one tile ahead ("prefetch") against
loading them in the tile's own step, in one process on the 8B shape (batch 1, CUDA graphs, context 1024): one
model, two TreeVerifiers captured with each setting, ten alternations of 60 calls each of (setting x 1 node, 65
nodes), medians and each setting's ratio of 65 nodes to 1, as 2026-11-30-h200-verify-ratio-64-nodes.py measures
it. From the repository root on the H200:
python3 docs/logs/2026-12-01-h200-verify-ratio-prefetch.py --out verify-ratio-prefetch.json"""
import json, random, statistics, sys, time
import torch
from treeserve.kernels import tree_attention
from treeserve.models.paged_kv import PagedKVCache
from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
from treeserve.verifier.graphs import TreeVerifier

out = sys.argv[sys.argv.index("--out") + 1]
context, calls, alternations = 1024, 60, 10
cfg = SHAPES["llama3-8b"]
model = random_model(cfg, "cuda", torch.bfloat16)
rng = random.Random(0)
trees = {size: chain_or_tree(size, rng, cfg.vocab_size) for size in (1, 65)}
steps = {}
for prefetch in (False, True):
    tree_attention.TUNING["prefetch"] = prefetch  # read when the graphs are captured
    pool = PagedKVCache(cfg, (context + 65) // 16 + 4, 16, model.dtype, "cuda")
    pool.data.normal_(generator=torch.Generator("cuda").manual_seed(0))
    verifier = TreeVerifier(model, pool, 1, 65, graphs=True)
    verifier.capture()
    sequence = pool.sequence(); sequence.reserve(context); sequence.keep(list(range(context)))
    for size, tree in trees.items():
        args = ([sequence], [tree.tokens], [torch.tensor(tree.depths()) + context], [tree.ancestor_mask()])
        steps[prefetch, size] = (lambda v, a: lambda: v.verify(*a))(verifier, args)
        for _ in range(10):
            steps[prefetch, size]()
torch.cuda.synchronize()
with torch.inference_mode():
    logits = {key: step()[0][0].tensor().float().clone() for key, step in steps.items()}
same_argmax = {size: bool(torch.equal(logits[False, size].argmax(-1), logits[True, size].argmax(-1))) for size in (1, 65)}
max_diff = {size: float((logits[False, size] - logits[True, size]).abs().max()) for size in (1, 65)}
rows = []
for alternation in range(alternations):
    medians = {}
    for key, step in steps.items():
        times = []
        for _ in range(calls):
            torch.cuda.synchronize(); started = time.perf_counter(); step(); torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1000)
        medians[key] = statistics.median(times)
    row = {f"{'prefetch' if p else 'in_step'}_{size}_ms": round(ms, 4) for (p, size), ms in medians.items()}
    row["ratio_in_step"] = round(medians[False, 65] / medians[False, 1], 4)
    row["ratio_prefetch"] = round(medians[True, 65] / medians[True, 1], 4)
    rows.append(row)
    print(row, flush=True)
summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
print("median:", summary, "same argmax:", same_argmax, "max |logit difference|:", max_diff, flush=True)
json.dump({"command": "python3 docs/logs/2026-12-01-h200-verify-ratio-prefetch.py --out " + out, "context": context,
           "calls": calls, "rows": rows, "median": summary, "same_argmax": same_argmax,
           "max_logit_difference": max_diff}, open(out, "w"), indent=1)
