#!/usr/bin/env bash
# Two versions of treeserve side by side on one GPU, interleaved (old, new, old, new): the n-gram stack with adaptive
# speculation, float32, closed loops of 64 and 16 requests, plain and speculative, code prompts, 128 new tokens.
#   bash docs/logs/2026-11-30-h200-side-by-side.sh OLD_SOURCE NEW_SOURCE OUT_DIR
# Each *_SOURCE is a folder holding the `treeserve` package (services/common laid out as treeserve/, with
# services/{verifier,drafter,gateway} and kernels/ inside it); run from the repository root of either version.
set -u
old=$1 new=$2 out=$3
mkdir -p "$out"
for version in old new old new; do
  source_dir=$old; [ $version = new ] && source_dir=$new
  runtime=$(mktemp -d)
  PYTHONPATH=$source_dir python3 -m treeserve up --device cuda --dtype float32 --runtime-dir "$runtime" \
    --speculation adaptive --verifier-metrics 127.0.0.1:9464 --drafter ngram > "$runtime/up.log" 2>&1 &
  up=$!
  for i in $(seq 1 300); do grep -q "^gateway: " "$runtime/up.log" && break; sleep 1; done
  gateway=$(grep "^gateway: " "$runtime/up.log" | head -1 | cut -d' ' -f2)
  drive() { PYTHONPATH=$source_dir python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$gateway" 127.0.0.1:9464 \
              docs/prompts/held-out-code.jsonl "$@"; }
  drive plain 64 64 16 0 "$out/warm.jsonl"; drive spec 64 64 16 0 "$out/warm.jsonl"  # untimed: kernels, graphs
  for run in "plain 64 192" "spec 64 192" "plain 16 64" "spec 16 64"; do
    set -- $run
    drive $1 $2 $3 128 0 "$out/side-by-side-$version.jsonl"
  done
  kill -INT $up; wait $up
done
