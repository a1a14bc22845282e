"""python -m treeserve.bench.transport_bench: what one verifier -> drafter -> verifier round trip costs.

Starts an n-gram drafter as its own process on a Unix socket (or uses --drafter ADDRESS) and drives the real
DrafterLink through rounds of synthetic requests: each round every request commits a few new tokens and asks
for a tree of --budget nodes. Transport is the round trip minus the drafter's own compute, which it reports in
each response. Prints one table row per batch size and writes the figures as JSON with --out.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.cli.launcher import Stack
from treeserve.telemetry import percentile


class SyntheticRequest:
    """What DrafterLink reads from a Generation: committed tokens, the last round's accepted tokens and the budget."""

    def __init__(self, rng: random.Random, prompt_tokens: int, budget: int, vocab: int = 49152):
        # A repeating pattern, so the n-gram drafter finds matches and returns full trees.
        pattern = [rng.randrange(vocab) for _ in range(32)]
        self.tokens = [pattern[i % len(pattern)] for i in range(prompt_tokens)]
        self.budget = budget
        self.rng = rng
        self.last_accepted = 0

    @property
    def committed_count(self) -> int:
        return len(self.tokens)

    def committed_since(self, start: int) -> list[int]:
        return self.tokens[start:]

    def commit(self) -> None:
        """A round's worth of accepted tokens (1 to 4), continuing the pattern."""
        accepted = self.rng.randint(1, 4)
        for _ in range(accepted):
            self.tokens.append(self.tokens[-32])
        self.last_accepted = accepted - 1


async def measure(address: str, batch: int, rounds: int, warmup: int, budget: int, prompt_tokens: int) -> dict:
    from treeserve.verifier.drafter_link import DrafterLink

    link = DrafterLink(address, timeout_s=10.0)
    if not await link.connect():
        raise TreeserveError(f"no drafter answered at {address}")
    rng = random.Random(batch)
    requests = {f"r{i}": SyntheticRequest(rng, prompt_tokens, budget) for i in range(batch)}
    transport, round_trip, propose, sent, received = [], [], [], [], []
    try:
        for index in range(warmup + rounds):
            found = await link.draft(requests, {})
            if len(found.trees) != batch:
                raise TreeserveError(f"round {index}: {len(found.trees)} trees for {batch} requests")
            if index >= warmup:
                round_trip.append(found.round_trip_s)
                propose.append(found.propose_s)
                transport.append(found.round_trip_s - found.propose_s)
                sent.append(found.request_bytes)
                received.append(found.response_bytes)
            for request in requests.values():
                request.commit()
    finally:
        await link.close()
    us = 1e6
    return {"batch": batch, "rounds": rounds, "budget": budget,
            "request_bytes": statistics.mean(sent), "response_bytes": statistics.mean(received),
            "transport_p50_us": percentile(transport, 50) * us, "transport_p99_us": percentile(transport, 99) * us,
            "round_trip_p50_us": percentile(round_trip, 50) * us, "round_trip_p99_us": percentile(round_trip, 99) * us,
            "drafter_compute_p50_us": percentile(propose, 50) * us}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.transport_bench", description=__doc__)
    parser.add_argument("--drafter", help="a running drafter's address (default: start one on a Unix socket)")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--rounds", type=int, default=2000, help="measured rounds per batch size (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="rounds before measuring (default 200)")
    parser.add_argument("--budget", type=int, default=16, help="tree nodes asked per request (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="context sent on a request's first round")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch: {args.batch!r} is not a comma-separated list of numbers")
    from treeserve import serving

    with tempfile.TemporaryDirectory(prefix="treeserve-bench-") as folder:
        stack = Stack(Path(folder))  # a drafter of our own, unless --drafter names one
        try:
            if args.drafter:
                address = serving.normalize_address(args.drafter)
            else:
                address = stack.start("drafter", ["--kind", "ngram", "--log-level", "WARNING"])
                stack.wait_serving(timeout_s=120)
            results = []

            async def run_all():
                for batch in batches:
                    results.append(await measure(address, batch, args.rounds, args.warmup, args.budget,
                                                 args.prompt_tokens))

            serving.run(run_all())
        except TreeserveError as error:
            print(f"transport_bench: error: {error}", file=sys.stderr)
            return 1
        finally:
            stack.stop(grace_s=1)
    print("| batch | request bytes | response bytes | transport p50 (us) | transport p99 (us) "
          "| round trip p50 (us) | round trip p99 (us) | drafter compute p50 (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['request_bytes']:.0f} | {r['response_bytes']:.0f} | {r['transport_p50_us']:.0f} "
              f"| {r['transport_p99_us']:.0f} | {r['round_trip_p50_us']:.0f} | {r['round_trip_p99_us']:.0f} "
              f"| {r['drafter_compute_p50_us']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python -m treeserve.bench.transport_bench",
                                                             *(argv if argv is not None else sys.argv[1:])]),
                                        "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
