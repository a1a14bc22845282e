#!/usr/bin/env bash
# The verifier's torch work on one thread, measured on the CPU machine (2 cores): a fresh stack (n-gram drafter,
# fixed budget 16), then plain, speculative, plain, speculative, plain runs of 16 requests in flight, and the
# verifier's thread count after each (a second OpenMP team shows as a new thread). Run it at a commit and at its
# parent to compare. From the repository root, with treeserve installed:
#   bash docs/logs/2026-12-01-cpu-one-compute-thread.sh tiny     (a tiny random qwen3; 120 requests of 128 tokens)
#   bash docs/logs/2026-12-01-cpu-one-compute-thread.sh smollm2  (SmolLM2-135M; 4 in flight, 12 requests of 64)
set -u
WORK=$(mktemp -d)
if [ "$1" = tiny ]; then
  PYTHONPATH=tests python -c "from pathlib import Path; from tiny_models import write_hf_folder; write_hf_folder('qwen3', Path('$WORK/tiny-qwen3'), seed=0)"
  TARGET=$WORK/tiny-qwen3; LOAD="16 120 128"; MODES="plain spec plain spec plain"
else
  TARGET=smollm2-135m; LOAD="4 12 64"; MODES="plain spec plain"
fi
treeserve up --target "$TARGET" --drafter ngram --device cpu --speculation fixed --budget 16 \
  --verifier-metrics 127.0.0.1:9464 --runtime-dir "$WORK/run" > "$WORK/up.log" 2>&1 &
UP=$!
for _ in $(seq 180); do grep -q "gateway:" "$WORK/up.log" 2>/dev/null && break; sleep 1; done
VERIFIER=$(pgrep -f "treeserve.verifier --listen unix://$WORK/run")
for mode in $MODES; do
  echo "$(python docs/logs/2026-12-01-cpu-one-mode-load.py "unix://$WORK/run/gateway.sock" $mode $LOAD | tail -1)" \
    "verifier threads: $(ls /proc/$VERIFIER/task | wc -l)"
done
kill -INT $UP; wait $UP
