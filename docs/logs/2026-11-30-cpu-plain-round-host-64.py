"""The script behind 2026-11-30-cpu-plain-round-host-64.log (python <this file>, from the repository root): host
time of one plain round of 64 requests (tiny random qwen3, CPU), split into plan, forward_batch and commit_round."""
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
verifier = build_verifier(target.model, 64, kv_cache_tokens=64 * 400)
params = GenerationParams(max_new_tokens=200, ignore_eos=True)
gens = [Generation(target.model, target.tokenizer, [1 + i % 50, 2, 3], params, verifier=verifier) for i in range(64)]
t_plan, t_fwd, t_commit = [], [], []
for r in range(60):
    a = time.perf_counter(); plans = [g.plan(None) for g in gens]
    b = time.perf_counter(); logits, features = forward_batch(target.model, plans, (), verifier)
    c = time.perf_counter(); commit_round(gens, plans, logits, features); d = time.perf_counter()
    if r >= 10: t_plan.append(b - a); t_fwd.append(c - b); t_commit.append(d - c)
m = lambda x: f"{statistics.median(x) * 1000:.2f} ms"
print("plan", m(t_plan), "forward_batch", m(t_fwd), "commit", m(t_commit))
