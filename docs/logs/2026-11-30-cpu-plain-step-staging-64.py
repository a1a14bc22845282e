"""Host time of a 64-request plain round's plans and staging on the CPU machine (tiny random qwen3): 64 plain steps
planned (`Generation.plan(None)`) and staged into reused buffers (`stage_trees`), median of 300 rounds. From the
repository root: python docs/logs/2026-11-30-cpu-plain-step-staging-64.py"""
import statistics, sys, tempfile, time
sys.path.insert(0, "tests")
import torch
import tiny_models
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.models.graphs import padded_rows, stage_trees
from treeserve.verifier.engine import Generation, commit_round, forward_batch
from treeserve.verifier.graphs import build_verifier
torch.set_num_threads(1)
target = load_target(str(tiny_models.write_hf_folder("qwen3", tempfile.mkdtemp() + "/m", seed=0)))
verifier = build_verifier(target.model, 64, kv_cache_tokens=64 * 400)
params = GenerationParams(max_new_tokens=200, ignore_eos=True)
gens = [Generation(target.model, target.tokenizer, [1 + i % 50, 2, 3] * (1 + i % 7), params, verifier=verifier) for i in range(64)]
plans = [g.plan(None) for g in gens]
logits, features = forward_batch(target.model, plans, (), verifier)
commit_round(gens, plans, logits, features)
runner = verifier.runner
buffers = padded_rows(64, runner.max_rows, runner.table_width)
t_plan, t_stage = [], []
for r in range(300):
    a = time.perf_counter(); plans = [g.plan(None) for g in gens]
    b = time.perf_counter()
    stage_trees([p.cache for p in plans], [p.tokens for p in plans], [p.positions for p in plans],
                [p.mask for p in plans], 64, 1, runner.table_width, into=buffers)
    c = time.perf_counter()
    for g in gens:  # undo the reservation: nothing was committed
        g.cache._trim()
    t_plan.append(b - a); t_stage.append(c - b)
m = lambda x: f"{statistics.median(x) * 1e6:.0f} us"
print("64 plain steps: plan", m(t_plan), "stage", m(t_stage))
