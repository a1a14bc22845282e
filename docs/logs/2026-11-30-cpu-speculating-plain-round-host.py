"""Host time of one plain round of one request, on the CPU machine: a request that does not speculate (plain
decoding) against one that could but is told plain by adaptive speculation (a DFlash-like drafter that does not
pay: its target features kept, the choice worked out, the costs observed). The forward is left out: one forward's
logits and features are committed every round. Tiny random qwen3; from the repository root:
python docs/logs/2026-11-30-cpu-speculating-plain-round-host.py"""
import statistics, sys, tempfile, time
sys.path.insert(0, "tests")
import torch
import tiny_models
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier.engine import FeatureBacklog, Generation, commit_round, forward_batch
from treeserve.verifier.graphs import build_verifier

torch.set_num_threads(1)
target = load_target(str(tiny_models.write_hf_folder("qwen3", tempfile.mkdtemp() + "/m", seed=0)))
verifier = build_verifier(target.model, 4, kv_cache_tokens=4 * 2000)
params = GenerationParams(max_new_tokens=240, ignore_eos=True)
layers = (0, 1)


def round_host_us(speculating: bool) -> float:
    generation = Generation(target.model, target.tokenizer, [1, 2, 3], params, None, 16 if speculating else 0,
                            layers if speculating else (), verifier=verifier)
    backlog, adaptive = FeatureBacklog(), None
    if speculating:
        adaptive = AdaptiveSpeculation()
        for _ in range(4):  # dear drafts, little accepted: the choice is plain
            for nodes in (1, 2, 3, 5, 9, 17):
                adaptive.observe_verify(1, nodes, 0.002 + 0.0001 * nodes)
                adaptive.observe_draft(1, nodes - 1, 0.005)
            adaptive.observe_acceptance("a", 16, 1)
        assert adaptive.choose({"a": 16}, 1) == 0
    for _ in range(2):  # the prefill, then one real forward whose outputs every timed round commits
        plans = [generation.plan(None)]
        logits, features = forward_batch(target.model, plans, layers, verifier)
        if generation.output_ids:
            break
        commit_round([generation], plans, logits, features, backlog)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        if adaptive is not None:
            adaptive.choose({"a": 16}, 1)
        plans = [generation.plan(None)]
        commit_round([generation], plans, logits, features, backlog)
        if adaptive is not None:
            adaptive.observe_verify(1, 1, 0.002)
        times.append(time.perf_counter() - started)
    generation.release()
    return statistics.median(times) * 1e6


for _ in range(3):
    print(f"plain request {round_host_us(False):.0f} us, speculating request told plain {round_host_us(True):.0f} us",
          flush=True)
