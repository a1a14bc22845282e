#!/usr/bin/env bash
# One H200: does freezing startup's objects (serving.freeze_startup_objects) take the full collections out of a
# serving run? The DFlash chain stack, chat prompts, greedy, 64 requests in closed loops of 192 (the cell that lost
# most in run 7), in two arms: gc.freeze() undone (GC_FREEZE_OFF=1), then as shipped; each arm plain, speculative,
# plain, speculative. Every process logs its collector's totals (docs/logs/2026-12-01-gc-stats/sitecustomize.py);
# each run's start and end go to OUT/<arm>/times.
#   bash docs/logs/2026-12-01-h200-gc-freeze-ab.sh OUT   (from the repository root)
set -u
OUT=$1
export PYTHONPATH=$PWD/docs/logs/2026-12-01-gc-stats${PYTHONPATH:+:$PYTHONPATH}
for arm in unfrozen frozen; do
  A=$OUT/$arm; mkdir -p $A/rt $A/gc
  export GC_STATS_DIR=$A/gc GC_FREEZE_OFF=$([ $arm = unfrozen ] && echo 1 || echo 0)
  treeserve up --device cuda --dtype float32 --runtime-dir $A/rt --start-timeout-s 300 --speculation adaptive \
    --verifier-metrics 127.0.0.1:9464 --drafter dflash --tree chain > $A/up.log 2>&1 &
  UP=$!
  for i in $(seq 1 300); do grep -q "^gateway: " $A/up.log && break; sleep 1; done
  GW=$(grep "^gateway: " $A/up.log | head -1 | cut -d' ' -f2)
  d() { python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-chat.jsonl "$@"; }
  d plain 64 64 16 0 $A/warm.jsonl; d spec 64 64 16 0 $A/warm.jsonl
  for mode in plain spec plain spec; do
    echo "$mode start $(date +%s.%N)" >> $A/times
    d $mode 64 192 128 0 $A/runs.jsonl
    echo "$mode end $(date +%s.%N)" >> $A/times
  done
  kill -INT $UP; wait $UP
done
