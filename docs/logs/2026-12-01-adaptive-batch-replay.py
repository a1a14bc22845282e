"""Adaptive speculation replayed at 1, 4, 16 and 64 requests on the n-gram drafter's real acceptance, with and
without its evidence ageing in plain rounds (AdaptiveSpeculation.PLAIN_AGING).

Each of B slots decodes requests one after another (closed loops; the trace's requests in turn, a slot starting at
its own offset); every round takes one budget for all, as the verifier's does, and costs the H200's float32 figures
at that batch; tokens a second count the rounds while all B are in flight (the n-gram code cells' adaptive_checked of a0d7659, 0eb6b8f and 0b5fde5: each budget's realized
round, less the drafter's round trip). Prompt rounds are left out. Three passes with the state kept; the ratios
are over plain decoding's tokens a second in the same replay. The trace comes from
docs/logs/2026-12-01-cpu-ngram-acceptance-trace.py.

    python docs/logs/2026-12-01-adaptive-batch-replay.py TRACE [AGING ...]
"""

import json
import sys

from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier.graphs import TREE_BUCKETS

# batch bucket -> (drafter round trip, verification by tree bucket (nodes)), ms
COSTS = {
    1: (0.72, {1: 1.83, 2: 2.75, 3: 2.75, 5: 2.82, 9: 2.97, 17: 3.10}),
    4: (1.0, {1: 2.33, 2: 3.25, 3: 3.3, 5: 3.3, 9: 4.1, 17: 4.8}),
    16: (1.5, {1: 3.62, 2: 5.1, 3: 5.3, 5: 5.6, 9: 6.1, 17: 6.6}),
    64: (3.9, {1: 7.35, 2: 9.5, 3: 10.0, 5: 12.0, 9: 14.6, 17: 16.0}),
}
REQUESTS_PER_SLOT = {1: 16, 4: 8, 16: 4, 64: 2}
BUDGET = 16
traces = json.load(open(sys.argv[1]))["traces"]
agings = [float(a) for a in sys.argv[2:]] or [0.0, AdaptiveSpeculation.PLAIN_AGING]


def bucket(nodes: int) -> int:
    return next(size for size in TREE_BUCKETS if size >= nodes)


def replay(batch: int, adaptive: AdaptiveSpeculation | None) -> tuple[float, int]:
    """Tokens a second and tree rounds; plain decoding when `adaptive` is None."""
    draft_ms, verify_ms = COSTS[batch]
    queues = [[(slot + k * batch) % len(traces) for k in range(REQUESTS_PER_SLOT[batch])] for slot in range(batch)]
    running, serial = [None] * batch, 0

    def start(slot):
        nonlocal serial
        serial += 1
        running[slot] = {"id": f"request-{serial}", "trace": traces[queues[slot].pop(0)], "done": 1} \
            if queues[slot] else None

    for slot in range(batch):
        start(slot)
    seconds, tokens, trees = 0.0, 0, 0
    while any(running):
        active = [slot for slot in range(batch) if running[slot]]
        budgets = {running[slot]["id"]: BUDGET for slot in active}
        chosen = adaptive.choose(budgets, len(active)) if adaptive else 0
        rows, largest = [], 1
        for slot in active:
            request = running[slot]
            accepted, drafted = request["trace"]["rounds"][request["done"] - 1][str(chosen)] if chosen else (0, 0)
            emitted = min(1 + accepted, request["trace"]["output_tokens"] - request["done"])
            rows.append((slot, request, drafted, emitted))
            largest = max(largest, drafted + 1)
        verify_s, draft_s = verify_ms[bucket(largest)] / 1e3, (draft_ms / 1e3 if chosen else 0.0)
        trees += chosen > 0
        if adaptive:
            if chosen:
                adaptive.observe_draft(len(active), chosen, draft_s)
            for _, request, drafted, emitted in rows:
                if drafted:
                    adaptive.observe_acceptance(request["id"], drafted, emitted)
            adaptive.observe_verify(len(active), largest, verify_s)
            adaptive.observe_round(len(active), sum(row[3] for row in rows), drafted=largest > 1)
        if len(active) == batch:  # while all B are in flight: the drain at the end, where a speculative run's
            # last requests finish with few others at a full batch's cost, is left out (as the bench's saturated rate)
            seconds += verify_s + draft_s
            tokens += sum(row[3] for row in rows)
        for slot, request, _, emitted in rows:
            request["done"] += emitted
            if request["done"] >= request["trace"]["output_tokens"]:
                if adaptive:
                    adaptive.forget(request["id"])
                start(slot)
    return tokens / seconds, trees


for batch in COSTS:
    plain, _ = replay(batch, None)
    line = f"{batch:2d} requests, plain {plain:6.0f} tok/s:"
    for aging in agings:
        adaptive = AdaptiveSpeculation()
        adaptive.PLAIN_AGING = aging
        for size, (_, verify_ms) in COSTS.items():  # start-up graph timings: the device part of each round
            for nodes, ms in verify_ms.items():
                adaptive.observe_graph(size, nodes, ms / 1e3 * 0.7)
        passes = [replay(batch, adaptive) for _ in range(3)]
        line += f"  aging {aging}: " + " / ".join(f"{rate / plain:.2f}x ({trees})" for rate, trees in passes)
    print(line, flush=True)
