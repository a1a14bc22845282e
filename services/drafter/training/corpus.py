"""Training prompts cut from code and documentation (`treeserve make-prompts`).

A DFlash drafter learns the target's own answers, so the prompts only need to resemble what the server will be
asked: code tasks (explain, document, test, review, continue) over snippets in several languages, and prose tasks
(summarise, explain, rewrite, answer a question, continue) over passages of documentation and manual pages. This
module cuts snippets out of documents and words the prompts; `corpus_sources` says where the documents come from
(registered sources with their licences, or any --from folder) and builds the training and held-out sets.

Deterministic for a seed: documents are visited in sorted order, each one's snippets are drawn from a generator
seeded by (seed, its label), and the final order is one seeded shuffle.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections import Counter
from dataclasses import dataclass

# Fence names of the code languages, by file suffix; prose styles say how headings are written.
CODE_LANGUAGES = {".py": "python", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".tcc": "cpp",
                  ".pl": "perl", ".pm": "perl", ".sh": "sh", ".bash": "bash", ".js": "javascript",
                  ".mjs": "javascript", ".cjs": "javascript", ".cmake": "cmake"}
PROSE_STYLES = {".md": "markdown", ".rst": "rst", ".txt": "text"}
LANGUAGE_NAMES = {"python": "Python", "c": "C", "cpp": "C++", "perl": "Perl", "sh": "shell", "bash": "Bash",
                  "javascript": "JavaScript", "cmake": "CMake"}
MAX_SNIPPET_CHARS = 4000
MIN_LINES, MAX_LINES = 10, 40
# A long file gives more than --per-file prompts: one more per this many lines (prose is scarcer than code).
LINES_PER_EXTRA_PROMPT = {"code": 150, "prose": 40}

# Instructions by kind; one is drawn per prompt. The first of each code kind is the wording of the first corpus.
CODE_KINDS = {
    "explain": ("Explain what this code does:", "Explain what this {language} code does, step by step:",
                "What does this {language} code do?"),
    "docstrings": ("Add docstrings and type hints to this function:",),
    "comments": ("Add comments to this {language} code that explain what each part does:",),
    "tests": ("Write unit tests for this code:", "Write tests for this {language} code:"),
    "review": ("Review this {language} code: point out bugs, unclear parts and possible improvements.",),
    "continue": ("Continue this file:", "Continue this {language} file:"),
}
# Which kinds a run of lines can get, by language (Python functions and classes also get docstrings and tests).
WINDOW_KINDS = {"python": ("explain", "review"), "c": ("explain", "comments"), "cpp": ("explain", "comments"),
                "cmake": ("explain", "comments")}
OTHER_WINDOW_KINDS = ("explain", "comments", "tests", "review")
PROSE_KINDS = {
    "summarize": ("Summarize this documentation:", "Summarize this passage in a few sentences:",
                  "Give a short summary of this text:"),
    "explain-passage": ("Explain this passage in plain words:",
                        "Explain what this documentation means, for someone new to the topic:"),
    "rewrite": ("Rewrite this passage more simply:", "Rewrite this passage as a short list of its key points:",
                "Rewrite this passage to be shorter and clearer, keeping every fact:"),
    "question": (),  # worded by question_about
    "continue-passage": ("Continue this text:", "Continue this documentation in the same style:"),
}
KINDS = {**CODE_KINDS, **PROSE_KINDS}
TOPIC_QUESTIONS = ("What does this passage say about {topic}?", "How does this passage describe {topic}?",
                   "According to this passage, what should I know about {topic}?",
                   "Based only on this passage, explain {topic}.")
GENERIC_QUESTIONS = ("According to this passage, what is the main point?",
                     "What are the most important facts in this passage?",
                     "According to this passage, what should a reader be careful about?",
                     "What question does this passage answer, and what is the answer?",
                     "Which terms does this passage use, and what do they mean here?")
# Headings that name a part of every manual page say nothing about the topic: the page's own name is asked about.
GENERIC_HEADINGS = {"name", "synopsis", "description", "options", "see also", "notes", "bugs", "author", "authors",
                    "copyright", "examples", "example", "return value", "errors", "files", "environment", "history",
                    "standards", "versions", "attributes", "library", "colophon", "reporting bugs", "exit status",
                    "overview", "introduction", "contents", "table of contents", "summary", "caveats", "license"}
TERM = re.compile(r"``([^`\n]{2,40})``|`([^`\n]{2,40})`|\b([A-Za-z_][\w.]*\(\))|\b([A-Z][A-Z0-9]*_[A-Z0-9_]+)\b"
                  r"|(?<![\w-])(--[a-z][\w-]+)")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
COMMENT_LINE = re.compile(r"(#|//|\*|--|;|dnl\b)")
LITERAL = re.compile(r"""'[^'\n]*'|"[^"\n]*"|\b0x[0-9a-fA-F]+\b|[-+]?\b\d[\d_.]*(?:[eE][-+]?\d+)?\b""")
TRAILING_COMMENT = re.compile(r"\s(#|//).*$")


