#!/usr/bin/env bash
# One H200: what the changes after 0b5fde5 wait for, in order of need, each writing OUT/<step>.done when it ends.
# About 13 minutes in all.
#   1. ngram: the n-gram stack, float32, greedy, every concurrency, two turns (a request's evidence ageing in
#      plain rounds; the replay says 1.33x at one request on code against 1.06 measured at 0b5fde5), 2.5 min;
#   2. near-ties: the n-gram stack in bfloat16, greedy, two turns, then every recorded divergence checked to be a
#      near-tie of the target alone (docs/logs/2026-12-01-h200-bf16-near-ties.sh), 3 min;
#   3. all: every drafter, float32, greedy, two turns, at HEAD (the DFlash stacks with the template fix and
#      ageing), 7 min.
#   bash docs/logs/2026-12-01-h200-next-session.sh OUT   (from the repository root; treeserve on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
stacks() { python3 -m treeserve.gateway.bench_stacks --device cuda "$@"; }
stacks --dtype float32 --drafters ngram --temperatures 0 --repeats 2 --out-dir "$OUT/ngram" > "$OUT/ngram.log" 2>&1
touch "$OUT/ngram.done"
bash docs/logs/2026-12-01-h200-bf16-near-ties.sh "$OUT/near-ties"
touch "$OUT/near-ties.done"
stacks --dtype float32 --temperatures 0 --repeats 2 --out-dir "$OUT/all" > "$OUT/all.log" 2>&1
touch "$OUT/all.done"
