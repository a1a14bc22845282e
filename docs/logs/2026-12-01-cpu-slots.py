"""Host time of `PagedSequence.slots` for a 2,000-token context (125 blocks of 16): positions within one block (a
tree, an accepted path) and across blocks, against the way before 90d07b2 (a NumPy table of the whole block list
every call), which this script keeps as `whole_table`. Microseconds a call, best of five timings.

    PYTHONPATH=tests python docs/logs/2026-12-01-cpu-slots.py   (from the repository root, after make setup-test)"""

import timeit

import numpy as np
import torch

from random_targets import tiny_config
from treeserve.models.paged_kv import PagedKVCache

pool = PagedKVCache(tiny_config("qwen3"), num_blocks=2048, block_size=16, dtype=torch.float32, device="cpu")
sequence = pool.sequence()
sequence.blocks = list(range(1000, 1125))


def whole_table(start: int, count: int) -> torch.Tensor:
    positions = np.arange(start, start + count)
    table = np.asarray(sequence.blocks, dtype=np.int64)
    return torch.from_numpy(table[positions // 16] * 16 + positions % 16)


for start, count in [(1990, 5), (1980, 17), (0, 1990)]:
    assert torch.equal(whole_table(start, count), sequence.slots(start, count))
    before, now = (min(timeit.repeat(lambda: f(start, count), number=20000, repeat=5)) / 20000 * 1e6
                   for f in (whole_table, sequence.slots))
    print(f"positions {start}..{start + count - 1}: {before:.2f} us before, {now:.2f} us now")