@dataclass(frozen=True)
class Document:
    """One file's text. `label` names it in each prompt's "source" (before ":first-last")."""
    label: str
    text: str
    language: str | None  # a code language (its fence name), or None for prose
    style: str = "text"   # prose only: "rst", "markdown", "indented" (headings unindented, as in a rendered
                          # manual page) or "text", for finding headings


# ------------------------------------------------------------------------------------------ spans of lines


def definitions(text: str) -> list[tuple[int, int, bool]]:
    """(first line, last line, is a function) of every Python function and class of 5 to 60 lines (1-based)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if 5 <= node.end_lineno - node.lineno + 1 <= 60:
                found.append((node.lineno, node.end_lineno, not isinstance(node, ast.ClassDef)))
    return sorted(found)


def data_line(line: str) -> bool:
    """A line of a table in code: only literals (strings, numbers), punctuation and a comment, as in generated
    lists and codecs."""
    rest = TRAILING_COMMENT.sub("", LITERAL.sub("", line))
    return rest.strip(" \t,;:()[]{}") == "" and LITERAL.search(line) is not None


def substantial(lines: list[str], prose: bool) -> bool:
    """At least half the minimum of non-blank lines; code not mostly a table of literals; prose mostly letters
    (not a table or a code listing)."""
    filled = [line for line in lines if line.strip()]
    if len(filled) < MIN_LINES // 2:
        return False
    if not prose:
        return sum(map(data_line, filled)) < 0.5 * len(filled)
    visible = "".join(lines).replace(" ", "")
    return sum(c.isalpha() for c in visible) >= 0.6 * len(visible)


def span_length(rng: random.Random) -> int:
    """10 to 40 lines, shorter ones more often (mean about 20): prompts stay short, so regenerating is fast."""
    return MIN_LINES + int((MAX_LINES - MIN_LINES + 1) * rng.random() ** 2)


def licence_header_end(lines: list[str]) -> int:
    """The first line after a file's opening comments when they hold a copyright or licence notice (0 otherwise):
    boilerplate that thousands of files share makes poor snippets."""
    end, in_block = 0, False
    while end < len(lines):
        line = lines[end].strip()
        if in_block:
            in_block = "*/" not in line
        elif line.startswith("/*"):
            in_block = "*/" not in line[2:]
        elif line and not COMMENT_LINE.match(line):
            break
        end += 1
    header = "\n".join(lines[:end]).lower()
    return end if "copyright" in header or "licen" in header else 0


def tiles(lines: list[str], rng: random.Random, prose: bool, start: int = 0) -> list[tuple[int, int]]:
    """Runs of 10-40 lines from `start` (0-based) that do not overlap (1-based, inclusive), each starting at a
    paragraph where one starts close enough and ending at a blank line where there is one late enough: whole
    paragraphs, whole blocks."""
    spans = []
    while start < len(lines) - MIN_LINES + 1:
        while start < len(lines) and not lines[start].strip():
            start += 1
        paragraph = next((i for i in range(start, min(start + MAX_LINES, len(lines)))
                          if lines[i].strip() and (i == 0 or not lines[i - 1].strip())), start)
        start = paragraph
        end = min(start + span_length(rng), len(lines))  # exclusive
        blank = next((i for i in range(end - 1, start + MIN_LINES - 1, -1) if not lines[i].strip()), None)
        end = blank if blank is not None else end
        if end - start >= MIN_LINES and substantial(lines[start:end], prose):
            spans.append((start + 1, end))
        start = max(end, start + 1)
    return spans


def code_options(doc: Document, lines: list[str], rng: random.Random) -> list[tuple[str, int, int]]:
    """(kind, first line, last line) of every prompt a code file can give."""
    found = []
    if doc.language == "python":
        for first, last, is_function in definitions(doc.text):
            kinds = ["explain", "tests"] + (["docstrings"] if is_function else [])
            found.append((rng.choice(kinds), first, last))
    body = licence_header_end(lines)
    kinds = WINDOW_KINDS.get(doc.language, OTHER_WINDOW_KINDS)
    found += [(rng.choice(kinds), *span) for span in tiles(lines, rng, prose=False, start=body)]
    top = min(len(lines), body + span_length(rng))
    if top - body >= MIN_LINES and substantial(lines[body:top], prose=False):
        found.append(("continue", body + 1, top))
    return found


def prose_options(lines: list[str], rng: random.Random) -> list[tuple[str, int, int]]:
    return [(rng.choice(list(PROSE_KINDS)), *span) for span in tiles(lines, rng, prose=True)]


# ------------------------------------------------------------------------------------------ wording


def headings(lines: list[str], style: str) -> list[tuple[int, str]]:
    """(0-based line, text) of each heading: rst/text underlines, markdown #s, or in indented text (a rendered
    manual page) the unindented lines and the three-space ones (a manual page's subsections)."""
    found = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text:
            continue
        below = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if style in ("rst", "text") and len(below) >= max(3, len(text)) and len(set(below)) == 1 \
                and below[0] in "=-~^*#\"+" and any(c.isalnum() for c in text):
            found.append((i, text))
        elif style == "markdown" and re.match(r"#{1,6} \S", line):
            found.append((i, text.lstrip("#").strip()))
        elif style == "indented" and (not line[0].isspace() or re.match(r" {3}\S", line)) and len(text) < 60:
            found.append((i, text))
    return found


def clean_heading(text: str) -> str:
    """A heading as plain words: rst roles and backticks dropped, a manual page's capitals lowered."""
    text = ROLE.sub(r"\1", text).replace("`", "").replace("*", "").strip(" :")
    if re.fullmatch(r"[A-Z]{4,}( [A-Z]+)*", text):  # a manual page's section name; not UTF-8 or TCP
        return text.lower()
    words = text.split()
    sentence_case = re.fullmatch(r"[A-Z][a-z]+", words[0]) and not any(w[0].isupper() for w in words[1:])
    return text[0].lower() + text[1:] if sentence_case else text  # "Named pipes" -> "named pipes"


def document_title(lines: list[str], style: str, found: list[tuple[int, str]]) -> str | None:
    """What a document is about: a manual page's name (from its NAME section), else its first heading."""
    if style == "indented":
        for i, line in enumerate(lines[:-1]):
            if line.strip() == "NAME" and lines[i + 1].strip():
                return re.split(r"\s+[-\u2010\u2013\u2014]\s+", lines[i + 1].strip())[0].split(",")[0].strip()
    return clean_heading(found[0][1]) if found else None


def key_term(snippet: str) -> str | None:
    """The passage's most frequent code-like term (``literal``, call(), CONSTANT_NAME, --option), in backticks."""
    counts = Counter(next(group for group in match.groups() if group) for match in TERM.finditer(snippet))
    return f"`{counts.most_common(1)[0][0]}`" if counts else None


def question_about(snippet: str, heading: str | None, title: str | None, rng: random.Random) -> str:
    """A question the passage answers: about its section's heading (or the document's title where the heading is
    generic), or its key term; a generic one now and then, or where neither is known."""
    topics = [heading if heading and heading.lower() not in GENERIC_HEADINGS else title, key_term(snippet)]
    topics = [t for t in topics if t and len(t) <= 80]
    if topics and rng.random() < 0.8:
        return rng.choice(TOPIC_QUESTIONS).format(topic=rng.choice(topics))
    return rng.choice(GENERIC_QUESTIONS)


def code_prompt(kind: str, snippet: str, language: str, rng: random.Random) -> str:
    instruction = rng.choice(CODE_KINDS[kind]).format(language=LANGUAGE_NAMES.get(language, language))
    return f"{instruction}\n\n```{language}\n{snippet}\n```"


def prose_prompt(kind: str, snippet: str, heading: str | None, title: str | None, rng: random.Random) -> str:
    if kind == "question":
        question = question_about(snippet, heading, title, rng)
        return f"{snippet}\n\n{question}" if rng.random() < 0.5 else f"{question}\n\n{snippet}"
    return f"{rng.choice(PROSE_KINDS[kind])}\n\n{snippet}"


def cut(lines: list[str], first: int, last: int) -> str:
    """The lines, dedented, cut at a line end within MAX_SNIPPET_CHARS ("" when the first line alone is longer:
    minified code or a data blob)."""
    snippet = textwrap.dedent("\n".join(lines[first - 1:last])).strip("\n")
    if len(snippet) > MAX_SNIPPET_CHARS:
        snippet = snippet[:max(0, snippet.rfind("\n", 0, MAX_SNIPPET_CHARS))]
    return snippet


def document_prompts(doc: Document, seed: int, per_file: int) -> list[tuple[dict, str]]:
    """(record, its snippet) of up to `per_file` prompts from one document, and one more per
    LINES_PER_EXTRA_PROMPT lines of it."""
    rng = random.Random(f"{seed}:{doc.label}")
    lines = doc.text.splitlines()
    options = code_options(doc, lines, rng) if doc.language else prose_options(lines, rng)
    found = [] if doc.language else headings(lines, doc.style)
    title = None if doc.language else document_title(lines, doc.style, found)
    prompts = []
    count = per_file + len(lines) // LINES_PER_EXTRA_PROMPT["code" if doc.language else "prose"]
    for kind, first, last in rng.sample(options, min(len(options), count)):
        snippet = cut(lines, first, last)
        if not snippet.strip():
            continue
        if doc.language:
            prompt = code_prompt(kind, snippet, doc.language, rng)
        else:
            heading = next((clean_heading(text) for i, text in reversed(found) if i < first + 2), None)
            prompt = prose_prompt(kind, snippet, heading, title, rng)
        record = {"prompt": prompt, "chat": True, "kind": kind, "source": f"{doc.label}:{first}-{last}"}
        prompts.append((record, snippet))
    return prompts


def distinctive_lines(text: str) -> list[str]:
    """Lines of 24 characters or more (stripped): enough to tell text that two sources share."""
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= 24]
