"""The prompt sets that ship with treeserve (package data): prompts held out from drafter training, which the
benchmarks measure on, found from any working directory and inside the container; and the prompt files' format,
which the benches, drafter training and make-prompts read and write: JSONL, plain or compressed (.xz, .gz)."""

import gzip
import json
import lzma
from pathlib import Path
from typing import Iterable, Sequence

from treeserve.errors import TreeserveError

PROMPTS_DIR = Path(__file__).parent / "prompts"

# Benchmark workload name -> its prompt set.
WORKLOADS = {"code": PROMPTS_DIR / "held-out-code.jsonl", "chat": PROMPTS_DIR / "held-out-chat.jsonl",
             "code-wide": PROMPTS_DIR / "held-out-code-wide.jsonl", "prose": PROMPTS_DIR / "held-out-prose.jsonl"}


def open_prompts(path: Path):
    """A text stream reading a prompts file, xz- or gzip-compressed by its suffix (.xz, .gz)."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_prompts(path: Path) -> list[dict]:
    """A JSONL file of {"prompt": str, "chat": bool} (other keys ignored), plain or compressed (.xz, .gz)."""
    if not path.is_file():
        raise TreeserveError(f"prompts file {path} not found")
    records = []
    try:
        with open_prompts(path) as stream:
            lines = stream.read().splitlines()
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as error:
        raise TreeserveError(f"cannot read {path}: {error}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TreeserveError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise TreeserveError(f'{path}:{number}: expected {{"prompt": "non-empty text", "chat": true|false}}')
        records.append(record)
    if not records:
        raise TreeserveError(f"{path}: no prompts")
    return records


def write_prompts(path: Path, records: Iterable[dict]) -> None:
    """JSONL, compressed by the suffix (.xz, .gz) and byte-identical for the same records: no timestamp or file
    name in the gzip header."""
    data = "".join(json.dumps(record) + "\n" for record in records).encode("utf-8")
    if path.suffix == ".xz":
        data = lzma.compress(data, preset=9)
    elif path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as error:
        raise TreeserveError(f"cannot write {path}: {error}") from None


def encode_prompts(tokenizer, records: Sequence[dict]) -> list[list[int]]:
    """Token ids of each record's prompt, through the chat template where the record says chat."""
    return [tokenizer.encode_prompt(r["prompt"], bool(r.get("chat"))) for r in records]
