"""Issue 5's in-process experiments (2026-12-01-h200-combine-variants.py, -tree-splits-variants.py and
-few-rows-linear.py import this): one model of the 8B shape (random bfloat16 weights on the GPU, batch 1, CUDA
graphs, context 1024), a TreeVerifier captured per variant with the variant's patches installed (a module's
`tree_attention`, a class's `forward`: what the model looks up when its graphs are captured), then ten
alternations of 60 calls each of (variant x 1 node, 65 nodes): medians and each variant's ratio of 65 nodes to 1,
as 2026-11-30-h200-verify-ratio-64-nodes.py measures it, and each variant's logits against the default's.
`device="cpu"` (with TRITON_INTERPRET=1, the "tiny" shape and a short context) checks a script without a GPU:
eager forwards through the Triton kernels."""
import json, random, statistics, time
import torch
from treeserve.models.paged_kv import PagedKVCache
from treeserve.verifier.graph_bench import SHAPES, random_model, chain_or_tree
from treeserve.verifier.graphs import TreeVerifier

TREE = 65  # nodes: a 64-node tree and its root


def measure(variants: dict, described: dict, command: str, out: str, shape: str = "llama3-8b",
            device: str = "cuda", context: int = 1024, calls: int = 60, alternations: int = 10) -> dict:
    """`variants`: name -> patches, {(module or class, attribute name): replacement} ({} for the default, which
    must be named "default"); `described`: what the JSON records of each. Prints each alternation and writes the
    JSON to `out`."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = SHAPES[shape]
    model = random_model(cfg, device, torch.bfloat16 if cuda else torch.float32)
    rng = random.Random(0)
    trees = {size: chain_or_tree(size, rng, cfg.vocab_size) for size in (1, TREE)}
    originals = {key: getattr(*key) for patches in variants.values() for key in patches}

    def install(patches):
        for (owner, attribute), value in {**originals, **patches}.items():
            setattr(owner, attribute, value)

    def step_of(verifier, patches, args):
        def step():  # eager forwards look the patched names up at each call; captured graphs hold them at capture
            install(patches)
            return verifier.verify(*args)
        return step

    steps = {}
    try:
        for name, patches in variants.items():
            install(patches)
            pool = PagedKVCache(cfg, (context + TREE) // 16 + 4, 16, model.dtype, device)
            pool.data.normal_(generator=torch.Generator(device).manual_seed(0))
            verifier = TreeVerifier(model, pool, 1, TREE, graphs=cuda, kernels=True)
            if cuda:
                verifier.capture()
            sequence = pool.sequence(); sequence.reserve(context); sequence.keep(list(range(context)))
            for size, tree in trees.items():
                args = ([sequence], [tree.tokens], [torch.tensor(tree.depths()) + context], [tree.ancestor_mask()])
                steps[name, size] = step_of(verifier, patches, args)
                for _ in range(10 if cuda else 1):
                    steps[name, size]()
        sync()
        with torch.inference_mode():
            logits = {key: step()[0][0].tensor().float().clone() for key, step in steps.items()}
        agreement = {f"{name}_{size}": {
            "same_argmax": bool(torch.equal(logits[name, size].argmax(-1), logits["default", size].argmax(-1))),
            "max_logit_difference": float((logits[name, size] - logits["default", size]).abs().max())}
            for name in variants for size in (1, TREE)}
        print("against default:", agreement, flush=True)
        rows = []
        for alternation in range(alternations):
            medians = {}
            for key, step in steps.items():
                times = []
                for _ in range(calls):
                    sync(); started = time.perf_counter(); step(); sync()
                    times.append((time.perf_counter() - started) * 1000)
                medians[key] = statistics.median(times)
            row = {f"{name}_{size}_ms": round(ms, 4) for (name, size), ms in medians.items()}
            row.update({f"ratio_{name}": round(medians[name, TREE] / medians[name, 1], 4) for name in variants})
            rows.append(row)
            print(row, flush=True)
    finally:
        install({})
    summary = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print("median:", summary, flush=True)
    result = {"command": command, "context": context, "calls": calls, "variants": described, "rows": rows,
              "median": summary, "against_default": agreement}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result
