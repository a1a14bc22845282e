"""Per-round acceptance of the n-gram drafter along SmolLM2's greedy outputs, for simulating round policies.

For the first N prompts of a workload (the bench's requests at one request: its first 16), the target's greedy
output (float32: the tokens every float32 run produces, on a CPU or the H200), then at each position a round could
start from (after the prefill's token), the tree the n-gram drafter proposes at each budget and how many of its
tokens the target accepts there (greedy acceptance needs only the output: the walk follows it), and how many nodes
the tree had (a drafter finds fewer continuations than the budget, or none).

    python docs/logs/2026-12-01-cpu-ngram-acceptance-trace.py --workload code --prompts 16 --out trace.json
"""

import argparse
import json
import time
from pathlib import Path

from treeserve.drafter.corpus import read_prompts
from treeserve.drafter.ngram import NgramDrafter
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.tree import TokenContext
from treeserve.verifier import generate

BUDGETS = (1, 2, 4, 8, 16)

parser = argparse.ArgumentParser()
parser.add_argument("--workload", default="code", choices=("code", "chat"))
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--out", required=True)
args = parser.parse_args()

target = load_target("smollm2-135m")
drafter = NgramDrafter()
records = read_prompts(Path(f"docs/prompts/held-out-{args.workload}.jsonl"))[:args.prompts]
traces = []
for number, record in enumerate(records):
    started = time.perf_counter()
    prompt = target.tokenizer.encode_prompt(record["prompt"], bool(record.get("chat")))
    output = generate(target.model, target.tokenizer, prompt, GenerationParams(max_new_tokens=args.max_new_tokens)
                      ).token_ids
    rounds = []  # per position p >= 1: the round whose committed tokens end at output[p - 1]
    context = TokenContext(prompt + output[:1])
    for p in range(1, len(output)):
        by_budget = {}
        for budget in BUDGETS:
            tree = drafter.tree(context, budget)
            # The greedy walk (treeserve.verifier.acceptance): from the root, on to the child holding the target's
            # next token, which is the output's, as long as there is one.
            children, node, accepted = tree.children(), 0, 0
            while p + accepted < len(output):
                node = next((c for c in children[node] if tree.tokens[c] == output[p + accepted]), -1)
                if node < 0:
                    break
                accepted += 1
            by_budget[budget] = [accepted, tree.size - 1]  # accepted, drafted
        rounds.append(by_budget)
        context.add([output[p]])
    traces.append({"prompt": number, "prompt_tokens": len(prompt), "output_tokens": len(output), "rounds": rounds})
    print(f"prompt {number}: {len(output)} tokens, {time.perf_counter() - started:.1f} s", flush=True)
Path(args.out).write_text(json.dumps({"workload": args.workload, "budgets": BUDGETS, "traces": traces}))
