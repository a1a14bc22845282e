"""Training prompts cut from code and documentation on this machine (`treeserve make-prompts`).

A DFlash drafter learns the target's own answers, so the prompts only need to resemble what the server will be
asked; for a code assistant that is code. This walks .py/.md/.rst/.txt files, cuts snippets (a function or
class, or a run of 10-40 lines) and wraps each in one of a few instructions. Any folder of source works: the
Python standard library is on every machine. Held-out prompts should come from other folders (other packages),
so the held-out acceptance measures generalisation, not memory of the same files.

Deterministic for a seed: files are visited in sorted order, each file's snippets are drawn from a generator
seeded by (seed, its relative path), and the final order is one seeded shuffle.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import random
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Sequence

from treeserve.errors import TreeserveError

CODE_SUFFIXES, DOC_SUFFIXES = {".py"}, {".md", ".rst", ".txt"}
SKIPPED_FOLDERS = {"__pycache__", "node_modules", "site-packages", "dist-packages"}
MAX_FILE_BYTES, MAX_SNIPPET_CHARS = 1 << 20, 4000
MIN_LINES, MAX_LINES = 10, 40

FENCED = "\n\n```python\n{snippet}\n```"
KINDS = {
    "explain": "Explain what this code does:" + FENCED,
    "docstrings": "Add docstrings and type hints to this function:" + FENCED,
    "tests": "Write unit tests for this code:" + FENCED,
    "continue": "Continue this file:" + FENCED,
    "summarize": "Summarize this documentation:\n\n{snippet}",
}


def read_prompts(path: Path) -> list[dict]:
    """A JSONL file of {"prompt": str, "chat": bool} (other keys ignored)."""
    if not path.is_file():
        raise TreeserveError(f"prompts file {path} not found")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
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


def encode_prompts(tokenizer, records: Sequence[dict]) -> list[list[int]]:
    """Token ids of each record's prompt, through the chat template where the record says chat."""
    return [tokenizer.encode_prompt(r["prompt"], bool(r.get("chat"))) for r in records]


def excluded(relative: Path, patterns: list[str]) -> bool:
    """A pattern matches the path relative to its --from folder, or any one folder or file name on it."""
    text = relative.as_posix()
    return any(fnmatch.fnmatch(text, p) or any(fnmatch.fnmatch(part, p) for part in relative.parts)
               for p in patterns)


def source_files(root: Path, exclude: list[str]) -> list[Path]:
    """Files with a known suffix under `root`, sorted; hidden folders, caches and installed packages are not
    entered (give site-packages itself as a --from folder to include it)."""
    files = []
    for folder, subfolders, names in os.walk(root):
        here = Path(folder)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIPPED_FOLDERS
                               and not excluded((here / d).relative_to(root), exclude))
        for name in sorted(names):
            path = here / name
            if (path.suffix in CODE_SUFFIXES | DOC_SUFFIXES and path.is_file()
                    and not excluded(path.relative_to(root), exclude) and path.stat().st_size <= MAX_FILE_BYTES):
                files.append(path)
    return sorted(files)


def read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\0" in text else text


def definitions(text: str) -> list[tuple[int, int, bool]]:
    """(first line, last line, is a function) of every function and class of 5 to 60 lines (1-based)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if 5 <= node.end_lineno - node.lineno + 1 <= 60:
                found.append((node.lineno, node.end_lineno, not isinstance(node, ast.ClassDef)))
    return sorted(found)


def window(lines: list[str], rng: random.Random, from_top: bool = False) -> tuple[int, int] | None:
    """A run of 10-40 lines (1-based, inclusive) with some substance, or None when the file is too short."""
    if len(lines) < MIN_LINES:
        return None
    length = rng.randint(MIN_LINES, min(MAX_LINES, len(lines)))
    start = 1 if from_top else rng.randint(1, len(lines) - length + 1)
    end = start + length - 1
    return (start, end) if sum(bool(line.strip()) for line in lines[start - 1:end]) >= MIN_LINES // 2 else None


def candidates(text: str, is_code: bool, rng: random.Random) -> list[tuple[str, int, int]]:
    """(kind, first line, last line) of every prompt this file can give."""
    lines = text.splitlines()
    if not is_code:
        spans = [window(lines, rng) for _ in range(3)]
        return [("summarize", *span) for span in spans if span]
    found = []
    for first, last, is_function in definitions(text):
        kinds = ["explain", "tests"] + (["docstrings"] if is_function else [])
        found.append((rng.choice(kinds), first, last))
    found += [("explain", *span) for span in [window(lines, rng)] if span]
    found += [("continue", *span) for span in [window(lines, rng, from_top=True)] if span]
    return found


def file_prompts(path: Path, label: str, seed: int, per_file: int) -> list[dict]:
    """Up to `per_file` prompts from one file; `label` names it in each prompt's "source"."""
    text = read_text(path)
    if not text:
        return []
    rng = random.Random(f"{seed}:{label}")
    options = candidates(text, path.suffix in CODE_SUFFIXES, rng)
    lines = text.splitlines()
    prompts = []
    for kind, first, last in rng.sample(options, min(per_file, len(options))):
        snippet = textwrap.dedent("\n".join(lines[first - 1:last])).strip("\n")
        if len(snippet) > MAX_SNIPPET_CHARS:
            snippet = snippet[:snippet.rfind("\n", 0, MAX_SNIPPET_CHARS)]
        if snippet.strip():
            prompts.append({"prompt": KINDS[kind].format(snippet=snippet), "chat": True, "kind": kind,
                            "source": f"{label}:{first}-{last}"})
    return prompts


def make_prompts(roots: list[Path], limit: int, seed: int = 0, exclude: list[str] = (), per_file: int = 8):
    """Prompts from every file under `roots`, shuffled by `seed`, at most `limit`. Returns (prompts, files seen)."""
    prompts, file_count = [], 0
    for root in roots:
        if not root.is_dir():
            raise TreeserveError(f"--from {root}: not a folder")
        for path in source_files(root, list(exclude)):
            file_count += 1
            prompts += file_prompts(path, f"{root.name}/{path.relative_to(root).as_posix()}", seed, per_file)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit], file_count


def run(args) -> int:
    """`treeserve make-prompts`: write the prompts as JSONL, one {"prompt", "chat", "kind", "source"} a line."""
    if args.limit < 1 or args.per_file < 1:
        raise TreeserveError(f"--limit and --per-file must be at least 1, got {args.limit} and {args.per_file}")
    prompts, file_count = make_prompts(args.roots, args.limit, args.seed, args.exclude, args.per_file)
    if not prompts:
        raise TreeserveError(f"no prompts: {file_count} files with usable code or docs under the --from folders")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    except OSError as error:
        raise TreeserveError(f"cannot write {args.out}: {error}") from None
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(Counter(p["kind"] for p in prompts).items()))
    print(f"make-prompts: {len(prompts)} prompts ({kinds}) from {file_count} files -> {args.out}", file=sys.stderr)
    return 0
