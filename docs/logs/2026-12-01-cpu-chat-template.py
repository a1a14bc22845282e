"""Time of one chat request's tokenizing in the gateway (`Tokenizer.encode_chat`, chat template included) on
SmolLM2's tokenizer, the mean of 500 calls after one untimed call. Run at a revision and its parent to compare.

    python docs/logs/2026-12-01-cpu-chat-template.py
"""

import json
import time
from pathlib import Path

from treeserve.loading import load_tokenizer

tokenizer = load_tokenizer("smollm2-135m")
prompt = json.loads(Path("docs/prompts/held-out-chat.jsonl").read_text().splitlines()[0])["prompt"]
tokenizer.encode_chat(prompt)
calls = 500
started = time.perf_counter()
for _ in range(calls):
    tokenizer.encode_chat(prompt)
print(f"encode_chat: {(time.perf_counter() - started) / calls * 1e6:.1f} us a call")
