"""python -m treeserve.bench.draft_round: the drafter's host work in a round, phase by phase, without the device's.

One process loads the target (on the CPU) for its embedding, LM head and tokenizer, and the merged drafter (prompt
lookup, then a DFlash DDTree tree for the rest of each budget) whose DFlash half runs as on a GPU with CUDA graphs:
the round's inputs staged in host buffers apart from the graphs' and copied in, the block forward's rows staged and
copied into its bucket's static inputs, where the replays themselves (block forward and tree search) are stubs that
compute nothing, and the packed trees read back from the search graph's output (trees searched once, beforehand,
from random log-probs, so that reading and merging them costs what a real tree's does). The events a GPU waits on
are stubs too.

For each batch, that many requests start from --context tokens of the held-out code prompts (each from its own
place) with their target features, written into the drafter's context beforehand; then every round brings each
request the next --new-tokens tokens of that text and their feature rows, in a Draft message as the verifier sends
it (serialised; features random, as the trees and their cost do not depend on their values), and asks for a tree
of --budget nodes. A round is what the drafter service does with one message, each phase timed on its own:
`parse` (the message from its bytes, as it comes off the stream), `decode` (every item checked and its feature bytes
decoded), `extend` (the tokens and rows into each request's lookup index and DFlash context), `lookup` (prompt
lookup's chains), `stage` (the round's budgets and context rows into the graphs' inputs), `block` (the block forward's
rows staged, copied into the static inputs, the replay), `search` (the search's replay), `trees` (the packed trees
read back and unpacked), `merge` (the chains and DFlash's trees merged), `reply` (each tree's message, the response
and its bytes, with the round's bookkeeping around the items).

The phases are timed in every other round, through wrappers around the functions that do them; `whole` is the
median of the rounds in between, timed without the wrappers. Each figure is the median host microseconds over
--rounds rounds (of each kind) after --warm-up rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import types
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.settings import OneLineErrorParser

PHASES = ("parse", "decode", "extend", "lookup", "stage", "block", "search", "trees", "merge", "reply")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.draft_round", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--drafter-path", help="a DFlash checkpoint (default: the one shipped for --target)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="the drafter's and the features' (default %(default)s)")
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--budget", type=int, default=32, help="each request's tree budget (default %(default)s)")
    parser.add_argument("--max-budget", type=int, default=128, help="the drafter's max budget (default %(default)s)")
    parser.add_argument("--context", type=int, default=300, help="context tokens per request (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens each round adds (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=200,
                        help="rounds timed per cell, of each kind (default %(default)s)")
    parser.add_argument("--warm-up", type=int, default=20, help="rounds before them (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--batches is comma-separated numbers")
    if min(args.batches) < 1 or args.context < 2 or args.new_tokens < 1 or args.rounds < 1 or args.warm_up < 0:
        parser.error("--batches, --new-tokens and --rounds must be positive, --context at least 2, --warm-up not "
                     "negative")
    if not 1 <= args.budget <= args.max_budget:
        parser.error("--budget must be between 1 and --max-budget")
    return args


class NoEvent:
    """Stands in for a CUDA event: nothing to record or wait for when the device does nothing."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def stub_replay(outputs: tuple) -> object:
    """A captured graph whose replay computes nothing; its outputs are what the real one's would be read from."""
    from treeserve.models.graphs import CapturedGraph

    return CapturedGraph(types.SimpleNamespace(replay=lambda: None), outputs)


def searched_trees(batch: int, width: int, budget: int, depth: int, vocab: int, seed: int):
    """The packed trees (batch, 1 + 2 * width) a search `width` wide writes: DDTree trees of `budget` nodes (at most
    `width`) from random sorted log-probs whose sharpness varies by request and position, as a DFlash block's do."""
    import torch

    from treeserve.drafter.trees import ddtree_select

    generator = torch.Generator().manual_seed(seed)
    sharpness = 2 + 8 * torch.rand(batch, depth, 1, generator=generator)
    log_probs = torch.log_softmax(torch.randn(batch, depth, 4 * width, generator=generator) * sharpness, -1)
    top = log_probs.topk(width, dim=-1)
    starts = torch.randint(vocab, (batch, depth, 1), generator=generator)
    token_ids = (starts + 7919 * torch.arange(width)) % vocab  # distinct tokens at each position, as a top-k's
    budgets = torch.full((batch,), min(budget, width), dtype=torch.long)
    packed, _ = ddtree_select(top.values, token_ids, budgets, width)
    return packed


