"""python -m treeserve.bench.round_log: where each turn of a stack spent its rounds, from the verifier's log.

Run a stack with TREESERVE_VERIFIER_LOG_LEVEL=DEBUG (bench_stacks keeps each stack's logs in its --out-dir, the
verifier's in runtime-<drafter>/verifier.log): the verifier then logs every round in one line
(`RoundReport.log_line`). This reads those lines back, from a log or a gzipped one, and splits them into turns: a
turn is a run of rounds of one mode, since plain decoding's rounds carry no choice and adaptive speculation's
carry one (`treeserve bench` runs one mode's turn at a time, its warm-up's turns first); a round of prompts alone
has no choice in either mode and goes with the round after it. For each turn of at least
--min-rounds rounds it reports the rounds, their mean batch, the tokens, the rounds' summed time and the turn's
span on the clock, and the rounds by kind: plain, prompt lookup's trees alone, the drafter's own trees, each split
by whether it caught the drafters' contexts up (`*`) and whether prompts joined its forward (`+prompts`), with
what the choice expected of them (tokens, and the median round's time) beside what they took. Turns of one load
follow each other, the plain turn first: compare a speculative turn with the plain turn just before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import re
import statistics
import sys
from pathlib import Path

from treeserve.bench import print_report
from treeserve.settings import OneLineErrorParser

LINE = re.compile(
    r"round of batch (?P<batch>\d+), choice (?P<label>\S+): (?P<tokens>\d+) tokens in (?P<ms>[\d.]+) ms"
    r"(?: \(expected (?:-|(?P<expected_tokens>[\d.]+) in (?P<expected_ms>[\d.]+))\))?"  # (older logs: none)
    r", of them drafters (?P<drafters_ms>[\d.]+) ms(?P<catch_up> \(catch-up\))?(?P<prompts> \(with prompts\))?; "
    r"choice and messages (?P<messages_ms>[\d.]+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")  # the services' logging format's asctime


@dataclasses.dataclass
class LoggedRound:
    at: float | None  # seconds since the epoch where the line has its time
    batch: int
    label: str  # the choice's label: '-' without a choice (plain decoding's turn)
    tokens: int
    ms: float
    expected_tokens: float | None
    expected_ms: float | None
    drafters_ms: float
    messages_ms: float  # the choice and the Draft messages
    catch_up: bool
    prompts: bool

    @property
    def kind(self) -> str:
        base = "plain" if self.label in ("-", "0") else "lookup" if self.label.startswith("lookup-") else "own"
        return base + ("*" if self.catch_up else "") + ("+prompts" if self.prompts else "")


def read_rounds(path: Path) -> list[LoggedRound]:
    """The rounds a verifier's log holds, in order."""
    opener = gzip.open if path.suffix == ".gz" else open
    rounds = []
    with opener(path, "rt", errors="replace") as lines:
        for line in lines:
            found = LINE.search(line)
            if found is None:
                continue
            stamp = STAMP.match(line)
            at = (datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() if stamp else None)
            expected = (float(found["expected_tokens"]), float(found["expected_ms"])) if found["expected_ms"] else (
                None, None)
            rounds.append(LoggedRound(at, int(found["batch"]), found["label"], int(found["tokens"]),
                                      float(found["ms"]), *expected, float(found["drafters_ms"]),
                                      float(found["messages_ms"]), found["catch_up"] is not None,
                                      found["prompts"] is not None))
    return rounds


def turns(rounds: list[LoggedRound]) -> list[list[LoggedRound]]:
    """Runs of consecutive rounds of one mode: without a choice (plain decoding's turn) or with one. A round of
    prompts alone has no choice in either mode (no request has a token to draft from yet): it goes with the round
    after it, in its turn or at the start of the next."""
    found: list[list[LoggedRound]] = []
    pending: list[LoggedRound] = []  # rounds of prompts alone, waiting for a round with a mode
    for logged in rounds:
        if logged.label == "-" and logged.prompts:
            pending.append(logged)
        elif found and (found[-1][-1].label == "-") == (logged.label == "-"):
            found[-1] += [*pending, logged]
            pending = []
        else:
            found.append([*pending, logged])
            pending = []
    if pending:
        found.append(pending)
    return found


