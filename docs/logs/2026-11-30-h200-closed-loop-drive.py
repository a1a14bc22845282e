"""One closed-loop run of one mode against a running stack, appended to a JSONL file: tok/s, the verifier's round
phases, its mean batch, the budgets adaptive speculation chose, each request's time, and the verifier's running /
waiting gauges every 100 ms (how full its batches ran over time); since 410769a also each request's (prompt index,
tokens, rounds, round tokens) and the verifier's realized-over-expected drafted tokens per batch bucket.

    python docs/logs/2026-11-30-h200-closed-loop-drive.py GATEWAY METRICS PROMPTS plain|spec CONCURRENCY REQUESTS \
        MAX_NEW_TOKENS TEMPERATURE OUT.jsonl [BUDGET]

GATEWAY as `treeserve up` prints it, METRICS its --verifier-metrics address, PROMPTS a JSONL prompt file
(docs/prompts/held-out-code.jsonl). `spec` asks for BUDGET (default 16; adaptive speculation picks each round's)."""

import asyncio
import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

from treeserve.drafter.corpus import read_prompts
from treeserve.gateway.bench import Progress, build_requests, run_level
from treeserve.params import GenerationParams
from treeserve.telemetry import round_phase_means, round_totals, rounds_by_budget

address, metrics, prompts_path, mode, concurrency, count, tokens, temperature, out = sys.argv[1:10]
concurrency, count, tokens, temperature = int(concurrency), int(count), int(tokens), float(temperature)
budget = int(sys.argv[10]) if len(sys.argv) > 10 else 16
prompts = read_prompts(Path(prompts_path))
requests = build_requests(prompts, count,
                          GenerationParams(max_new_tokens=tokens, temperature=temperature), mode == "spec", budget)
gauges, stop = [], threading.Event()


def sample_gauges():
    while not stop.is_set():
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        running = re.search(r"^treeserve_verifier_running_requests (\S+)", text, re.M).group(1)
        waiting = re.search(r"^treeserve_verifier_waiting_requests (\S+)", text, re.M).group(1)
        gauges.append((round(time.perf_counter(), 3), float(running), float(waiting)))
        time.sleep(0.1)


before = round_totals(metrics)
sampler = threading.Thread(target=sample_gauges, daemon=True)
sampler.start()
results, started, wall, saturated = asyncio.run(run_level(address, requests, concurrency, 600,
                                                          Progress("run", count, False)))
stop.set()
sampler.join()
after = round_totals(metrics)
output_tokens = sum(r.tokens for r in results)
rounds = after.phases["round"][1] - before.phases["round"][1]
row = dict(mode=mode, concurrency=concurrency, requests=count, wall_s=round(wall, 3),
           tok_s=round(output_tokens / wall, 1), errors=sum(1 for r in results if r.error),
           verifier_rounds=int(rounds),
           mean_batch=round(sum(1 + r.rounds for r in results if r.error is None) / max(rounds, 1), 2),
           tokens_per_request_round=round(output_tokens / max(1, sum(r.rounds for r in results)), 3),
           round_ms=round_phase_means(before, after), budgets=rounds_by_budget(before, after),
           saturated_s=round(saturated, 3), started=round(started, 3),
           finished=[round(r.elapsed_s, 3) for r in results], gauges=gauges,
           per_request=[(i % len(prompts), r.tokens, r.rounds, r.round_tokens) for i, r in enumerate(results)])
text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
row["realized_over_expected"] = re.findall(r'^treeserve_verifier_realized_over_expected{batch="(\d+)"} (\S+)',
                                           text, re.M)
print(json.dumps({key: value for key, value in row.items() if key not in ("finished", "gauges")}))
with open(out, "a") as file:
    file.write(json.dumps(row) + "\n")
