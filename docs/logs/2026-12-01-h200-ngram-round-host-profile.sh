#!/usr/bin/env bash
# One H200: which host work a speculative n-gram round adds at 64 requests. The n-gram stack with fixed
# speculation, code prompts, greedy, 64 requests in closed loops of 192, speculative runs at budget 4 (what adaptive
# speculation picked there); an unprofiled plain and speculative run, then py-spy --idle profiles of the verifier
# in a plain and in a speculative run. Compare them with docs/logs/2026-12-01-profile-diff.py.
#   bash docs/logs/2026-12-01-h200-ngram-round-host-profile.sh OUT   (from the repository root; treeserve and py-spy
#   on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
RT=$OUT/rt; mkdir -p "$RT"
treeserve up --device cuda --dtype float32 --runtime-dir "$RT" --start-timeout-s 300 --speculation fixed \
  --verifier-metrics 127.0.0.1:9464 --drafter ngram > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 300); do grep -q "^gateway: " "$OUT/up.log" && break; sleep 1; done
GW=$(grep "^gateway: " "$OUT/up.log" | head -1 | cut -d' ' -f2)
VPID=$(pgrep -f "treeserve.verifier --listen unix://$RT" | head -1)
d() { python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-code.jsonl "$@"; }
d plain 64 64 16 0 "$OUT/warm.jsonl"; d spec 64 64 16 0 "$OUT/warm.jsonl" 4
for mode in plain spec; do d $mode 64 192 128 0 "$OUT/runs.jsonl" 4; done
for mode in plain spec; do
  py-spy record -p "$VPID" -r 1000 --idle -f raw -o "$OUT/idle-$mode-64.txt" --nonblocking -d 600 &
  SPY=$!; sleep 0.5
  d $mode 64 192 128 0 "$OUT/profiled.jsonl" 4
  kill -INT $SPY; wait $SPY
done
kill -INT $UP; wait $UP
