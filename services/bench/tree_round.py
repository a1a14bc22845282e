"""python -m treeserve.bench.tree_round: the verifier's host work in a round, phase by phase, without the device's.

One process loads the target (on the CPU) and a verifier whose runner stages every forward as on a GPU with CUDA
graphs: padded to its (batch, tree size) bucket and copied into the bucket's static inputs, where the replay
itself is a stub that computes nothing. For each budget (0: plain rounds) and batch, that many requests are
prefilled with random prompts of --context tokens, then take rounds the way the verifier's `speculative_round`
takes them, each phase timed on its own: the DraftTree objects made from the drafter's reply (`trees`), the
round's Draft message as DrafterLink builds it (`messages`: the kept target features' rows, from the host copies of
the last round's drafted trees and from the pool where a round before was plain, written to a feature region as for
a drafter on this host, and the message's items), the plans (`plan`), the forward's host work (`forward`:
bucket, staging, copies into the static inputs, the outputs' rows), the commit (`commit`: the walk, the stop
checks, the KV kept, the features kept) and the emit (`emit`: the stream's messages and the round's report).

Trees are DDTree trees (treeserve.drafter.trees.ddtree_trees) from random sorted log-probs of a DFlash block's
positions, a new tree for every request and round, so that hardly two have one shape. The target's picks are
drawn instead of computed: at each node of the walk, with probability --accept one of its children (its first,
the drafter's likeliest, more often than the others), else a token none of them holds. In tree rounds requests
keep the target features of --feature-layers, as a verifier linked to a DFlash or merged drafter has them keep
them; with --plain-keeps, plain rounds keep them too, as adaptive speculation's requests do between trees (in the
pool, which on a GPU the graphs write: no host work).

Each figure is the median host microseconds of a phase over --rounds rounds after --warm-up rounds; `total` is
the median of the rounds' sums and `total_mean` their mean, which counts work done once every few rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

PHASES = ("trees", "messages", "plan", "forward", "commit", "emit")
BLOCK_POSITIONS = 15  # drafted positions of a DFlash block (the shipped drafter's block_size 16, minus the root)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.tree_round", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--budgets", default="0,16,32",
                        help="comma-separated tree budgets, 0 for plain rounds (default %(default)s)")
    parser.add_argument("--feature-layers", default="1,14,27",
                        help="target layers whose features tree rounds keep, comma-separated, empty for none "
                             "(default %(default)s: the shipped SmolLM2 DFlash drafter's)")
    parser.add_argument("--plain-keeps", action="store_true",
                        help="plain rounds (budget 0) keep the features too, as adaptive speculation's requests do")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request (default %(default)s)")
    parser.add_argument("--accept", type=float, default=0.8,
                        help="probability that the walk goes on at each node (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=200, help="rounds timed per cell (default %(default)s)")
    parser.add_argument("--warm-up", type=int, default=20, help="rounds before them (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.budgets = [int(b) for b in args.budgets.split(",")]
        args.feature_layers = tuple(int(layer) for layer in args.feature_layers.split(",") if layer)
    except ValueError:
        parser.error("--batches, --budgets and --feature-layers are comma-separated numbers")
    if min(args.batches) < 1 or min(args.budgets) < 0 or args.context < 1 or args.rounds < 1 or args.warm_up < 0:
        parser.error("--batches, --context and --rounds must be positive, --budgets and --warm-up not negative")
    if not 0 <= args.accept < 1:
        parser.error("--accept must be in [0, 1)")
    return args


def draft_trees(count: int, budget: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`count` DDTree trees of `budget` drafted nodes (tokens, parents; root 0, set per round), from random sorted
    log-probs whose sharpness varies by tree and position, as a DFlash block's do (at budget 32: about 4 children
    under the root and 7 levels deep, on average)."""
    import torch

    from treeserve.drafter.trees import ddtree_trees

    generator = torch.Generator().manual_seed(seed)
    trees, chunk = [], 256
    for start in range(0, count, chunk):
        size = min(chunk, count - start)
        width = max(budget, 2) * 4
        sharpness = 2 + 8 * torch.rand(size, BLOCK_POSITIONS, 1, generator=generator)
        log_probs = torch.log_softmax(torch.randn(size, BLOCK_POSITIONS, width, generator=generator) * sharpness, -1)
        top = log_probs.topk(budget, dim=-1)
        # Distinct tokens at each position, as a position's top-k are: a random start, then steps of a prime.
        starts = torch.randint(vocab, (size, BLOCK_POSITIONS, 1), generator=generator)
        token_ids = (starts + 7919 * torch.arange(budget)) % vocab
        found = ddtree_trees(torch.zeros(size, dtype=torch.long), top.values, token_ids, [budget] * size)
        trees += [(tree.tokens, tree.parents) for tree in found]
    return trees


