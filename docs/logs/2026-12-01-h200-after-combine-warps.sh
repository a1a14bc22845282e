#!/usr/bin/env bash
# One H200: what the changes of 8e23d12 and 06bc3eb (the combine kernel's warps by its work; a lone request of a
# drafter without features never given up; near_ties at 2^-5) wait for, in order of need, each step writing
# OUT/<step>.done when it ends. About 20 minutes in all; the later steps can wait for another session.
#   1. ratio: the 64-node over 1-node ratio on the 8B shape, three more processes (issue 5's bound, 1.2), then the
#      kernel table at 1 and 65 rows at this code, then the split-count variants at 65 rows, 5 min;
#   2. greedy: every drafter, float32, greedy, two turns (the tables at HEAD), 7 min;
#   3. sampled: the same at temperature 0.7 (last measured at 0b5fde5), 7 min.
#   bash docs/logs/2026-12-01-h200-after-combine-warps.sh OUT   (from the repository root; treeserve on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
for i in 1 2 3; do
  python3 docs/logs/2026-11-30-h200-verify-ratio-64-nodes.py --out "$OUT/interleaved-$i.json" > "$OUT/interleaved-$i.log" 2>&1
done
python3 docs/logs/2026-11-30-h200-kernels-1-vs-65-rows.py --out "$OUT/kernels-1-vs-65-rows.json" > "$OUT/kernels.log" 2>&1
python3 docs/logs/2026-12-01-h200-tree-splits-variants.py --out "$OUT/tree-splits-variants.json" > "$OUT/splits.log" 2>&1
touch "$OUT/ratio.done"
stacks() { python3 -m treeserve.gateway.bench_stacks --device cuda "$@"; }
stacks --dtype float32 --temperatures 0 --repeats 2 --out-dir "$OUT/greedy" > "$OUT/greedy.log" 2>&1
touch "$OUT/greedy.done"
stacks --dtype float32 --temperatures 0.7 --repeats 2 --out-dir "$OUT/sampled" > "$OUT/sampled.log" 2>&1
touch "$OUT/sampled.done"
