"""Host time of FeatureBacklog.add per round, transfers included, where 4 of a forward's 64 rows are kept (the
canaries of a 64-request batch), on this machine's CPU. WIDTH 8 leaves mostly the Python and dispatch work; 1728
is SmolLM2's three feature layers, where on the CPU the copy itself counts (on a GPU it runs on the device).
    python docs/logs/2026-12-01-cpu-feature-backlog-add.py WIDTH   (run at each revision to compare)"""

import sys
import time
from types import SimpleNamespace

import torch

from treeserve.verifier.engine import FeatureBacklog
from treeserve.verifier.rows import Rows

width = int(sys.argv[1])
output = torch.randn(64, width)
kept = [SimpleNamespace(last_features=Rows(output, range(row, row + 1)), feature_chunks=[]) for row in (3, 17, 40, 61)]
backlog = FeatureBacklog()
for _ in range(64):  # warm-up
    backlog.add(kept)
started = time.perf_counter()
for _ in range(3200):
    backlog.add(kept)
print(f"width {width}: {(time.perf_counter() - started) / 3200 * 1e6:.1f} us a round")
