#!/usr/bin/env bash
# One H200: the chat template compiled once (the tokenizer now) against compiled per request (OLD_TOKENIZER: the
# tokenizer.py of 0b5fde5), the bfloat16 n-gram stack with adaptive speculation, chat prompts, greedy, closed loops
# of 64 requests (256 of 128 new tokens), plain then speculative, each stack twice in turn (old, new, old, new).
#   bash docs/logs/2026-12-01-h200-chat-template-ab.sh OLD_TOKENIZER OUT   (from the repository root, the package
#   importable from the folder SRC holding treeserve/: set SRC)
set -u
OLD=$1; OUT=$2; mkdir -p "$OUT"
rm -rf "$OUT/src-old" && cp -r "$SRC" "$OUT/src-old" && cp "$OLD" "$OUT/src-old/treeserve/tokenizer.py"
run() {  # label source
  RT=$OUT/rt-$1; rm -rf "$RT"; mkdir -p "$RT"
  PYTHONPATH=$2:${PYTHONPATH#*:} treeserve up --device cuda --dtype bfloat16 --runtime-dir "$RT" --start-timeout-s 300 \
    --speculation adaptive --verifier-metrics 127.0.0.1:9464 --drafter ngram > "$OUT/up-$1.log" 2>&1 &
  UP=$!
  for i in $(seq 1 300); do grep -q "^gateway: " "$OUT/up-$1.log" && break; sleep 1; done
  GW=$(grep "^gateway: " "$OUT/up-$1.log" | head -1 | cut -d' ' -f2)
  d() { python3 docs/logs/2026-11-30-h200-closed-loop-drive.py "$GW" 127.0.0.1:9464 docs/prompts/held-out-chat.jsonl "$@"; }
  d plain 64 64 16 0 /dev/null > /dev/null 2>&1; d spec 64 64 16 0 /dev/null > /dev/null 2>&1
  for mode in plain spec; do d $mode 64 256 128 0 "$OUT/$1.jsonl" > /dev/null; done
  kill -INT $UP; wait $UP
}
for turn in 1 2; do run old "$OUT/src-old"; run new "$SRC"; done
touch "$OUT/done"
