#!/usr/bin/env bash
# How full the verifier's batches run, plain decoding against adaptive n-gram speculation, closed loop, on the
# CPU machine: the tiny random qwen3 model of the tests, the services' test prompts, concurrency 1 and 8, four
# waves, 48 new tokens, budget 8. From the repository root (after `make test`'s setup): bash <this file> OUT_DIR
set -e
out=${1:-occupancy}
mkdir -p "$out"
.venv/bin/python - "$out" <<'PY'
import json, sys
sys.path.insert(0, "tests")
import tiny_models
from test_services import PROMPTS
out = sys.argv[1]
tiny_models.write_hf_folder("qwen3", f"{out}/model", seed=0)
open(f"{out}/prompts.jsonl", "w").write("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
PY
.venv/bin/python -m treeserve.gateway.bench_stacks --out-dir "$out/tables" --target "$out/model" --drafters ngram \
  --prompts "$out/prompts.jsonl" --temperatures 0 --concurrency 1,8 --max-new-tokens 48 --budget 8 --metrics-port 19491
.venv/bin/python - "$out" <<'PY'
import json, sys
report = json.load(open(f"{sys.argv[1]}/tables/ngram-prompts-t0.json"))
for r in report["runs"]:
    # Request-rounds spent in the verifier's batches: each request's prefill round (its first token) plus its
    # decode rounds.
    request_rounds = r["completed"] + (r["output_tokens"] - r["completed"]) / r["tokens_per_round"]
    print(f"concurrency {r['concurrency']} {r['mode']:11s} {r['tokens_per_s']:7.1f} tok/s, {r['tokens_per_round']:.3f} "
          f"tokens a request-round, {r['verifier_rounds']} verifier rounds, mean batch "
          f"{request_rounds / r['verifier_rounds']:.2f}, speedup {r.get('speedup')} (saturated {r.get('saturated_speedup')})")
PY
