"""The script behind 2026-11-30-h200-kernels-1-vs-65-rows.log (issue 5): where the 64 extra rows of a 65-node
verification go, on the 8B shape, batch 1, CUDA graphs, context 1024. Per-kernel GPU time of one verification at 1
and at 65 nodes (graph replay under torch.profiler, 20 calls each), and their difference. Its wall-time line
rebuilt the tree mask and depths inside every call (host work that graph_bench and the interleaved ratio script
do once), so use that script for the ratio; the kernel times are the device's alone. From the repository root
on the H200: python3 docs/logs/2026-11-30-h200-kernels-1-vs-65-rows.py --out kernels-1-vs-65-rows.json"""
import argparse, collections, json, random, statistics, sys, time
import torch
from treeserve.models.paged_kv import PagedKVCache
from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
from treeserve.verifier.graphs import TreeVerifier

p = argparse.ArgumentParser()
p.add_argument("--shape", default="llama3-8b"); p.add_argument("--device", default="cuda")
p.add_argument("--out", default="prof5.json"); p.add_argument("--context", type=int, default=1024)
p.add_argument("--calls", type=int, default=20)
args = p.parse_args()
cuda = args.device == "cuda"
cfg = SHAPES[args.shape]
model = random_model(cfg, args.device, torch.bfloat16 if cuda else torch.float32)
pool = PagedKVCache(cfg, (args.context + 65) // 16 + 4, 16, model.dtype, args.device)
pool.data.normal_()
verifier = TreeVerifier(model, pool, 1, 65, graphs=cuda)
if cuda:
    verifier.capture()
seq = pool.sequence(); seq.reserve(args.context); seq.keep(list(range(args.context)))
rng = random.Random(0)
sync = torch.cuda.synchronize if cuda else (lambda: None)
result = {"shape": args.shape, "context": args.context, "sizes": {}}
for size in (1, 65):
    tree = chain_or_tree(size, rng, cfg.vocab_size)
    call = lambda: verifier.verify([seq], [tree.tokens], [torch.tensor(tree.depths()) + args.context],
                                   [tree.ancestor_mask()])
    for _ in range(5):
        call()
    sync()
    wall = []
    for _ in range(30):
        sync(); t0 = time.perf_counter(); call(); sync(); wall.append((time.perf_counter() - t0) * 1000)
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.calls):
            call()
        sync()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        us = (event.self_device_time_total if cuda else event.self_cpu_time_total) / args.calls
        if us > 0:
            kernels[event.key][0] += us; kernels[event.key][1] += event.count / args.calls
    total = sum(v[0] for v in kernels.values())
    print(f"size {size}: verify call median {statistics.median(wall):.3f} ms; profiled kernel time {total/1000:.3f} ms "
          f"per call", flush=True)
    result["sizes"][size] = {"verify_ms": round(statistics.median(wall), 4), "kernel_ms": round(total / 1000, 4),
                             "kernels": {k: [round(v[0], 2), v[1]] for k, v in kernels.items()}}
one, many = result["sizes"][1]["kernels"], result["sizes"][65]["kernels"]
rows = sorted(set(one) | set(many), key=lambda k: -(many.get(k, [0])[0] - one.get(k, [0])[0]))
print(f"{'kernel':90s} {'us@1':>9s} {'us@65':>9s} {'delta':>9s} {'calls':>6s}")
for k in rows[:40]:
    a, b = one.get(k, [0, 0]), many.get(k, [0, 0])
    print(f"{k[:90]:90s} {a[0]:9.1f} {b[0]:9.1f} {b[0]-a[0]:9.1f} {b[1]:6.0f}")
json.dump(result, open(args.out, "w"), indent=1)
