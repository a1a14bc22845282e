"""The script behind 2026-11-30-h200-prefill-warm-up.log: does the verifier's prefill warm-up (5f89ee2) leave nothing to
compile for the first requests? SmolLM2-135M, float32, a fresh Triton cache: its files after the graphs' capture,
after TreeVerifier.warm_up_prefill, and after each of eight first requests (four code and four chat prompts of
the held-out sets, 32 new tokens each, plain decoding through the graphs). From the repository root on the H200,
with the SmolLM2 GGUF staged: python3 docs/logs/2026-11-30-h200-prefill-warm-up.py --device cuda"""
import json, os, pathlib, sys, tempfile, time
cache = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = cache  # before triton is imported
import torch
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.verifier import engine
from treeserve.verifier.graphs import build_verifier

device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
files = lambda: sum(1 for path in pathlib.Path(cache).rglob("*") if path.is_file())
target = load_target("smollm2-135m", device=device, dtype="float32")
verifier = build_verifier(target.model, 4, graphs=device == "cuda", kv_cache_tokens=65536, max_tree=17)
started = time.perf_counter()
if verifier.use_graphs:
    verifier.capture()
print(f"capture {time.perf_counter() - started:.1f} s, cache files {files()}", flush=True)
print(f"warm-up {verifier.warm_up_prefill():.1f} s, cache files {files()}", flush=True)
prompts = [json.loads(line) for name in ("code", "chat") for line in
           open(f"docs/prompts/held-out-{name}.jsonl").read().splitlines()[:4]]
for prompt in prompts:
    ids = target.tokenizer.encode_chat(prompt["prompt"]) if prompt.get("chat") else target.tokenizer.encode(prompt["prompt"])
    started = time.perf_counter()
    result = engine.generate(target.model, target.tokenizer, ids, GenerationParams(max_new_tokens=32), None, 0,
                             verifier=verifier)
    print(f"prompt {len(ids):4d} tokens: {len(result.token_ids)} new in {time.perf_counter() - started:.3f} s, "
          f"cache files {files()}", flush=True)
