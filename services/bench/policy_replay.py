"""python -m treeserve.bench.policy_replay: how the speculation policy plays a drafter at one request, on the CPU.

First, per prompt of a set and per position p of its greedy answer (SmolLM2, float32), the tokens a round rooted
there would emit with the shipped merged drafter's own tree at each budget (--budgets) and with prompt lookup's alone
(1 + the deepest tree path the answer continues; no target forward per position: the answer is known). That record
(--positions FILE, made once and reused: it takes about 20 s a prompt on two cores) is then replayed, one request
after another, under fixed budgets and under adaptive speculation at each acceptance memory (--decays) and, with
--margins and --reuses, each margin a tree must promise over plain decoding (AdaptiveSpeculation.LONE_MARGIN) and
each run a lone request's tree decision stands for (REUSE_LONE_TREE), with a round's cost made of the parts given in
ms (--plain-ms, --plain-extra-ms, --tree-extra-ms, --draft-ms, --lookup-ms, --catch-up-ms, --prompt-ms,
--choice-ms: by default what one H100 measured for SmolLM2 through the three services, a request's first tree priced
as any catch-up; a plain round's extra and a worked-out choice's host time 0 unless given). Reports tokens per
second over plain decoding's for each, and the rounds by choice: where the policy's choices, not the device, make
adaptive speculation lose to a fixed tree.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import time
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.settings import OneLineErrorParser


def tokens_emitted(tree, answer: list[int]) -> int:
    """1 + the depth of the deepest path of `tree` (root: the token before `answer`) that `answer` continues."""
    matches, depths, deepest = [True], [0], 0
    for node in range(1, tree.size):
        parent = tree.parents[node]
        depth = depths[parent] + 1
        depths.append(depth)
        match = matches[parent] and depth <= len(answer) and tree.tokens[node] == answer[depth - 1]
        matches.append(match)
        if match:
            deepest = max(deepest, depth)
    return 1 + deepest


def record_positions(prompts: Path, limit: int | None, budgets: list[int], max_new_tokens: int) -> list[dict]:
    """Per prompt: its greedy answer, and per position the tokens of each budget's own tree and of lookup's."""
    import torch

    from treeserve.drafter import load_drafter
    from treeserve.drafter.training.train import target_features
    from treeserve.loading import load_target
    from treeserve.params import GenerationParams
    from treeserve.prompt_sets import encode_prompts, read_prompts
    from treeserve.verifier.engine import generate

    records = read_prompts(prompts)[:limit]
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    drafter = load_drafter("merged", None, "ddtree", target=target, max_batch=1, graphs=False,
                           max_budget=max(budgets))
    positions = []
    for number, prompt in enumerate(encode_prompts(target.tokenizer, records), 1):
        started = time.perf_counter()
        answer = generate(target.model, target.tokenizer, prompt,
                          GenerationParams(max_new_tokens=max_new_tokens)).token_ids
        text = prompt + answer
        features = target_features(target.model, torch.tensor(text)[None], tuple(drafter.feature_layer_ids))[0]
        record = {"answer": answer, "own": {str(budget): [] for budget in budgets}, "lookup": []}
        for p in range(len(answer)):
            context = drafter.new_context()
            try:
                drafter.extend(context, text[:len(prompt) + p + 1], features[:len(prompt) + p])
                rest = answer[p + 1:]
                for budget in budgets:
                    record["own"][str(budget)].append(tokens_emitted(drafter.propose([context], [budget])[0], rest))
                record["lookup"].append(tokens_emitted(drafter.propose_lookup([context], [max(budgets)])[0], rest))
            finally:
                drafter.release(context)
        positions.append(record)
        print(f"prompt {number}/{len(records)}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return positions


class RoundCosts:
    """A replayed round's seconds by its parts: a plain round; what a plain round of a request that could draft adds
    (its rows sent ahead, its kept features: not in plain decoding's rounds); the host's time for each choice the
    policy works out rather than reuses; what a tree adds to the verification; the drafter's
    round trip for its own trees, for lookup's alone, what a round trip that catches the context up adds, and what
    a request's first tree of the drafter's own adds beside that when no plain round came before it (its prompt's
    rows, which a plain round would have sent ahead)."""

    def __init__(self, plain_ms: float, tree_extra_ms: float, draft_ms: float, lookup_ms: float, catch_up_ms: float,
                 prompt_ms: float = 0.0, plain_extra_ms: float = 0.0, choice_ms: float = 0.0):
        self.plain_s, self.tree_extra_s = plain_ms / 1e3, tree_extra_ms / 1e3
        self.plain_extra_s, self.choice_s = plain_extra_ms / 1e3, choice_ms / 1e3
        self.draft_s, self.lookup_s, self.catch_up_s = draft_ms / 1e3, lookup_ms / 1e3, catch_up_ms / 1e3
        self.prompt_s = prompt_ms / 1e3


def replay(positions: list[dict], costs: RoundCosts, policy_factory=None, fixed_budget: int = 32
           ) -> tuple[float, dict[str, int]]:
    """Tokens per second over plain decoding's, and the rounds by choice, of one request after another under
    `policy_factory()` (None: every round a tree of `fixed_budget`)."""
    from treeserve.verifier.drafter_link import DraftRound
    from treeserve.verifier.round import RequestReport, RoundReport

    policy = policy_factory() if policy_factory else None
    budgets = sorted(int(budget) for budget in positions[0]["own"])
    seconds = tokens = 0.0
    rounds: dict[str, int] = {}
    for number, record in enumerate(positions):
        request_id, length, p, last = f"r{number}", len(record["answer"]), 0, "plain"
        prompt_unsent, first_own = True, True
        while p < length - 1:
            if policy is None:
                budget, choice, lookup = fixed_budget, None, False
            else:
                worked_out = policy.worked_out
                asked, choice = policy.round_budgets({request_id: max(budgets)}, 1, True)
                seconds += costs.choice_s * (policy.worked_out - worked_out)
                budget, lookup = asked.get(request_id, 0), choice is not None and choice.lookup
            label = ("lookup-" if lookup else "") + str(budget)
            rounds[label] = rounds.get(label, 0) + 1
            if budget:
                # A budget between the recorded ones reads the next larger one's record, capped at budget + 1 tokens
                # (lookup's, recorded at the largest): an upper bound for such small trees, which the policy seldom
                # plays at these prices.
                column = record["lookup"] if lookup else record["own"][str(next(b for b in budgets if b >= budget))]
                emitted = min(column[p], budget + 1, length - 1 - p)
                catch_up = last != "own" and not lookup
                trip = costs.lookup_s if lookup else costs.draft_s + (costs.catch_up_s if catch_up else 0.0)
                prompt = first_own and prompt_unsent and not lookup
                trip += costs.prompt_s if prompt else 0.0
                first_own = first_own and lookup
                drafts = [DraftRound({request_id: None}, round_trip_s=trip, catch_up=catch_up, prompt=prompt)]
                request = RequestReport(request_id, emitted, tree_nodes=budget, accepted=emitted - 1)
                verify, last = costs.plain_s + costs.tree_extra_s, "lookup" if lookup else "own"
            else:
                emitted, trip, drafts, last, prompt_unsent = 1, 0.0, [], "plain", False
                verify = costs.plain_s + costs.plain_extra_s
                request = RequestReport(request_id, 1)
            if policy is not None:
                policy.observe(RoundReport(1, choice, {request_id: budget} if budget else {}, drafts, forward_batch=1,
                                           largest_tree=budget + 1, requests=[request], draft_s=trip,
                                           verify_s=verify))
            seconds, tokens, p = seconds + trip + verify, tokens + emitted, p + emitted
        if policy is not None:
            policy.forget(request_id)
    return tokens / seconds * costs.plain_s, rounds


def main(argv: list[str] | None = None) -> int:
    from treeserve.bench.load import int_list
    from treeserve.prompt_sets import WORKLOADS

    parser = OneLineErrorParser(prog="python -m treeserve.bench.policy_replay", description=__doc__)
    parser.add_argument("--positions", type=Path, required=True,
                        help="the per-position record: read if it exists, else made from --prompts and written here")
    parser.add_argument("--prompts", default="chat", help=f"one of {', '.join(sorted(WORKLOADS))}, or a JSONL file")
    parser.add_argument("--limit", type=int, help="the first N prompts")
    parser.add_argument("--budgets", type=int_list, default=[8, 16, 32], help="comma-separated (default 8,16,32)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decays", default="0.05,0.02", help="adaptive speculation's acceptance decays to replay")
    parser.add_argument("--margins", default="", help="comma-separated margins to replay (default: the policy's own)")
    parser.add_argument("--reuses", default="", help="comma-separated counts of rounds a lone request's tree decision "
                                                    "stands (AdaptiveSpeculation.REUSE_LONE_TREE; default: its own)")
    parser.add_argument("--plain-ms", type=float, default=1.05)
    parser.add_argument("--plain-extra-ms", type=float, default=0.0)
    parser.add_argument("--choice-ms", type=float, default=0.0)
    parser.add_argument("--tree-extra-ms", type=float, default=0.46)
    parser.add_argument("--draft-ms", type=float, default=0.76)
    parser.add_argument("--lookup-ms", type=float, default=0.15)
    parser.add_argument("--catch-up-ms", type=float, default=0.3)
    parser.add_argument("--prompt-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    numbers = {}
    for flag in ("decays", "margins", "reuses"):
        try:
            numbers[flag] = [float(value) for value in getattr(args, flag).split(",") if value.strip()]
        except ValueError:
            parser.error(f"--{flag}: comma-separated numbers, not {getattr(args, flag)!r}")
    if args.positions.exists():
        positions = json.loads(args.positions.read_text())
    else:
        prompts = WORKLOADS.get(args.prompts) or Path(args.prompts)
        positions = record_positions(prompts, args.limit, args.budgets, args.max_new_tokens)
        args.positions.write_text(json.dumps(positions) + "\n")
    from treeserve.verifier.adaptive import AdaptiveSpeculation

    costs = RoundCosts(args.plain_ms, args.tree_extra_ms, args.draft_ms, args.lookup_ms, args.catch_up_ms,
                       args.prompt_ms, args.plain_extra_ms, args.choice_ms)
    rows = []
    for budget in sorted(int(b) for b in positions[0]["own"]):
        speedup, rounds = replay(positions, costs, fixed_budget=budget)
        rows.append({"policy": f"fixed {budget}", "speedup": round(speedup, 3), "rounds": rounds})
    for decay in numbers["decays"]:
        for margin, reuse in itertools.product(numbers["margins"] or [None], numbers["reuses"] or [None]):
            settings = {**({} if margin is None else {"MARGIN": margin, "LONE_MARGIN": margin}),
                        **({} if reuse is None else {"REUSE_LONE_TREE": int(reuse)})}
            policy = type("ReplayedSpeculation", (AdaptiveSpeculation,), settings)
            speedup, rounds = replay(positions, costs, functools.partial(policy, decay=decay))
            label = (f"adaptive, decay {decay}" + ("" if margin is None else f", margin {margin}")
                     + ("" if reuse is None else f", trees reused {int(reuse)}"))
            rows.append({"policy": label, "speedup": round(speedup, 3), "rounds": rounds})
    for row in rows:
        print(f"{row['policy']:>36}: {row['speedup']:.3f}x plain decoding  rounds {row['rounds']}")
    if args.out:
        command = " ".join(["python -m treeserve.bench.policy_replay", *(argv if argv is not None else sys.argv[1:])])
        costs_ms = {part: getattr(args, f"{part}_ms")
                    for part in ("plain", "plain_extra", "choice", "tree_extra", "draft", "lookup", "catch_up",
                                 "prompt")}
        args.out.write_text(json.dumps({"command": command, "costs_ms": costs_ms, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TreeserveError as error:
        print(f"policy_replay: error: {error}", file=sys.stderr)
        sys.exit(1)
