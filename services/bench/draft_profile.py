"""python -m treeserve.bench.draft_profile: where a DFlash drafter's round goes, in process.

For each tree size limit (the drafter's max budget) and batch size, requests with a context of --context tokens
each take rounds of --new-tokens accepted tokens: the host time of each step of a round, each step timed on its
own (the device synchronised before and after it), and the device time of one replay of the block graph
(context write and block forward) and of the tree search's at the round's width (the narrowest that holds
--budget) and at the widest, with the host time of each replay's call (`*_launch`). Trees and their cost do not
depend on the features' values, so the features are random; the target supplies the embedding and the LM head.
Medians over --repeats, in ms.

With --trace DIR, each cell then records --trace-rounds DFlash proposals under torch's profiler: a
Chrome trace per cell in DIR, and per cell in the results the medians of what a proposal's timeline holds (its
host span, the device's busy time within it, when the device's first work began, and the CUDA runtime calls by
name), which tell the host's share of a round from the device's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError

STEPS = ("extend", "propose_merged", "propose", "block_and_trees", "trees_to_host")
DEVICE_STEPS = ("block_device", "search_device", "search_device_widest")  # replays, timed on the GPU
LAUNCH_STEPS = ("block_launch", "search_launch", "search_launch_widest")  # the same replays' calls, on the host
# Host steps of a DFlash proposal, each timed where it is called: (step, owner, attribute) of the wrapped function.
SPLIT_STEPS = (
    ("split_inputs_stage", "treeserve.drafter.dflash:RoundInputs", "stage"),
    ("split_rows_stage", "treeserve.models.graphs", "_stage_into"),
    ("split_rows_buffer", "treeserve.models.graphs:PagedRunner", "_staging"),
    ("split_copy_in", "treeserve.models.graphs:TreeRows", "copy_into"),
    ("split_event", "treeserve.models.graphs:PagedRunner", "_copied"),
    ("split_replays", "torch.cuda:CUDAGraph", "replay"),
    ("split_unpack", "treeserve.drafter.dflash", "unpack_trees"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.draft_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--drafter-path", help="a DFlash checkpoint (default: the one shipped for --target)")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--max-budgets", default="32,128", help="comma-separated drafter max budgets (default %(default)s)")
    parser.add_argument("--budget", type=int, default=32, help="each request's budget (default %(default)s)")
    parser.add_argument("--context", type=int, default=300, help="context tokens per request (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens each round adds (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=30, help="rounds timed per cell (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--trace", type=Path, help="record each cell's proposals under torch's profiler into this "
                                                   "folder")
    parser.add_argument("--trace-rounds", type=int, default=10, help="proposals traced per cell (default %(default)s)")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.max_budgets = [int(b) for b in args.max_budgets.split(",")]
    except ValueError:
        parser.error("--batches and --max-budgets are comma-separated numbers")
    if min(args.batches) < 1 or args.context < 2 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--batches, --new-tokens and --repeats must be positive, --context at least 2")
    if not 0 <= args.budget <= min(args.max_budgets):
        parser.error("--budget must be between 0 and the smallest --max-budgets")
    if args.trace and args.trace_rounds < 1:
        parser.error("--trace-rounds must be positive")
    return args


def profile_cell(merged, batch: int, args, torch) -> dict:
    """Median milliseconds of each step over args.repeats repeats of three rounds of `batch` requests: one
    timing the extends and then the merged drafter's whole proposal, one the DFlash drafter's proposal alone,
    one its block forward and trees (context write, block, search) and the trees' copy to the host apart."""
    from treeserve.drafter.trees import unpack_trees

    dflash, cuda = merged.dflash, args.device == "cuda"
    vocab = dflash.embedding.shape[0]
    generator = torch.Generator().manual_seed(batch)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def extend_all(new_tokens: int) -> float:
        rounds = [(torch.randint(0, vocab, (new_tokens,), generator=generator).tolist(),
                   torch.randn(new_tokens - (not context.tokens), dflash.feature_size,
                               generator=generator).to(dflash.model.dtype)) for context in contexts]
        sync()
        started = time.perf_counter()
        for context, (tokens, features) in zip(contexts, rounds):
            merged.extend(context, tokens, features)
        return time.perf_counter() - started

    def timed(step) -> float:
        sync()
        started = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - started

    contexts = [merged.new_context() for _ in range(batch)]
    inner = [context.dflash for context in contexts]
    budgets = [args.budget] * batch
    extend_all(args.context)
    merged.propose(contexts, budgets)  # first use: kernels compile, shapes warm up
    width = dflash.width_for(args.budget)
    times: dict[str, list[float]] = {step: [] for step in (*STEPS, *DEVICE_STEPS, *LAUNCH_STEPS)}
    for _ in range(args.repeats):
        times["extend"].append(extend_all(args.new_tokens))
        times["propose_merged"].append(timed(lambda: merged.propose(contexts, budgets)))
        extend_all(args.new_tokens)
        times["propose"].append(timed(lambda: dflash.propose(inner, budgets)))
        extend_all(args.new_tokens)
        packed = []
        times["block_and_trees"].append(timed(
            lambda: packed.append(dflash._trees(dflash._run_block(inner, budgets), width)[:batch])))
        times["trees_to_host"].append(timed(lambda: unpack_trees([c.tokens[-1] for c in inner], packed[0].tolist())))
        replays = replay_seconds(dflash, batch, width, torch) if cuda else (0.0,) * 2 * len(DEVICE_STEPS)
        for step, seconds in zip(DEVICE_STEPS + LAUNCH_STEPS, replays):
            times[step].append(seconds)
    result = {step: round(statistics.median(values) * 1000, 3) for step, values in times.items()}
    result.update(host_split(lambda: (extend_all(args.new_tokens), sync()), lambda: dflash.propose(inner, budgets),
                             args.repeats))
    if args.trace:
        def one_round():
            extend_all(args.new_tokens)
            sync()
            with torch.profiler.record_function("propose"):
                dflash.propose(inner, budgets)
            sync()

        path = args.trace / f"trace-max{dflash.max_budget}-batch{batch}.json.gz"
        result["timeline"] = traced_rounds(one_round, args.trace_rounds, path, cuda, torch)
    for context in contexts:
        merged.release(context)
    return result


