#!/usr/bin/env bash
# CPU machine: where the gateway's time goes under 64 requests in flight. A plain stack on a tiny random model
# (tests/tiny_models.py's qwen3, so that the verifier's forward is cheap), chat prompts, closed loops of 64
# requests (512 of 64 tokens, EOS ignored); py-spy samples the gateway (active samples only) for 8 s of it.
#   bash docs/logs/2026-12-01-cpu-gateway-profile.sh OUT   (from the repository root, after make setup-test;
#   py-spy installed: pip install py-spy)
set -u
OUT=$1; mkdir -p "$OUT"; RT=$OUT/rt; mkdir -p "$RT"
python -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import write_hf_folder; \
from pathlib import Path; write_hf_folder('qwen3', Path('$OUT/tiny-qwen3'), seed=0)"
treeserve up --target "$OUT/tiny-qwen3" --drafter none --device cpu --runtime-dir "$RT" > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "^gateway: " "$OUT/up.log" && break; sleep 1; done
treeserve bench --address "unix://$RT/gateway.sock" --workload chat --concurrency 64 --requests 512 \
  --max-new-tokens 64 --ignore-eos --no-warmup --out "$OUT/bench.json" --quiet > "$OUT/bench.log" 2>&1 &
BENCH=$!
sleep 2
py-spy record -p "$(pgrep -f "treeserve.gateway --listen unix://$RT" | head -1)" --duration 8 --rate 200 \
  --format raw -o "$OUT/gateway.txt" --nonblocking > /dev/null 2>&1
wait $BENCH
kill -INT $UP; wait $UP
