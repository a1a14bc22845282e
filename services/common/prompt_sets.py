"""The prompt sets that ship with treeserve (package data): prompts held out from drafter training, which the
benchmarks measure on, found from any working directory and inside the container."""

from pathlib import Path

PROMPTS_DIR = Path(__file__).parent / "prompts"

# Benchmark workload name -> its prompt set.
WORKLOADS = {"code": PROMPTS_DIR / "held-out-code.jsonl", "chat": PROMPTS_DIR / "held-out-chat.jsonl",
             "code-wide": PROMPTS_DIR / "held-out-code-wide.jsonl", "prose": PROMPTS_DIR / "held-out-prose.jsonl"}
