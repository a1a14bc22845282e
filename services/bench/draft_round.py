"""python -m treeserve.bench.draft_round: the drafter service's host work in a round, without the device's.

One process loads the target (on the CPU, for the embedding and LM head a DFlash drafter borrows) and a DFlash or
merged drafter whose graphs are stubs: the block forward's and the tree search's "replays" compute nothing (the
search's hands back trees drafted beforehand, of the budgets the round staged), so what is timed is what the
service's thread does around them. Each round goes through the service's own door for a framed Draft stream: a
DraftRequest parsed from its bytes, its features in a feature region shared as a verifier shares one, the
servicer's `answer` (check the items, extend the contexts, propose), the reply serialised. Each request starts
with a prompt of --context tokens (rounds with prompts are not timed); every round then commits 1 to 4 tokens a
request along its tree, with their feature rows.

Phases, host microseconds a round: `launch` (from the message's bytes to the block forward's replay: parse,
checks, features, extends, prompt lookup's chains, staging), `search` (from the block replay to the search
replay), `reply` (from the search replay to the reply's bytes: the trees to the host, unpacked and merged, the
reply built and serialised) and `total`. On a GPU, `launch` and `reply` are on the round's path and `search`
runs while the device does. Medians over --rounds rounds after --warm-up.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
import types
from pathlib import Path

from treeserve.bench import host_work_rows, print_report
from treeserve.errors import TreeserveError
from treeserve.settings import OneLineErrorParser

PHASES = ("launch", "search", "reply")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.draft_round", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--drafter-path", help="a DFlash checkpoint (default: the one shipped for --target)")
    parser.add_argument("--drafters", default="merged,dflash", help="comma-separated, of merged and dflash "
                                                                    "(default %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--budget", type=int, default=32, help="each request's tree budget (default %(default)s)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=400, help="rounds timed per cell (default %(default)s)")
    parser.add_argument("--warm-up", type=int, default=40, help="rounds before them (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--batches is comma-separated numbers")
    args.drafters = args.drafters.split(",")
    if set(args.drafters) - {"merged", "dflash"}:
        parser.error("--drafters: merged, dflash or both")
    if min(args.batches) < 1 or args.budget < 1 or args.context < 2 or args.rounds < 1 or args.warm_up < 0:
        parser.error("--batches, --budget and --rounds must be positive, --context at least 2, --warm-up not "
                     "negative")
    return args


class StubReplays:
    """The drafter's graphs with replays that compute nothing: each replay's start and end are noted (`marks`),
    and the search's writes the trees drafted beforehand for the budgets the round staged."""

    def __init__(self, dflash, trees_by_budget: dict[int, tuple[list[int], list[int]]]):
        import torch

        from treeserve.models.graphs import CapturedGraph

        self.marks: list[float] = []
        runner, block = dflash.runner, dflash.model.config.block_size
        runner.static = runner._allocate_static()
        for batch, _ in runner.buckets:
            log_probs = torch.zeros(batch * block, 1)  # (the search's input on a GPU: never read here)
            runner.graphs[(batch, block)] = CapturedGraph(types.SimpleNamespace(replay=self._block), (log_probs,))
            for width in dflash.tree_widths:
                packed = torch.zeros(batch, 1 + 2 * width, dtype=torch.long)
                replay = self._search(packed, dflash.inputs.host_budgets, trees_by_budget, width)
                dflash.search_graphs[(batch, width)] = CapturedGraph(types.SimpleNamespace(replay=replay), (packed,))
        runner.use_graphs = True

    def _block(self) -> None:
        self.marks += [time.perf_counter()] * 2

    def _search(self, packed, budgets, trees_by_budget: dict[int, tuple[list[int], list[int]]], width: int):
        import torch

        rows = {budget: torch.tensor(pack(row, width)) for budget, row in trees_by_budget.items()}

        def replay() -> None:
            self.marks.append(time.perf_counter())
            for b in range(packed.shape[0]):
                packed[b] = rows[int(budgets[b])]
            self.marks.append(time.perf_counter())
        return replay


def pack(tree: tuple[list[int], list[int]], width: int) -> list[int]:
    """A tree (its drafted nodes' tokens and parents, 0 the root) as the search packs it `width` wide."""
    tokens, parents = tree
    tokens, parents = tokens[:width], parents[:width]
    padding = [0] * (width - len(tokens))
    return [len(tokens), *tokens, *padding, *parents, *padding]