def summarize(turn: list[LoggedRound]) -> dict:
    tokens, ms = sum(r.tokens for r in turn), sum(r.ms for r in turn)
    span_ms = (turn[-1].at - turn[0].at) * 1e3 + turn[-1].ms if turn[0].at is not None else None
    kinds = {}
    for kind in sorted({r.kind for r in turn}):
        of_kind = [r for r in turn if r.kind == kind]
        entry = {"rounds": len(of_kind), "tokens": sum(r.tokens for r in of_kind),
                 "ms": round(sum(r.ms for r in of_kind), 3),
                 "median_ms": round(statistics.median(r.ms for r in of_kind), 3),
                 "median_messages_ms": round(statistics.median(r.messages_ms for r in of_kind), 3),
                 "median_drafters_ms": round(statistics.median(r.drafters_ms for r in of_kind), 3)}
        estimated = [r for r in of_kind if r.expected_ms is not None]
        if estimated and kind != "plain":
            entry["expected"] = {"rounds": len(estimated),
                                 "tokens": round(statistics.fmean(r.expected_tokens for r in estimated), 2),
                                 "median_ms": round(statistics.median(r.expected_ms for r in estimated), 3)}
            entry["took"] = {"tokens": round(statistics.fmean(r.tokens for r in estimated), 2),
                             "median_ms": round(statistics.median(r.ms for r in estimated), 3)}
        kinds[kind] = entry
    return {"mode": "plain" if all(r.label == "-" for r in turn) else "speculative", "rounds": len(turn),
            "mean_batch": round(statistics.fmean(r.batch for r in turn), 2), "tokens": tokens,
            "rounds_ms": round(ms, 3), "span_ms": None if span_ms is None else round(span_ms, 3),
            "tokens_per_ms": round(tokens / ms, 3) if ms else None, "kinds": kinds}


def describe(turn: dict) -> str:
    span = f", {turn['span_ms']:.0f} ms on the clock" if turn["span_ms"] is not None else ""
    head = (f"{turn['mode']}: {turn['rounds']} rounds, batch {turn['mean_batch']:.1f}, {turn['tokens']} tokens in "
            f"{turn['rounds_ms']:.1f} ms of rounds{span} ({turn['tokens_per_ms']} a ms)")
    parts = []
    for kind, entry in turn["kinds"].items():
        part = (f"  {kind}: {entry['rounds']} rounds, {entry['tokens']} tokens, {entry['ms']:.1f} ms (median "
                f"{entry['median_ms']:.3f}: drafters {entry['median_drafters_ms']:.3f}, choice and messages "
                f"{entry['median_messages_ms']:.3f})")
        if "expected" in entry:
            part += (f"; expected {entry['expected']['tokens']:.2f} tokens in {entry['expected']['median_ms']:.3f}"
                     f" ms, took {entry['took']['tokens']:.2f} in {entry['took']['median_ms']:.3f}")
        parts.append(part)
    return "\n".join([head, *parts])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.round_log", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="verifier logs written at DEBUG (.gz read as gzip)")
    parser.add_argument("--min-rounds", type=int, default=100,
                        help="report turns of at least this many rounds (default %(default)s: a warm-up's turns "
                             "are shorter than a timed one's)")
    parser.add_argument("--out", type=Path, help="write the turns here as JSON")
    args = parser.parse_args(argv)
    report = {"command": " ".join(["python -m treeserve.bench.round_log", *(argv or sys.argv[1:])]), "logs": []}
    for path in args.logs:
        if not path.is_file():
            parser.error(f"no such log: {path}")
        rounds = read_rounds(path)
        if not rounds:
            parser.error(f"{path} has no round lines: was the verifier run with TREESERVE_VERIFIER_LOG_LEVEL=DEBUG?")
        summaries = [summarize(turn) for turn in turns(rounds) if len(turn) >= args.min_rounds]
        print(f"== {path}: {len(rounds)} rounds, {len(summaries)} turns of at least {args.min_rounds}",
              file=sys.stderr)
        for summary in summaries:
            print(describe(summary), file=sys.stderr)
        report["logs"].append({"log": path.name, "rounds": len(rounds), "turns": summaries})
    if args.out:
        print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
