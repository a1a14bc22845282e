#!/usr/bin/env bash
# One H200, the measurements the 2026-12-01 changes wait for, in order of need, each writing OUT/<step>.done when
# it ends (so a run cut short still says what finished). About 20 minutes in all.
#   1. prefill-wait: the n-gram stack, code, greedy, 16 and 64 requests, two turns, with --prefill-wait-rounds 0,
#      2 and 4 (rounds_with_prompts, tok/s and TTFT of both modes), about 5 min;
#   2. greedy: every drafter, greedy, two turns, at HEAD (MARGIN, give-up after 1 s, slots), about 6 min;
#   3. sampled: every drafter at temperature 0.7, two turns, about 6 min;
#   4. bf16: the n-gram stack in bfloat16, greedy, two turns (trees cost a tenth in bfloat16 GEMMs; outputs may
#      part from plain decoding at near-ties), about 2 min.
#   bash docs/logs/2026-12-01-h200-next-measurements.sh OUT   (from the repository root; treeserve on the PATH)
# Ran at 0b5fde5; --prefill-wait-rounds, which step 1 varies, was removed after it (docs/benchmarks.md).
set -u
OUT=$1; mkdir -p "$OUT"
stacks() { python3 -m treeserve.gateway.bench_stacks --device cuda "$@"; }
for wait in 0 2 4; do
  stacks --dtype float32 --drafters ngram --workloads code --temperatures 0 --concurrency 16,64 --repeats 2 \
    --prefill-wait-rounds $wait --out-dir "$OUT/prefill-wait-$wait" > "$OUT/prefill-wait-$wait.log" 2>&1
done
touch "$OUT/prefill-wait.done"
stacks --dtype float32 --temperatures 0 --repeats 2 --out-dir "$OUT/greedy" > "$OUT/greedy.log" 2>&1
touch "$OUT/greedy.done"
stacks --dtype float32 --temperatures 0.7 --repeats 2 --out-dir "$OUT/sampled" > "$OUT/sampled.log" 2>&1
touch "$OUT/sampled.done"
stacks --dtype bfloat16 --drafters ngram --temperatures 0 --repeats 2 --out-dir "$OUT/bf16" > "$OUT/bf16.log" 2>&1
touch "$OUT/bf16.done"