def drafted_trees(budget: int, vocab: int, seed: int) -> dict[int, tuple[list[int], list[int]]]:
    """A DDTree tree of each budget 0..budget from one random block's sorted log-probs, as the search would
    give it: its drafted nodes' tokens and parents (0 the root)."""
    import torch

    from treeserve.drafter.trees import ddtree_trees

    generator = torch.Generator().manual_seed(seed)
    positions = 15
    log_probs = torch.log_softmax(torch.randn(1, positions, 4 * budget + 4, generator=generator) * 3, -1)
    top = log_probs.topk(max(budget, 1), dim=-1)
    # Distinct tokens at each position, as a position's top-k are: a random start, then steps of a prime.
    starts = torch.randint(vocab, (1, positions, 1), generator=generator)
    token_ids = (starts + 7919 * torch.arange(max(budget, 1))) % vocab
    found = {}
    for nodes in range(budget + 1):
        tree = ddtree_trees(torch.zeros(1, dtype=torch.long), top.values, token_ids, [nodes])[0]
        found[nodes] = (tree.tokens[1:], tree.parents[1:])
    return found


def measure_cell(target, kind: str, batch: int, args) -> dict:
    """Median host microseconds of each phase of `args.rounds` rounds of `batch` requests."""
    import torch

    from treeserve import framing
    from treeserve.drafter import load_drafter
    from treeserve.drafter.server import DrafterServicer
    from treeserve.feature_region import FeatureRegion, MappedRegion
    from treeserve.v1 import drafter_pb2
    from treeserve.wire import features_to_proto

    rounds = 1 + args.warm_up + args.rounds  # the first, of the prompts, is not timed
    context_tokens = batch * (args.context + 5 * rounds + 64)
    drafter = load_drafter(kind, args.drafter_path, target=target, device="cpu", dtype=args.dtype, max_batch=batch,
                           kv_cache_tokens=context_tokens, max_budget=args.budget)
    dflash = drafter.dflash if kind == "merged" else drafter
    stub = StubReplays(dflash, drafted_trees(args.budget, target.model.config.vocab_size, args.seed))
    rng = random.Random(args.seed)
    width = dflash.feature_size
    rows_source = (torch.randn(4 * batch + args.context, width) * 0.1).to(getattr(torch, args.dtype))
    region = FeatureRegion.create(64 << 20)
    if region is None:
        raise TreeserveError("draft_round needs /dev/shm for the feature region")
    mapped = MappedRegion(region.path)
    region.unlink()
    servicer = DrafterServicer(drafter, max_budget=args.budget)
    samples: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total")}

    def prompt() -> list[int]:  # a stretch that comes back, so that prompt lookup finds something
        part = [rng.randrange(1000) for _ in range(args.context // 3)]
        return (part + [rng.randrange(1000) for _ in range(args.context // 3)] + part)[:args.context]

    ids = [f"r{i}" for i in range(batch)]
    new_tokens = {request_id: prompt() for request_id in ids}
    try:
        with servicer.stream() as answer:
            for turn in range(rounds):
                region.clear()
                request = drafter_pb2.DraftRequest(round=turn)
                for request_id in ids:
                    tokens = new_tokens[request_id]
                    item = request.items.add(request_id=request_id, new_token_ids=tokens, budget=args.budget)
                    rows = len(tokens) - 1 if turn == 0 else len(tokens)
                    placed = region.place([rows_source[:rows]])
                    features_to_proto(placed if placed is not None else rows_source[:rows], into=item.features)
                payload = request.SerializeToString()
                stub.marks.clear()
                started = time.perf_counter()
                parsed = framing.parse_message(framing.MESSAGE, payload, drafter_pb2.DraftRequest)
                reply = answer(parsed, mapped).SerializeToString()
                ended = time.perf_counter()
                block_start, block_end, search_start, search_end = stub.marks[:4]
                if turn > args.warm_up:
                    times = {"launch": block_start - started, "search": search_start - block_end,
                             "reply": ended - search_end}
                    times["total"] = sum(times.values())
                    for phase, seconds in times.items():
                        samples[phase].append(seconds * 1e6)
                for tree in drafter_pb2.DraftResponse.FromString(reply).trees:
                    new_tokens[tree.request_id] = accepted(tree, rng)
    finally:
        mapped.close()
        region.close()
    return {"drafter": kind, "batch": batch, "rounds": len(samples["total"]),
            "us": {phase: round(statistics.median(values), 1) for phase, values in samples.items()}}


def accepted(tree, rng: random.Random) -> list[int]:
    """1 to 4 tokens: the tree's first children from its root down, then a token of the target's own."""
    wanted, path, node = rng.choice((1, 2, 2, 3, 3, 4)), [], 0
    parents = list(tree.parents)
    while len(path) < wanted - 1:
        child = next((i for i, parent in enumerate(parents) if parent == node and i > 0), None)
        if child is None:
            break
        path.append(tree.token_ids[child])
        node = child
    return path + [rng.randrange(1000)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = host_work_rows("draft_round", args.target, args.dtype, [
        (f"{kind}, batch {batch}", functools.partial(measure_cell, kind=kind, batch=batch, args=args))
        for kind in args.drafters for batch in args.batches])
    if rows is None:
        return 1
    report = {"command": " ".join(["python -m treeserve.bench.draft_round", *args.argv]), "target": args.target,
              "device": "cpu", "dtype": args.dtype, "budget": args.budget, "context": args.context,
              "rounds": args.rounds, "rows": rows}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
