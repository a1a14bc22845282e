#!/usr/bin/env bash
# One H200 (at 7868e65), with little device time left: the GPU tests of the staging and feature-transfer changes,
# then two cells of the serving tables each (DFlash chain, code, greedy, at 1 and 64 requests; n-gram, code,
# temperature 0.7, at 4 and 64).
#   bash docs/logs/2026-11-30-h200-short-tables.sh OUT   (from the repository root)
set -u
OUT=$1; mkdir -p "$OUT"
python -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_engine.py \
  -k "pieces or kept_features or replay_equals_eager" > "$OUT/gpu-tests.log" 2>&1
python -m treeserve.gateway.bench_stacks --device cuda --dtype float32 --drafters dflash-chain --workloads code \
  --temperatures 0 --concurrency 1,64 --out-dir "$OUT/serving-tables" > "$OUT/bench_stacks.log" 2>&1
python -m treeserve.gateway.bench_stacks --device cuda --dtype float32 --drafters ngram --workloads code \
  --temperatures 0.7 --concurrency 4,64 --out-dir "$OUT/serving-tables-ngram" > "$OUT/bench_stacks_ngram.log" 2>&1
