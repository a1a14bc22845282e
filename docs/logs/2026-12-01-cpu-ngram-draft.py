"""The n-gram drafter proposing trees for 64 requests at budget 4, on this machine's CPU: the first 64 held-out code
prompts (SmolLM2's tokenizer), each followed by 40 tokens copied from its end as a stand-in output. Median
milliseconds of 50 proposals (run at each revision to compare).
    python docs/logs/2026-12-01-cpu-ngram-draft.py"""

import statistics
import time
from pathlib import Path

from treeserve.drafter import NgramDrafter
from treeserve.drafter.corpus import read_prompts
from treeserve.loading import load_tokenizer

tokenizer = load_tokenizer("smollm2-135m")
drafter = NgramDrafter()
contexts = []
for prompt in read_prompts(Path("docs/prompts/held-out-code.jsonl"))[:64]:
    tokens = tokenizer.encode(prompt["prompt"])
    context = drafter.new_context()
    drafter.extend(context, tokens + tokens[-40:])
    contexts.append(context)


def proposal_seconds() -> float:
    started = time.perf_counter()
    drafter.propose(contexts, [4] * len(contexts))
    return time.perf_counter() - started


for _ in range(5):
    proposal_seconds()
print(f"64 requests, budget 4: {statistics.median(proposal_seconds() for _ in range(50)) * 1e3:.3f} ms a proposal")
