"""The script behind 2026-11-30-h200-profile-rounds-and-8b-kernels.log, kept as it ran (the treeserve of commit
d8ad7a2 plus the uncommitted GPU-verifier work that became 07eaab6, before the RMSNorm and RoPE kernels), from
the repository root on the H200 with the staged SmolLM2 GGUF reachable as smollm2-135m: python3 <this file>."""
import json, statistics, sys, time
import torch
from treeserve.loading import load_target
from treeserve.drafter import load_drafter, shipped_dflash
from treeserve.verifier import engine
from treeserve.verifier.graphs import build_verifier, TreeVerifier
from treeserve.params import GenerationParams

timers = {}
def wrap(name, fn):
    def inner(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize(); timers[name] = timers.get(name, 0.0) + time.perf_counter() - t
        return r
    return inner

target = load_target("smollm2-135m", device="cuda", dtype="float32")
tok = target.tokenizer
prompts = [json.loads(l) for l in open("docs/prompts/held-out-code.jsonl")][:3]
params = GenerationParams(max_new_tokens=128)
forward, commit = engine.forward_batch, engine.commit_round
for name, kind, tree, budget in [("none", None, None, 0), ("ngram", "ngram", "ddtree", 16),
                                 ("dflash-chain", "dflash", "chain", 16), ("dflash-ddtree", "dflash", "ddtree", 32)]:
    drafter = load_drafter(kind, str(shipped_dflash("smollm2-135m")), tree, target=target, device="cuda",
                           dtype="float32") if kind else None
    verifier = build_verifier(target.model, 1, "on", kv_cache_tokens=8192, max_tree=budget + 1)
    verifier.capture(drafter.feature_layer_ids if drafter else ())
    for profiled in (False, True):
        timers.clear()
        if profiled:
            engine.forward_batch, engine.commit_round = wrap("forward", forward), wrap("commit", commit)
            if drafter:
                drafter.propose = wrap("propose", type(drafter).propose.__get__(drafter))
                drafter.extend = wrap("extend", type(drafter).extend.__get__(drafter))
        tokens = rounds = 0; elapsed = 0.0
        for p in prompts:
            ids = tok.encode_chat(p["prompt"])
            r = engine.generate(target.model, tok, ids, params, drafter, budget, verifier=verifier)
            tokens += len(r.token_ids); rounds += r.rounds; elapsed += r.elapsed_s
        engine.forward_batch, engine.commit_round = forward, commit
        per_round = {k: round(v / rounds * 1000, 3) for k, v in timers.items()}
        print(f"{name:14s} {'profiled' if profiled else 'plain   '} {tokens/elapsed:7.1f} tok/s "
              f"{tokens/rounds:.2f} tok/round {elapsed/rounds*1000:.2f} ms/round  phases ms/round: {per_round}",
              flush=True)

# The 8B shape: replay alone vs the whole verify call, and eager kernels at 1 and 65 rows.
from treeserve.verifier.graph_bench import random_model, SHAPES, chain_or_tree
from treeserve.models.paged_kv import PagedKVCache
import random
del target
torch.cuda.empty_cache()
model = random_model(SHAPES["llama3-8b"], "cuda", torch.bfloat16)
pool = PagedKVCache(model.config, 200, 16, torch.bfloat16, "cuda"); pool.data.normal_()
v = TreeVerifier(model, pool, 1, 65, graphs=True); v.capture()
e = TreeVerifier(model, pool, 1, 65)
seq = pool.sequence(); seq.reserve(1024); seq.keep(list(range(1024)))
rng = random.Random(0)
for size in (1, 65):
    t = chain_or_tree(size, rng, 128256)
    args = ([seq], [t.tokens], [torch.tensor(t.depths()) + 1024], [t.ancestor_mask()])
    for _ in range(5): v.verify(*args)
    g = v.graphs[v.bucket(1, size)].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(30):
        start.record(); g.replay(); end.record(); end.synchronize(); replay.append(start.elapsed_time(end))
    wall = []
    for _ in range(30):
        torch.cuda.synchronize(); t0 = time.perf_counter(); v.verify(*args); torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1000)
    print(f"8B tree {size}: replay {statistics.median(replay):.3f} ms, verify call {statistics.median(wall):.3f} ms",
          flush=True)
    for _ in range(3): e.verify(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        e.verify(*args); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
