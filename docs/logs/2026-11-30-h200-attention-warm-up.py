"""Does the verifier's prefill warm-up leave anything to compile? A SmolLM2-shaped model (random float32 weights),
a fresh Triton cache: cache files after the graphs' capture, after TreeVerifier.warm_up_prefill, then after
prefills of every prompt length 1-320 alone and of 200 packed batches (2-8 prompts of random lengths up to 900).
From the repository root on a GPU host, treeserve importable:
python3 docs/logs/2026-11-30-h200-attention-warm-up.py"""
import os, pathlib, random, sys, tempfile, time
cache = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = cache
import torch
from treeserve.models.paged_kv import PagedAttention
from treeserve.verifier.graph_bench import SHAPES, random_model
from treeserve.verifier.graphs import build_verifier

files = lambda: sum(1 for path in pathlib.Path(cache).rglob("*") if path.is_file())
model = random_model(SHAPES["smollm2-135m"], "cuda", torch.float32)
verifier = build_verifier(model, 4, graphs=True, kv_cache_tokens=65536, max_tree=17)
started = time.perf_counter(); verifier.capture()
print(f"capture {time.perf_counter() - started:.1f} s, cache files {files()}", flush=True)
print(f"warm-up {verifier.warm_up_prefill():.1f} s, cache files {files()}", flush=True)

def prefill(counts):
    sequences = [verifier.pool.sequence() for _ in counts]
    try:
        attention = PagedAttention.for_prompts(sequences, list(counts), True)
        last = torch.tensor(list(__import__("itertools").accumulate(counts))) - 1
        verifier.prefill(attention, torch.zeros(sum(counts), dtype=torch.long),
                         torch.cat([torch.arange(c) for c in counts]), last)
        torch.cuda.synchronize()
    finally:
        for s in sequences:
            s.release()

rng = random.Random(0)
shapes = [(n,) for n in range(1, 321)] + [tuple(rng.randrange(1, 900) for _ in range(rng.randrange(2, 9))) for _ in range(200)]
before, grew = files(), []
started = time.perf_counter()
for counts in shapes:
    n = files()
    prefill(counts)
    if files() != n:
        grew.append((counts, files() - n))
print(f"{len(shapes)} prefills in {time.perf_counter() - started:.1f} s; cache files {before} -> {files()}; "
      f"shapes that compiled: {grew[:20]}", flush=True)
