#!/usr/bin/env bash
# One H200 (at 5352efe, and again after the fix that followed): the DFlash chain stack on the chat prompts, greedy, 64 requests in closed loops of 192 (the
# cell that lost most in run 7): an unprofiled plain and speculative run, then py-spy --idle profiles of the
# verifier in a plain and in a speculative run, to see where the speculative run's plain rounds spend the time that
# plain decoding's do not. WORKLOAD (default chat; code at f642fd5) picks docs/prompts/held-out-WORKLOAD.jsonl.
#   bash docs/logs/2026-12-01-h200-dflash-chat-64-profile.sh OUT [WORKLOAD]   (from the repository root; py-spy on
#   the PATH)
set -u
OUT=$1; WORKLOAD=${2:-chat}; mkdir -p "$OUT"
RT=$OUT/rt; mkdir -p "$RT"
treeserve up --device cuda --dtype float32 --runtime-dir "$RT" --start-timeout-s 300 --speculation adaptive \
  --verifier-metrics 127.0.0.1:9464 --drafter dflash --tree chain > "$OUT/up-dflash.log" 2>&1 &
UP=$!
for i in $(seq 1 300); do grep -q "^gateway: " "$OUT/up-dflash.log" && break; sleep 1; done
GW=$(grep "^gateway: " "$OUT/up-dflash.log" | head -1 | cut -d' ' -f2)
VPID=$(pgrep -f "treeserve.verifier --listen unix://$RT" | head -1)
d() { python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-$WORKLOAD.jsonl "$@"; }
d plain 64 64 16 0 "$OUT/warm.jsonl"; d spec 64 64 16 0 "$OUT/warm.jsonl"
for mode in plain spec; do d $mode 64 192 128 0 "$OUT/runs-dflash.jsonl"; done
for mode in plain spec; do
  py-spy record -p "$VPID" -r 1000 --idle -f raw -o "$OUT/dflash-idle-$mode-64.txt" --nonblocking -d 600 &
  SPY=$!; sleep 0.5
  d $mode 64 192 128 0 "$OUT/profiled-dflash.jsonl"
  kill -INT $SPY; wait $SPY
done
kill -INT $UP; wait $UP
