"""The script behind 2026-11-30-cpu-commit-round-64.log (python <this file>, from the repository root):
Host time of commit_round (the round's picks and commits) for 64 requests, tiny random qwen3 on the CPU."""
import statistics, sys, tempfile, time
sys.path.insert(0, "tests")
import torch
import tiny_models
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.verifier.engine import Generation, commit_round, forward_batch
from treeserve.verifier.graphs import build_verifier

torch.set_num_threads(1)
target = load_target(str(tiny_models.write_hf_folder("qwen3", tempfile.mkdtemp() + "/m", seed=0)))
for temperature in (0.0, 0.7):
    verifier = build_verifier(target.model, 64, kv_cache_tokens=64 * 400)
    params = GenerationParams(max_new_tokens=200, temperature=temperature, ignore_eos=True)
    gens = [Generation(target.model, target.tokenizer, [1 + i % 50, 2, 3], params, verifier=verifier)
            for i in range(64)]
    times = []
    for round_ in range(60):
        plans = [g.plan(None) for g in gens]
        logits, features = forward_batch(target.model, plans, (), verifier)
        started = time.perf_counter()
        commit_round(gens, plans, logits, features)
        if round_ >= 10:  # after the prefill and a few rounds
            times.append(time.perf_counter() - started)
    print(f"temperature {temperature}: commit_round of 64 requests, median {statistics.median(times) * 1000:.2f} ms")
