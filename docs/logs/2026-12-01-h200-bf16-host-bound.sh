#!/usr/bin/env bash
# One H200: is the bfloat16 n-gram stack at 64 requests held back by its host processes? In bfloat16 the verifier's
# batches ran 24-46 requests full at a concurrency of 64 (the 2026-12-01 tables). The n-gram stack with adaptive
# speculation, chat prompts, greedy, closed loops of 64 requests (256 of 128 new tokens), plain and speculative
# twice each: tok/s, the verifier's running and waiting gauges (closed-loop-drive), and the CPU seconds each
# process spent (gateway, verifier, drafter from /proc; the client from bash's `time`). Then py-spy profiles
# (active samples only) of the gateway and the verifier during one more plain run.
#   bash docs/logs/2026-12-01-h200-bf16-host-bound.sh OUT   (from the repository root; treeserve and py-spy on the PATH)
set -u
OUT=$1; mkdir -p "$OUT"
RT=$OUT/rt; mkdir -p "$RT"
treeserve up --device cuda --dtype bfloat16 --runtime-dir "$RT" --start-timeout-s 300 --speculation adaptive \
  --verifier-metrics 127.0.0.1:9464 --drafter ngram > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 300); do grep -q "^gateway: " "$OUT/up.log" && break; sleep 1; done
GW=$(grep "^gateway: " "$OUT/up.log" | head -1 | cut -d' ' -f2)
pid() { pgrep -f "treeserve.$1 --listen unix://$RT" | head -1; }
HZ=$(getconf CLK_TCK)
cpu() { for name in gateway verifier drafter; do awk -v n=$name -v hz=$HZ '{printf "%s=%.2f ", n, ($14 + $15) / hz}' /proc/$(pid $name)/stat; done; }
d() { python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-chat.jsonl "$@"; }
d plain 64 64 16 0 "$OUT/warm.jsonl"; d spec 64 64 16 0 "$OUT/warm.jsonl"
TIMEFORMAT='client_wall=%R client_cpu_user=%U client_cpu_sys=%S'
for mode in plain spec plain spec; do
  before=$(cpu)
  client=$( { time d $mode 64 256 128 0 "$OUT/runs.jsonl" > /dev/null 2>&1 ; } 2>&1 )
  echo "$mode before: $before after: $(cpu) $client" | tee -a "$OUT/cpu.txt"
done
for name in gateway verifier; do
  py-spy record -p "$(pid $name)" -r 500 -f raw -o "$OUT/active-$name-plain-64.txt" --nonblocking -d 600 > /dev/null 2>&1 &
done
sleep 0.5
d plain 64 256 128 0 "$OUT/profiled.jsonl"
pkill -INT -f "py-spy record" ; sleep 2
kill -INT $UP; wait $UP
touch "$OUT/done"
