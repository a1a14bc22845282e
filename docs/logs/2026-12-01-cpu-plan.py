"""Host time of planning one request's round of a 5-node tree (`Generation.plan`) and of its ancestor mask, on a
paged verifier with a tiny model: the mask worked out per tree as before c82d1bb (kept here as `mask_per_tree`), and
now (one per tree shape, shared). Microseconds a call, best of three timings.

    PYTHONPATH=tests python docs/logs/2026-12-01-cpu-plan.py   (from the repository root, after make setup-test)"""

import timeit

import numpy as np
import torch

from random_targets import random_target, word_tokenizer
from treeserve.params import GenerationParams
from treeserve.tree import DraftTree
from treeserve.verifier import Generation
from treeserve.verifier.graphs import build_verifier


def mask_per_tree(tree: DraftTree) -> torch.Tensor:
    mask = np.eye(tree.size, dtype=bool)
    for i in range(1, tree.size):
        mask[i] |= mask[tree.parents[i]]
    return torch.from_numpy(mask).to("cpu")


def best_us(call) -> float:
    return min(timeit.repeat(call, number=20000, repeat=3)) / 20000 * 1e6


model = random_target("llama", seed=1, vocab_size=64)
generation = Generation(model, word_tokenizer(64), [1, 2, 3, 4, 5], GenerationParams(max_new_tokens=100), None, 16,
                        verifier=build_verifier(model, 8, False, 0, block_size=16))
generation.step()  # the prefill
tree = DraftTree([generation.output_ids[-1], 5, 6, 7, 8], [-1, 0, 1, 1, 2])
assert torch.equal(mask_per_tree(tree), tree.ancestor_mask())
print(f"ancestor mask: {best_us(lambda: mask_per_tree(tree)):.2f} us per tree before, "
      f"{best_us(tree.ancestor_mask):.2f} us now")
print(f"Generation.plan: {best_us(lambda: generation.plan(tree)):.2f} us now")
