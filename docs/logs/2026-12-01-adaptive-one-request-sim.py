"""Round policies at one request, replayed on the n-gram drafter's real acceptance: what adaptive speculation
leaves on the table where speculation should help most.

The trace (docs/logs/2026-12-01-cpu-ngram-acceptance-trace.py) holds, along SmolLM2's greedy float32 output for
each of the 16 code prompts the bench's one-request cell sends, what a round at each position would accept at each
budget. A round's cost comes from the H200 runs at one request, float32 (docs/benchmarks.md, the adaptive_checked
figures of the n-gram code cells at a0d7659, 0eb6b8f and 0b5fde5): a plain round 1.83 ms; a tree round the
drafter's round trip, 0.72 ms, plus a verification of 2.75-3.10 ms by tree bucket (its host work included). Prompt
rounds, the same for every policy, are left out. The real AdaptiveSpeculation is driven as the verifier drives it
(choose, then observe_draft, observe_acceptance, observe_verify and observe_round), over three passes of the 16
requests with its state kept, as a stack keeps it between a bench's turns; without and with PLAIN_AGING.

    python docs/logs/2026-12-01-adaptive-one-request-sim.py docs/figures/adaptive-one-request/ngram-code-16-prompts-trace.json
"""

import json
import sys

from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier.graphs import TREE_BUCKETS

PLAIN_S, DRAFT_S = 1.83e-3, 0.72e-3
VERIFY_S = {1: 1.83e-3, 2: 2.75e-3, 3: 2.75e-3, 5: 2.82e-3, 9: 2.97e-3, 17: 3.10e-3}  # by tree bucket (nodes)
GRAPH_S = {1: 1.30e-3, 2: 1.50e-3, 3: 1.55e-3, 5: 1.60e-3, 9: 1.70e-3, 17: 1.85e-3}  # start-up replay timings
BUDGET = 16

traces = json.load(open(sys.argv[1]))["traces"]


def bucket(nodes: int) -> int:
    return next(size for size in TREE_BUCKETS if size >= nodes)


def tree_round(position: dict, budget: int) -> tuple[float, int, int]:
    """(seconds, tokens emitted, drafted nodes) of a round at this position with this budget."""
    accepted, drafted = position[str(budget)]
    return DRAFT_S + VERIFY_S[bucket(drafted + 1)], 1 + accepted, drafted


def replay(pick, adaptive: AdaptiveSpeculation | None = None) -> tuple[float, int]:
    """Seconds and tree rounds of the 16 requests, one at a time; `pick(request, position, missed_for)` gives each
    round's budget (missed_for: plain rounds since the request's last tree round accepted nothing, None after a
    hit or before any)."""
    seconds, trees = 0.0, 0
    for number, trace in enumerate(traces):
        request, done, length, missed_for = f"request-{number}", 1, trace["output_tokens"], None
        while done < length:
            position = trace["rounds"][done - 1]
            budget = pick(request, position, missed_for)
            if budget == 0:
                round_s, emitted, drafted = PLAIN_S, 1, 0
                missed_for = None if missed_for is None else missed_for + 1
            else:
                round_s, emitted, drafted = tree_round(position, budget)
                trees += 1
                missed_for = 0 if emitted == 1 else None
            emitted = min(emitted, length - done)
            if adaptive is not None:
                if budget:
                    adaptive.observe_draft(1, budget, DRAFT_S)
                    if drafted:
                        adaptive.observe_acceptance(request, drafted, emitted)
                adaptive.observe_verify(1, drafted + 1, round_s - (DRAFT_S if budget else 0.0))
                adaptive.observe_round(1, emitted, drafted=drafted > 0)
            seconds += round_s
            done += emitted
        if adaptive is not None:
            adaptive.forget(request)
    return seconds, trees


plain_s, _ = replay(lambda *_: 0)
print(f"plain decoding: {plain_s * 1e3:.0f} ms of rounds")


def report(label: str, seconds: float, trees: int) -> None:
    print(f"{label:44s} x{plain_s / seconds:.3f} over plain, {trees} tree rounds")


report("always budget 16", *replay(lambda *_: BUDGET))
for wait in (1, 2, 4, 8):
    report(f"budget 16, after a miss {wait} plain rounds",
           *replay(lambda request, position, missed_for: 0 if missed_for is not None and missed_for < wait
                   else BUDGET))


def best_round(request, position, missed_for):  # knows each round's acceptance before choosing: a bound
    rates = {0: 1 / PLAIN_S}
    for budget in (1, 2, 4, 8, 16):
        round_s, emitted, _ = tree_round(position, budget)
        rates[budget] = emitted / round_s
    return max(rates, key=rates.get)


report("clairvoyant (each round's best budget)", *replay(best_round))
for aging in (0.0, AdaptiveSpeculation.PLAIN_AGING):  # without and with a request's evidence ageing in plain rounds
    adaptive = AdaptiveSpeculation()
    adaptive.PLAIN_AGING = aging
    for nodes, seconds in GRAPH_S.items():
        adaptive.observe_graph(1, nodes, seconds)
    for turn in range(3):
        report(f"adaptive speculation, aging {aging}, pass {turn + 1}",
               *replay(lambda request, position, missed_for: adaptive.choose({request: BUDGET}, 1), adaptive))
