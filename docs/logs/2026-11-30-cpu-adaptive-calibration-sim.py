"""A simulation, not a measurement: closed loops of requests under AdaptiveSpeculation, with and without the
realized-over-expected calibration (without: calibration_factor pinned to 1), on made-up costs shaped like the
H200 stack's (a plain round 1.5 ms + 0.15 ms a request; trees dearer with their size and the batch; drafts 0.5 ms
+ 0.04 ms a request). Each request accepts a geometric number of drafted tokens per round, with a mean of its own;
its first rounds may accept well (4 on average) and the rest poorly ("burst3": three good rounds, then 0.2). It
prints, per batch and acceptance pattern, speculative tok/s over plain tok/s and the share of speculative rounds.
It chose Calibration's per-bucket record and its decay of 0.02. From the repository root:

    python docs/logs/2026-11-30-cpu-adaptive-calibration-sim.py"""
import random

from treeserve.verifier.adaptive import AdaptiveSpeculation


def simulate(calibrate, batch, cost, draft, good_rounds, mean_of, rounds=4000, seed=0, length=128):
    rng = random.Random(seed)
    adaptive = AdaptiveSpeculation()
    if not calibrate:
        adaptive.calibration_factor = lambda batch: 1.0
    requests, made = {}, 0

    def new_request():
        nonlocal made
        made += 1
        requests[f"r{made}"] = [0, 0, mean_of(rng)]  # tokens so far, speculative rounds seen, its mean acceptance

    for _ in range(batch):
        new_request()
    seconds = tokens = 0.0
    speculative = 0
    for _ in range(rounds):
        budget = adaptive.choose({r: 16 for r in requests}, batch)
        seconds += cost(budget) + (draft if budget else 0)
        adaptive.observe_verify(batch, budget + 1, cost(budget))
        if budget:
            adaptive.observe_draft(batch, budget, draft)
            speculative += 1
        emitted = 0
        for request_id, state in list(requests.items()):
            count = 1
            if budget:
                mean = 4 if state[1] < good_rounds else state[2]
                accepted = 0
                while accepted < budget and rng.random() < mean / (1 + mean):
                    accepted += 1
                count += accepted
                state[1] += 1
                adaptive.observe_acceptance(request_id, budget, count)
            state[0] += count
            emitted += count
            if state[0] >= length:
                del requests[request_id]
                adaptive.forget(request_id)
                new_request()
        adaptive.observe_round(batch, emitted)
        tokens += emitted
    return round(tokens / seconds / (batch / cost(0)), 3), round(speculative / rounds, 3)


def h200_like(batch):
    base = 0.0015 + batch * 0.00015
    return (lambda budget: base * (1 + 0.045 * (budget + 1) ** 0.9 * (batch / 64) ** 0.5) if budget else base), \
        0.0005 + batch * 0.00004


PATTERNS = [("low", 1, lambda rng: 0.3), ("mixed", 1, lambda rng: rng.choice([0.1, 0.3, 1.0, 2.0])),
            ("burst3", 3, lambda rng: 0.2), ("mid", 1, lambda rng: 0.8)]
for batch in (1, 4, 16, 64):
    cost, draft = h200_like(batch)
    for label, good, mean_of in PATTERNS:
        print(f"batch {batch:2d} {label:6s}  (speculative / plain tok/s, speculative rounds)  uncalibrated",
              simulate(False, batch, cost, draft, good, mean_of), " calibrated",
              simulate(True, batch, cost, draft, good, mean_of), flush=True)
