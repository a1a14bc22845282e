"""Issue 6: where a verification's time goes at TP=1 and TP=2 (8B shape, batch 1, graphs, 1024 context).
Per-kernel-category GPU time per call at 1 and 65 nodes, from profiled graph replays, and the call's wall time.
python3 proftp.py --tp N --out F.json"""
import argparse, collections, json, random, statistics, sys, time
import torch


def category(name):
    n = name.lower()
    for key, cat in (("nccl", "nccl"), ("all_reduce", "nccl"), ("allreduce", "nccl"), ("nvjet", "gemm"),
                     ("gemm", "gemm"), ("splitkreduce", "gemm"), ("cutlass", "gemm"), ("_tree_attention", "attention"),
                     ("_combine_splits", "combine"), ("rms_norm", "rms_norm"), ("silu", "silu_mul"),
                     ("_rope", "rope"), ("kv_write", "kv_write"), ("add", "add"), ("memcpy", "memcpy")):
        if key in n:
            return cat
    return "other"


def run(args):
    from treeserve import parallel
    from treeserve.models.paged_kv import PagedKVCache
    from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
    from treeserve.verifier.graphs import TreeVerifier
    cfg, rank = SHAPES["llama3-8b"], 0
    if args.tp > 1:
        shard = parallel.join("cuda"); rank, cfg = shard.rank, shard.config(cfg)
    model = random_model(cfg, "cuda", torch.bfloat16)
    if args.tp > 1:
        parallel.add_collectives(model, args.tp)
    pool = PagedKVCache(cfg, (1024 + 65) // 16 + 4, 16, model.dtype, "cuda")
    pool.data.normal_()
    verifier = TreeVerifier(model, pool, 1, 65, graphs=True)
    verifier.capture()
    seq = pool.sequence(); seq.reserve(1024); seq.keep(list(range(1024)))
    rng = random.Random(0)
    result = {"tp": args.tp, "sizes": {}}
    for size in (1, 65):
        tree = chain_or_tree(size, rng, cfg.vocab_size)  # a shard's vocabulary under --tp (random_model's embedding too)
        call = lambda: verifier.verify([seq], [tree.tokens], [torch.tensor(tree.depths()) + 1024], [tree.ancestor_mask()])
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        wall = []
        for _ in range(40):
            torch.cuda.synchronize(); t0 = time.perf_counter(); call(); torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1000)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        kernels = collections.defaultdict(lambda: [0.0, 0.0])
        for event in prof.key_averages():
            us = event.self_device_time_total / args.calls
            if us > 0:
                kernels[event.key][0] += us; kernels[event.key][1] += event.count / args.calls
        cats = collections.defaultdict(float)
        for k, (us, _) in kernels.items():
            cats[category(k)] += us
        result["sizes"][size] = {"verify_ms": round(statistics.median(wall), 4),
                                 "kernel_ms": round(sum(v[0] for v in kernels.values()) / 1000, 4),
                                 "categories_us": {k: round(v, 1) for k, v in sorted(cats.items())},
                                 "kernels": {k: [round(v[0], 2), v[1]] for k, v in kernels.items()}}
    if rank == 0:
        for size, r in result["sizes"].items():
            print(f"TP={args.tp} size {size}: wall {r['verify_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms; "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r["categories_us"].items()), flush=True)
        top = sorted(result["sizes"][65]["kernels"].items(), key=lambda kv: -kv[1][0])[:25]
        for k, (us, n) in top:
            print(f"   {us:8.1f} us {n:5.0f}x  {k[:100]}")
        json.dump(result, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1); p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    if args.tp == 1:
        sys.exit(run(args))
    from treeserve import parallel
    followers = parallel.start_followers(run, args, args.tp)
    try:
        sys.exit(run(args))
    finally:
        parallel.stop_followers(followers)