def host_split(prepare, propose, repeats: int) -> dict:
    """Median ms a proposal of each SPLIT_STEPS step (its calls' total) and of the whole `propose`, each step timed
    by a wrapper around its function for these rounds only (`prepare` runs before each, untimed)."""
    import functools
    import importlib

    spent: dict[str, float] = {}

    def timer(step, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[step] = spent.get(step, 0.0) + time.perf_counter() - started
        return timed

    wrapped = []
    for step, where, name in SPLIT_STEPS:
        module, _, owner = where.partition(":")
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        wrapped.append((holder, name, holder.__dict__[name]))
        setattr(holder, name, timer(step, holder.__dict__[name]))
    totals: dict[str, list[float]] = {step: [] for step, _, _ in SPLIT_STEPS}
    totals["split_propose"] = []
    try:
        for _ in range(repeats):
            prepare()
            spent.clear()
            started = time.perf_counter()
            propose()
            totals["split_propose"].append(time.perf_counter() - started)
            for step, _, _ in SPLIT_STEPS:
                totals[step].append(spent.get(step, 0.0))
    finally:
        for holder, name, function in wrapped:
            setattr(holder, name, function)
    return {step: round(statistics.median(values) * 1000, 4) for step, values in totals.items()}


def traced_rounds(one_round, rounds: int, path: Path, cuda: bool, torch) -> dict:
    """Run `one_round` (which marks its proposal "propose") `rounds` times under torch's profiler; writes the
    Chrome trace to `path` (gzipped) and returns the medians of what each proposal's timeline holds."""
    from treeserve.round_traces import export_trace, timeline_medians, timeline_of

    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    one_round()  # outside the trace: the profiler's own first-use costs stay out of it
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(rounds):
            one_round()
    return timeline_medians(timeline_of(export_trace(profiler, path), "propose"))


def replay_seconds(dflash, batch: int, width: int, torch) -> tuple[float, ...]:
    """Device time of one replay of the block graph that holds `batch` requests, then of its bucket's search
    graph at `width` and at the widest (DEVICE_STEPS); then the host time of each replay's call, the device idle
    before it (LAUNCH_STEPS)."""
    bucket = dflash.runner.bucket(batch, dflash.model.config.block_size)
    graphs = (dflash.runner.graphs[bucket], dflash.search_graphs[(bucket[0], width)],
              dflash.search_graphs[(bucket[0], dflash.tree_widths[-1])])
    device, host = [], []
    for captured in graphs:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        called = time.perf_counter()
        captured.graph.replay()
        host.append(time.perf_counter() - called)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1000)
    return (*device, *host)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch

        from treeserve.drafter import load_drafter
        from treeserve.loading import load_target

        target = load_target(args.target, device=args.device, dtype=args.dtype)
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
        rows = []
        for max_budget in args.max_budgets:
            merged = load_drafter("merged", args.drafter_path, target=target, device=args.device, dtype=args.dtype,
                                  max_batch=max(args.batches), graphs=args.device == "cuda", max_budget=max_budget)
            for batch in args.batches:
                rows.append({"max_budget": max_budget, "batch": batch, "ms": profile_cell(merged, batch, args, torch)})
                print(json.dumps(rows[-1]), flush=True)
    except TreeserveError as error:
        print(f"draft_profile: error: {error}", file=sys.stderr)
        return 1
    report = {"command": " ".join(["python -m treeserve.bench.draft_profile", *args.argv]), "target": args.target,
              "device": args.device, "dtype": args.dtype, "budget": args.budget, "context": args.context,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
