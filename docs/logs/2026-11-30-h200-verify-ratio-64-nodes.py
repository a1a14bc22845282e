"""Issue 5: one verification of 64 tree nodes (65 rows, the root included) against one decode step, on the 8B
shape (Llama-3-8B config, random bfloat16 weights built on the GPU), batch 1, CUDA graphs, context 1024. Measured
interleaved, so that drift of the machine falls on both: ten alternations of 60 calls at 1 node and 60 at 65 nodes
(wall time of TreeVerifier.verify until the logits are ready, host staging included, inputs made once, as
graph_bench times them), the median of each, and their ratio. Run on the H200 from the repository root with
treeserve importable: python3 docs/logs/2026-11-30-h200-verify-ratio-64-nodes.py --out interleaved-1.json
(docs/figures/verify-ratio-8b-h200/interleaved-1.json and -2.json are two processes of it)."""
import json, random, statistics, sys, time
import torch
from treeserve.models.paged_kv import PagedKVCache
from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
from treeserve.verifier.graphs import TreeVerifier

out = sys.argv[sys.argv.index("--out") + 1]
context, calls, alternations = 1024, 60, 10
cfg = SHAPES["llama3-8b"]
model = random_model(cfg, "cuda", torch.bfloat16)
pool = PagedKVCache(cfg, (context + 65) // 16 + 4, 16, model.dtype, "cuda")
pool.data.normal_()
verifier = TreeVerifier(model, pool, 1, 65, graphs=True)
verifier.capture()
sequence = pool.sequence(); sequence.reserve(context); sequence.keep(list(range(context)))
rng = random.Random(0)
steps = {}
for size in (1, 65):
    tree = chain_or_tree(size, rng, cfg.vocab_size)
    args = ([sequence], [tree.tokens], [torch.tensor(tree.depths()) + context], [tree.ancestor_mask()])
    steps[size] = (lambda a: lambda: verifier.verify(*a))(args)  # inputs made once, as graph_bench does
    for _ in range(10):
        steps[size]()
torch.cuda.synchronize()
rows = []
for alternation in range(alternations):
    medians = {}
    for size, step in steps.items():
        times = []
        for _ in range(calls):
            torch.cuda.synchronize(); started = time.perf_counter(); step(); torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1000)
        medians[size] = statistics.median(times)
    rows.append({"decode_ms": round(medians[1], 4), "tree65_ms": round(medians[65], 4),
                 "ratio": round(medians[65] / medians[1], 4)})
    print(rows[-1], flush=True)
ratios = [row["ratio"] for row in rows]
summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
           "median_decode_ms": statistics.median(r["decode_ms"] for r in rows),
           "median_tree65_ms": statistics.median(r["tree65_ms"] for r in rows)}
print(summary, flush=True)
json.dump({"command": "python3 docs/logs/2026-11-30-h200-verify-ratio-64-nodes.py --out " + out, "context": context, "calls": calls, "rows": rows, "summary": summary},
          open(out, "w"), indent=1)