def stub_device_work(dflash, budget: int, seed: int) -> None:
    """The DFlash drafter's graphs as on a GPU, their replays stubs (module docstring): round inputs in host buffers
    apart from the graphs' (copied in as on a GPU), every block bucket's static inputs, and a search "graph" per
    (bucket, width) whose output holds searched trees."""
    import torch

    from treeserve.drafter.dflash import RoundInputs

    inputs = dflash.inputs
    dflash.inputs = RoundInputs(len(inputs.budgets), len(inputs.slots), dflash.feature_size, dflash.model.dtype,
                                dflash.model.device, copied_in=True)
    dflash.inputs.copied = NoEvent()
    runner = dflash.runner
    runner.static = runner._allocate_static()
    runner.staging_copied = [NoEvent() for _ in range(runner.STAGING_BUFFERS)]
    depth, vocab = dflash.model.config.block_size - 1, dflash.embedding.shape[0]
    for batch, rows in runner.buckets:
        runner.graphs[(batch, rows)] = stub_replay((torch.zeros(batch * rows, 1),))
        for width in dflash.tree_widths:
            packed = searched_trees(batch, width, budget, depth, vocab, seed + batch + width)
            dflash.search_graphs[(batch, width)] = stub_replay((packed,))
    runner.use_graphs = True


class PhaseTimers:
    """Wrappers that add up the seconds spent inside functions, by name, while installed."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.wrapped: list[tuple[object, str, object, bool]] = []  # (owner, attribute, original, was the owner's own)

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        seconds = self.seconds

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started

        own = attribute in vars(owner) if hasattr(owner, "__dict__") else False
        self.wrapped.append((owner, attribute, original, own))
        setattr(owner, attribute, timed)

    @contextlib.contextmanager
    def installed(self, servicer, merged):
        """Inside, the functions of a round's phases are timed (`seconds` starts empty)."""
        from treeserve.drafter import merged as merged_module

        self.seconds.clear()
        dflash = merged.dflash
        for owner, attribute, name in (
                (servicer, "draft_round", "draft_round"), (servicer, "check_item", "decode"),
                (merged, "extend", "extend"), (merged, "propose", "merged_propose"),
                (merged, "lookup_chain", "lookup"), (dflash, "propose", "dflash_propose"),
                (dflash, "_run_block", "run_block"), (dflash, "_stage_round", "stage"),
                (dflash, "_trees", "search"), (merged_module, "merge", "merge")):
            self.wrap(owner, attribute, name)
        try:
            yield self.seconds
        finally:
            for owner, attribute, original, own in reversed(self.wrapped):
                if own:
                    setattr(owner, attribute, original)
                else:
                    delattr(owner, attribute)
            self.wrapped.clear()


def phases_of(seconds: dict[str, float], parse: float, answer: float, serialize: float) -> dict[str, float]:
    """The round's phases (PHASES) from the wrapped functions' inclusive seconds."""
    def get(name: str) -> float:
        return seconds.get(name, 0.0)

    stage, run_block, search = get("stage"), get("run_block"), get("search")
    dflash_propose, merged_propose = get("dflash_propose"), get("merged_propose")
    return {
        "parse": parse, "decode": get("decode"), "extend": get("extend"), "lookup": get("lookup"), "stage": stage,
        "block": run_block - stage, "search": search, "trees": dflash_propose - run_block - search,
        "merge": merged_propose - get("lookup") - dflash_propose,
        "reply": answer + serialize - get("decode") - get("extend") - merged_propose,
    }


def token_stream(tokenizer, length: int) -> list[int]:
    """At least `length` tokens of the held-out code prompts, one after another (repeated as needed)."""
    from treeserve.prompt_sets import WORKLOADS, read_prompts

    tokens = []
    prompts = [record["prompt"] for record in read_prompts(WORKLOADS["code"])]
    while len(tokens) < length:
        for prompt in prompts:
            tokens += tokenizer.encode(prompt, add_special_tokens=False)
    return tokens


