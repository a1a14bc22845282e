"""The n-gram drafter's trees for 64 code-like contexts of 250 tokens at budget 16, on the CPU machine: the
one-pass suffix search (treeserve's) against the loop over suffix lengths it replaced (copied here), side by side
in one run. From the repository root: python docs/logs/2026-11-30-cpu-ngram-drafter-64.py"""
import random, time
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from treeserve.drafter.ngram import NgramDrafter


def loop_over_suffix_lengths(self, context, length):  # the search before 8781820
    tokens = np.asarray(context, dtype=np.int64)
    found, used_starts = [], set()
    for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)
        for start in np.flatnonzero((windows == tokens[-n:]).all(axis=1))[::-1] + n:
            if start not in used_starts:
                used_starts.add(start)
                found.append(tokens[start:start + length])
                if len(found) == self.max_continuations:
                    return found
    return found


class Before(NgramDrafter):
    continuations = loop_over_suffix_lengths


rng = random.Random(0)
contexts = []
for _ in range(64):  # stretches copied from a few earlier lines, between fresh tokens, as in code
    base, context = [rng.randrange(2000) for _ in range(60)], []
    while len(context) < 250:
        context += base[rng.randrange(50):][:rng.randrange(3, 10)] if rng.random() < 0.5 else [rng.randrange(2000)]
    contexts.append(context[:250])
for name, drafter in (("before", Before()), ("after", NgramDrafter())) * 2:
    started = time.perf_counter()
    for _ in range(100):
        trees = [drafter.tree(context, 16) for context in contexts]
    ms = (time.perf_counter() - started) / 100 * 1000
    print(f"{name}: {ms:.2f} ms for 64 trees ({ms / 64 * 1000:.0f} us each), {np.mean([t.size for t in trees]):.1f} "
          f"nodes on average", flush=True)
