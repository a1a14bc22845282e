"""Load in one mode only (plain or speculative), for A/B runs on one stack: a closed loop of CONCURRENCY requests
through the gateway (the held-out chat prompts, greedy, EOS ignored), after a short warm-up; prints one JSON line
with tok/s and the verifier's round phases over the run (from its metrics, which must be on 127.0.0.1:9464).
From the repository root: python docs/logs/2026-12-01-cpu-one-mode-load.py ADDRESS plain|spec CONCURRENCY
REQUESTS MAX_NEW_TOKENS"""
import asyncio, dataclasses, json, sys
from pathlib import Path
from treeserve.drafter.corpus import read_prompts
from treeserve.gateway.bench import Progress, build_requests, run_level, summarize
from treeserve.params import GenerationParams
from treeserve.telemetry import round_phase_means, round_totals

address, mode = sys.argv[1], sys.argv[2]
concurrency, count, max_new_tokens = map(int, sys.argv[3:6])
prompts = read_prompts(Path("docs/prompts/held-out-chat.jsonl"))
params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
speculative = mode == "spec"
budget = 16 if speculative else 0
warm_up = build_requests(prompts, concurrency, dataclasses.replace(params, max_new_tokens=16), speculative, budget)
asyncio.run(run_level(address, warm_up, concurrency, 600, Progress("warm-up", len(warm_up), False)))
requests = build_requests(prompts, count, params, speculative, budget)
before = round_totals("127.0.0.1:9464")
results, started, wall, saturated = asyncio.run(run_level(address, requests, concurrency, 600,
                                                          Progress(mode, count, False)))
after = round_totals("127.0.0.1:9464")
row = summarize(results, started, wall, saturated)
print(json.dumps({"mode": mode, "tokens_per_s": row["tokens_per_s"], "tokens_per_round": row["tokens_per_round"],
                  "round_ms": round_phase_means(before, after), "errors": row["errors"]}))