def measure_cell(target, merged, args, batch: int) -> dict:
    """Median host microseconds of each phase, and of whole rounds, at `batch` requests."""
    import torch

    from treeserve.drafter.server import DrafterServicer
    from treeserve.v1 import drafter_pb2
    from treeserve.wire import features_to_proto

    dflash = merged.dflash
    dtype = dflash.model.dtype
    total_rounds = args.warm_up + 2 * args.rounds
    per_request = args.context + total_rounds * args.new_tokens
    stream = token_stream(target.tokenizer, per_request + 997 * batch)
    texts = [stream[997 * i:997 * i + per_request] for i in range(batch)]  # each request from its own place
    ids = [f"r{i}" for i in range(batch)]
    generator = torch.Generator().manual_seed(args.seed + batch)

    def features(rows: int) -> torch.Tensor:
        return torch.randn(rows, dflash.feature_size, generator=generator).to(dtype)

    def message(turn: int, start: int, count: int, budget: int) -> bytes:
        request = drafter_pb2.DraftRequest(round=turn)
        for request_id, text in zip(ids, texts):
            item = request.items.add(request_id=request_id, new_token_ids=text[start:start + count], budget=budget)
            features_to_proto(features(count - (start == 0)), into=item.features)  # none for the first root
        return request.SerializeToString()

    servicer = DrafterServicer(merged, max_budget=args.max_budget)
    timers = PhaseTimers()
    samples: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "whole")}
    lookup_nodes = []
    with servicer.stream() as answer:
        answer(drafter_pb2.DraftRequest.FromString(message(0, 0, args.context, 0)))  # the prompts, untimed
        dflash.write_context()  # their rows written now (for real), not by the first round
        for turn in range(total_rounds):
            data = message(turn + 1, args.context + turn * args.new_tokens, args.new_tokens, args.budget)
            timed_phases = turn >= args.warm_up and (turn - args.warm_up) % 2 == 0
            with timers.installed(servicer, merged) if timed_phases else contextlib.nullcontext() as seconds:
                started = time.perf_counter()
                request = drafter_pb2.DraftRequest.FromString(data)
                parsed = time.perf_counter()
                response = answer(request)
                answered = time.perf_counter()
                response.SerializeToString()
                done = time.perf_counter()
            if len(response.trees) != batch:
                raise TreeserveError(f"round {turn}: {len(response.trees)} trees for {batch} requests")
            if turn < args.warm_up:
                continue
            lookup_nodes.append(statistics.mean(tree.lookup_nodes for tree in response.trees))
            if timed_phases:
                for phase, value in phases_of(seconds, parsed - started, answered - parsed, done - answered).items():
                    samples[phase].append(value * 1e6)
            else:
                samples["whole"].append((done - started) * 1e6)
    us = {phase: round(statistics.median(values), 1) for phase, values in samples.items()}
    return {"batch": batch, "lookup_nodes": round(statistics.mean(lookup_nodes), 2), "us": us}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from treeserve.drafter import load_drafter
    from treeserve.loading import load_target

    torch.set_num_threads(1)  # host work: a second intra-op thread only adds waits between threads
    try:
        target = load_target(args.target, "cpu", args.dtype)
        most = max(args.batches)
        tokens = most * (args.context + (args.warm_up + 2 * args.rounds + 2) * args.new_tokens + 64)
        merged = load_drafter("merged", args.drafter_path, target=target, device="cpu", dtype=args.dtype,
                              max_batch=most, kv_cache_tokens=tokens, max_budget=args.max_budget)
        stub_device_work(merged.dflash, args.budget, args.seed)
        rows = []
        for batch in args.batches:
            rows.append(measure_cell(target, merged, args, batch))
            print(f"draft_round: batch {batch}: " + ", ".join(
                f"{phase} {us:.1f}" for phase, us in rows[-1]["us"].items()) + " us", file=sys.stderr, flush=True)
    except TreeserveError as error:
        print(f"draft_round: error: {error}", file=sys.stderr)
        return 1
    report = {"command": " ".join(["python -m treeserve.bench.draft_round", *args.argv]), "target": args.target,
              "device": "cpu", "dtype": args.dtype, "budget": args.budget, "max_budget": args.max_budget,
              "context": args.context, "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
