"""Padding a reused staging buffer of a 64-request, 17-row forward (block tables 512 wide), on this host's CPU:
torch's in-place fills (as `TreeRows.pad_` made them) against NumPy fills of the views `stage_trees` makes anyway.
Microseconds per padding: back to back (median of 7 runs of 2,000), and after 5 idle ms each, as between a
server's rounds (median of 400). 3c9e03a padded through NumPy, f642fd5 went back to torch (the back-to-back
figures were close), and the change after 5645615 returned to NumPy (a profile found the fills dearer in a server).
    python docs/logs/2026-12-01-h200-pad-staging.py --out pad.json"""

import argparse
import json
import statistics
import time

import torch

from treeserve.models.graphs import padded_rows

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
staged = padded_rows(64, 17, 512, pin=torch.cuda.is_available())
tensors = [staged.tokens, staged.positions, staged.paged.tables, staged.paged.prefix_lens, staged.paged.new_counts,
           staged.paged.tree_mask]
arrays = [tensor.numpy() for tensor in tensors]
slots = staged.paged.slots.numpy()


def torch_fills():
    staged.paged.slots.fill_(-1)
    for tensor in tensors:
        tensor.zero_()


def numpy_fills():
    slots.fill(-1)
    for array in arrays:
        array.fill(0)


def back_to_back(fill) -> float:
    runs = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(2000):
            fill()
        runs.append((time.perf_counter() - started) / 2000 * 1e6)
    return statistics.median(runs)


def after_idle(fill) -> float:
    times = []
    for _ in range(400):
        time.sleep(0.005)
        started = time.perf_counter()
        fill()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


result = {"torch_threads": torch.get_num_threads(), "torch_fills_us": back_to_back(torch_fills),
          "numpy_fills_us": back_to_back(numpy_fills), "torch_fills_after_idle_us": after_idle(torch_fills),
          "numpy_fills_after_idle_us": after_idle(numpy_fills)}
print(result)
with open(args.out, "w") as out:
    json.dump(result, out)
