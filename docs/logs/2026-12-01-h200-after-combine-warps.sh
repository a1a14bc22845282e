#!/usr/bin/env bash
# One H200: what the changes of 8e23d12 and 06bc3eb (the combine kernel's warps by its work; a lone request of a
# drafter without features never given up; near_ties at 2^-5) and the few-rows GEMM kernel wait for, in order of
# need, each step writing OUT/<step>.done when it ends. About 25 minutes in all; name the steps to run fewer.
#   1. ratio: the 64-node over 1-node ratio on the 8B shape, three more processes (issue 5's bound, 1.2), the
#      few-rows GEMM kernel against cuBLAS at 65 rows and its ratio, the split-count variants at 65 rows, the kernel
#      table at 1 and 65 rows at this code, the kernel tests on the GPU, 10 min (no SmolLM2 needed);
#   2. greedy: every drafter, float32, greedy, two turns (the tables at HEAD), 7 min;
#   3. sampled: the same at temperature 0.7 (last measured at 0b5fde5), 7 min.
#   bash docs/logs/2026-12-01-h200-after-combine-warps.sh OUT [ratio greedy sampled]
#   (from the repository root; treeserve on the PATH)
set -u
OUT=$1; shift
STEPS=${*:-ratio greedy sampled}
mkdir -p "$OUT"
LOGS=$(dirname "$0")
stacks() { python3 -m treeserve.gateway.bench_stacks --device cuda "$@"; }
for step in $STEPS; do
  case $step in
    ratio)
      for i in 1 2 3; do
        python3 "$LOGS/2026-11-30-h200-verify-ratio-64-nodes.py" --out "$OUT/interleaved-$i.json" > "$OUT/interleaved-$i.log" 2>&1
      done
      python3 "$LOGS/2026-12-01-h200-few-rows-linear.py" --out "$OUT/few-rows-linear.json" > "$OUT/few-rows-linear.log" 2>&1
      python3 "$LOGS/2026-12-01-h200-tree-splits-variants.py" --out "$OUT/tree-splits-variants.json" > "$OUT/splits.log" 2>&1
      python3 "$LOGS/2026-11-30-h200-kernels-1-vs-65-rows.py" --out "$OUT/kernels-1-vs-65-rows.json" > "$OUT/kernels.log" 2>&1
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/kernel-tests.log" 2>&1 ;;
    greedy) stacks --dtype float32 --temperatures 0 --repeats 2 --out-dir "$OUT/greedy" > "$OUT/greedy.log" 2>&1 ;;
    sampled) stacks --dtype float32 --temperatures 0.7 --repeats 2 --out-dir "$OUT/sampled" > "$OUT/sampled.log" 2>&1 ;;
    *) echo "unknown step $step (ratio, greedy, sampled)"; exit 2 ;;
  esac
  touch "$OUT/$step.done"
done
