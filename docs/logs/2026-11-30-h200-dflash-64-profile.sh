#!/usr/bin/env bash
# One H200 (at 410769a): the n-gram stack's serving tables (code and chat, greedy and 0.7), then the DFlash chain
# stack at 64 requests on the code prompts: unprofiled plain and speculative runs, py-spy --gil profiles of the
# verifier for a plain and a speculative run, and an --idle profile of a speculative one.
#   bash docs/logs/2026-11-30-h200-dflash-64-profile.sh OUT   (from the repository root; py-spy on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
python -m treeserve.gateway.bench_stacks --device cuda --dtype float32 --drafters ngram --out-dir "$OUT/serving-tables" \
  > "$OUT/bench_stacks.log" 2>&1
RT=$OUT/rt; mkdir -p "$RT"
treeserve up --device cuda --dtype float32 --runtime-dir "$RT" --start-timeout-s 300 --speculation adaptive \
  --verifier-metrics 127.0.0.1:9464 --drafter dflash --tree chain > "$OUT/up-dflash.log" 2>&1 &
UP=$!
for i in $(seq 1 300); do grep -q "^gateway: " "$OUT/up-dflash.log" && break; sleep 1; done
GW=$(grep "^gateway: " "$OUT/up-dflash.log" | head -1 | cut -d' ' -f2)
VPID=$(pgrep -f "treeserve.verifier --listen unix://$RT" | head -1)
d() { python docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-code.jsonl "$@"; }
d plain 64 64 16 0 "$OUT/warm.jsonl"; d spec 64 64 16 0 "$OUT/warm.jsonl"
for mode in plain spec plain spec; do d $mode 64 192 128 0 "$OUT/runs-dflash.jsonl"; done
for mode in plain spec; do
  py-spy record -p "$VPID" -r 1000 --gil -f raw -o "$OUT/dflash-gil-$mode-64.txt" --nonblocking -d 600 &
  SPY=$!; sleep 0.5
  d $mode 64 192 128 0 "$OUT/profiled-dflash.jsonl"
  kill -INT $SPY; wait $SPY
done
py-spy record -p "$VPID" -r 1000 --idle -f raw -o "$OUT/dflash-idle-spec-64.txt" --nonblocking -d 600 &
SPY=$!; sleep 0.5
d spec 64 192 128 0 "$OUT/profiled-dflash.jsonl"
kill -INT $SPY; wait $SPY
kill -INT $UP; wait $UP