def picks(tree, rng: random.Random, accept: float, vocab: int) -> list[int]:
    """The target's pick at every node of `tree`: along a walk that goes on into a child with probability
    `accept` (the first child, the drafter's likeliest, 70 % of the time), else ends on a token no child holds; 0
    elsewhere."""
    children: list[list[int]] = [[] for _ in range(tree.size)]
    for node in range(1, tree.size):
        children[tree.parents[node]].append(node)
    chosen, node = [0] * tree.size, 0
    while True:
        below = children[node]
        if below and rng.random() < accept:
            child = below[0] if len(below) == 1 or rng.random() < 0.7 else rng.choice(below[1:])
            chosen[node] = tree.tokens[child]
            node = child
            continue
        held, token = {tree.tokens[child] for child in below}, rng.randrange(vocab)
        while token in held:
            token = rng.randrange(vocab)
        chosen[node] = token
        return chosen


@contextlib.contextmanager
def device_work_stubbed(verifier, feature_layer_ids: tuple[int, ...]):
    """Inside, the verifier's runner stages and loads every forward as it would for CUDA graphs, with replays that
    compute nothing (static inputs at the maxima, one "graph" per bucket whose outputs are preallocated), and the
    pool's KV moves are made ready as on the CPU but not done (on a GPU, a kernel's work). The forward's features
    are one column a layer: each round's copy of a drafted tree's rows is the device's on a GPU (here a host copy);
    rows gathered from the pool are at their real width, a gather on the device and a copy to the host on a GPU."""
    import torch

    from treeserve.models import paged_kv
    from treeserve.models.graphs import CapturedGraph

    runner = verifier.runner
    runner.static = runner._allocate_static()
    width = len(feature_layer_ids)
    for batch, rows in runner.buckets:
        outputs = (torch.zeros(batch * rows, 1),
                   torch.zeros(batch * rows, width, dtype=verifier.model.dtype) if width else None)
        runner.graphs[(batch, rows)] = CapturedGraph(types.SimpleNamespace(replay=lambda: None), outputs)
    runner.use_graphs = True
    verifier.captured_features = verifier.feature_layer_ids = tuple(feature_layer_ids)
    move = paged_kv.kv_move_reference
    paged_kv.kv_move_reference = lambda cache, sources, targets: None
    try:
        yield
    finally:
        paged_kv.kv_move_reference = move


def measure_cell(target, args, budget: int, batch: int) -> dict:
    """Median host microseconds of each phase of `args.rounds` rounds of `batch` requests at `budget`."""
    import torch

    from treeserve.params import GenerationParams
    from treeserve.verifier.engine import FeatureCopies, Generation, commit_round, forward_batch
    from treeserve.verifier.graphs import build_verifier

    model, cfg = target.model, target.model.config
    total_rounds = args.warm_up + args.rounds
    # The prefill's token, every round's most, and one to spare: no request finishes before its rounds do.
    max_new = total_rounds * (min(budget, BLOCK_POSITIONS) + 1) + 2
    layers = args.feature_layers if budget or args.plain_keeps else ()
    verifier = build_verifier(model, batch, kv_cache_tokens=batch * (args.context + max_new + budget + 16))
    verifier.keep_features(layers)
    rng = random.Random(args.seed)
    generations = [Generation(model, target.tokenizer, [rng.randrange(cfg.vocab_size) for _ in range(args.context)],
                              GenerationParams(max_new_tokens=max_new, ignore_eos=True), None, budget, layers,
                              verifier=verifier) for _ in range(batch)]
    copies = FeatureCopies()
    try:
        with torch.inference_mode():
            plans = [generation.plan(None) for generation in generations]  # the prefills, for real
            logits, features = forward_batch(model, plans, layers, verifier)
            commit_round(generations, plans, logits, features, copies)
        trees = draft_trees(batch * total_rounds, budget, cfg.vocab_size, args.seed) if budget else []
        with device_work_stubbed(verifier, layers), torch.inference_mode():
            samples, accepted = timed_rounds(model, verifier, generations, copies, trees, layers, rng, args)
    finally:
        for generation in generations:
            generation.release()
    us = {phase: round(statistics.median(values), 1) for phase, values in samples.items()}
    us["total_mean"] = round(statistics.mean(samples["total"]), 1)
    return {"budget": budget, "batch": batch, "accepted_nodes": round(statistics.mean(accepted), 3), "us": us}


