#!/usr/bin/env bash
# One H200: the n-gram stack in bfloat16, greedy, every concurrency, two turns; then every divergence the bench
# recorded (greedy outputs that part from the first plain run's) checked to be a near-tie of SmolLM2 alone, in
# bfloat16 on the GPU. About 3 minutes.
#   bash docs/logs/2026-12-01-h200-bf16-near-ties.sh OUT   (from the repository root; treeserve on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
python3 -m treeserve.gateway.bench_stacks --device cuda --dtype bfloat16 --drafters ngram --temperatures 0 \
  --repeats 2 --out-dir "$OUT/bf16" > "$OUT/bf16.log" 2>&1
python3 -m treeserve.verifier.near_ties "$OUT"/bf16/ngram-*-t0.json --device cuda --dtype bfloat16 \
  --out "$OUT/near-ties.json" > "$OUT/near-ties.log" 2>&1
echo "near_ties exit $?" >> "$OUT/near-ties.log"
touch "$OUT/done"
