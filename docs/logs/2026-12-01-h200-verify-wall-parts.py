"""Issue 5: where the wall time of one verification goes beyond its kernels, at 1 and at 65 nodes (8B shape, batch
1, CUDA graphs, context 1024, as 2026-11-30-h200-verify-ratio-64-nodes.py sets it up). TreeVerifier.verify's
steps one by one, interleaved like that script (ten alternations of 60 calls a size): host staging, the copies
into the graph's inputs and the replay (GPU time between CUDA events), and the wall time until the logits are
ready. With the ratio script's figures for the same sizes. From the repository root on the H200:
python3 docs/logs/2026-12-01-h200-verify-wall-parts.py --out verify-wall-parts.json"""
import json, random, statistics, sys, time
import torch
from treeserve.models.graphs import stage_trees
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
runner = verifier.runner
sequence = pool.sequence(); sequence.reserve(context); sequence.keep(list(range(context)))
rng = random.Random(0)
inputs = {}
for size in (1, 65):
    tree = chain_or_tree(size, rng, cfg.vocab_size)
    inputs[size] = ([sequence], [tree.tokens], [torch.tensor(tree.depths()) + context], [tree.ancestor_mask()])
events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]


@torch.inference_mode()  # as TreeVerifier.verify runs: the graph's inputs are inference tensors
def parts(size):
    """One verification in TreeVerifier.verify's steps: (host staging ms, copies GPU ms, replay GPU ms, wall ms)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    key = runner.bucket(1, size)
    staged = stage_trees(*inputs[size], *key, runner.table_width, into=runner._staging(*key))
    staged_at = time.perf_counter()
    events[0].record()
    runner._load(runner.static.view(*key), staged)
    runner._copied()
    events[1].record()
    runner.graphs[key].graph.replay()
    events[2].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) * 1000
    return ((staged_at - started) * 1000, events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2]), wall)


def verify_wall(size):
    torch.cuda.synchronize(); started = time.perf_counter(); verifier.verify(*inputs[size]); torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000


for size in (1, 65):
    for _ in range(10):
        parts(size); verify_wall(size)
names = ("stage_host_ms", "copies_gpu_ms", "replay_gpu_ms", "parts_wall_ms")
rows = []
for alternation in range(alternations):
    row = {}
    for size in (1, 65):
        measured = [parts(size) for _ in range(calls)]
        for i, name in enumerate(names):
            row[f"{name}_{size}"] = round(statistics.median(m[i] for m in measured), 4)
        row[f"verify_wall_ms_{size}"] = round(statistics.median(verify_wall(size) for _ in range(calls)), 4)
    row["ratio_verify_wall"] = round(row["verify_wall_ms_65"] / row["verify_wall_ms_1"], 4)
    row["ratio_replay_gpu"] = round(row["replay_gpu_ms_65"] / row["replay_gpu_ms_1"], 4)
    rows.append(row)
    print(row, flush=True)
summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
print("median:", summary, flush=True)
json.dump({"command": "python3 docs/logs/2026-12-01-h200-verify-wall-parts.py --out " + out, "context": context,
           "calls": calls, "rows": rows, "median": summary}, open(out, "w"), indent=1)