def timed_rounds(model, verifier, generations: list, copies, trees: list, layers: tuple[int, ...],
                 rng: random.Random, args) -> tuple[dict[str, list[float]], list[float]]:
    """The rounds, as `speculative_round` takes them: each timed round's microseconds by phase (and in all), and
    its mean accepted nodes a request."""
    from treeserve.feature_region import FeatureRegion
    from treeserve.tree import MAX_BUDGET
    from treeserve.v1 import drafter_pb2, verifier_pb2
    from treeserve.verifier import round as rounds
    from treeserve.verifier.drafter_link import DrafterLink
    from treeserve.verifier.engine import commit_round, forward_batch

    vocab, batch = model.config.vocab_size, len(generations)
    # A merged drafter's link on this host (its trees say how long their lookup chain is), never connected: the
    # messages are built, not sent. (Its channel wants an event loop to be made in.)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    link = DrafterLink("unix:///nowhere.sock", timeout_s=1.0)
    link.lookup_trees, link.max_budget, link.feature_layer_ids = True, MAX_BUDGET, tuple(layers)
    link.region = FeatureRegion.create(64 << 20) if layers else None
    if link.region is not None:
        link.region.unlink()
    outboxes = [asyncio.Queue() for _ in generations]
    ids = [f"r{i}" for i in range(batch)]
    requests = dict(zip(ids, generations))
    samples: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total")}
    accepted = []
    for turn in range(args.warm_up + args.rounds):
        reply = drafter_pb2.DraftResponse(round=turn)
        for i, generation in enumerate(generations if trees else ()):
            tokens, parents = trees[turn * batch + i]
            reply.trees.add(request_id=ids[i], token_ids=[generation.output_ids[-1]] + tokens[1:], parents=parents)
        reply = drafter_pb2.DraftResponse.FromString(reply.SerializeToString())  # as it comes off the stream
        started = time.perf_counter()
        found = {tree.request_id: link._tree(tree, False) for tree in reply.trees}
        built = time.perf_counter()
        if trees:
            copies.wait()
            link._messages(requests, {}, {request_id: len(tree.tokens) - 1 for request_id, tree in found.items()})
        flushed = time.perf_counter()
        plans = [rounds.plan(ids[i], generation, found.get(ids[i])) for i, generation in enumerate(generations)]
        planned = time.perf_counter()
        logits, features = forward_batch(model, plans, layers, verifier)
        features = copies.prepare(features, plans, [generation.features.keep for generation in generations])
        forwarded = time.perf_counter()
        choices = [picks(plan.tree, rng, args.accept, vocab) for plan in plans]  # the device's, not timed
        picked = time.perf_counter()
        committed = commit_round(generations, plans, logits, features, copies, choices)
        done = time.perf_counter()
        report = rounds.RoundReport(batch, None, {}, [])
        for request_id, generation, plan, tokens, outbox in zip(ids, generations, plans, committed, outboxes):
            outbox.put_nowait(verifier_pb2.VerifierServiceGenerateResponse(token_ids=tokens))
            if generation.finished:
                outbox.put_nowait(rounds.final_message(generation))
            report.requests.append(rounds.request_report(request_id, plan, generation, tokens))
        report.forward_batch = len(plans)
        report.largest_tree = max((plan.tree.size for plan in plans if plan.tree is not None), default=0)
        report.with_prompts = any(plan.tree is None for plan in plans)
        emitted = time.perf_counter()
        for outbox in outboxes:
            while not outbox.empty():
                outbox.get_nowait()
        if any(generation.finished for generation in generations):
            raise TreeserveError("a request finished before its rounds did")
        if turn < args.warm_up:
            continue
        times = {"trees": built - started, "messages": flushed - built, "plan": planned - flushed,
                 "forward": forwarded - planned, "commit": done - picked, "emit": emitted - done}
        times["total"] = sum(times.values())
        for phase, seconds in times.items():
            samples[phase].append(seconds * 1e6)
        accepted.append(statistics.mean(request.accepted for request in report.requests))
    if link.region is not None:
        link.region.close()
    loop.run_until_complete(link.channel.close())
    asyncio.set_event_loop(None)
    loop.close()
    return samples, accepted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = host_work_rows("tree_round", args.target, args.dtype, [
        (f"budget {budget}, batch {batch}", functools.partial(measure_cell, args=args, budget=budget, batch=batch))
        for budget in args.budgets for batch in args.batches])
    if rows is None:
        return 1
    report = {"command": " ".join(["python -m treeserve.bench.tree_round", *args.argv]), "target": args.target,
              "device": "cpu", "dtype": args.dtype, "feature_layers": list(args.feature_layers),
              "plain_keeps": args.plain_keeps,
              "accept": args.accept, "rounds": args.rounds, "rows": rows}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
