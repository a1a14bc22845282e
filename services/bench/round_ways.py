"""python -m treeserve.bench.round_ways: what a round costs in process, against the same round through the verifier's
scheduler, behind its gRPC stream and through the three services.

One process loads the target and its verifier (CUDA graphs on a GPU) once, then, turn after turn, decodes
--max-new-tokens tokens of one prompt (EOS ignored) each way of --ways:
- `in_process`: `Generation.step` in a loop, as `treeserve generate` runs it (with --drafter, its drafter in the
  same process, loaded as `generate` loads it);
- `scheduler`: the verifier's scheduler fed a request directly, its stream read from the request's queue (the
  scheduler's loop, no gRPC; plain decoding only);
- `grpc`: the verifier service's Generate stream read by a client in another process (plain decoding only);
- `services`: drafter, verifier and gateway started as `treeserve up` starts them (`--drafter auto`, the default
  stack, for plain decoding; the --drafter at a fixed --budget otherwise), the gateway's stream read here.
Each figure is ms a token after the first token (plain decoding), or ms a round after the first token (with
--drafter: the rounds that followed the prefill), the median of a turn's requests but its first; the ways alternate
within a turn, so that a drift of the machine moves all of them. Shares are tok/s (or rounds/s) as a share of in
process's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

from treeserve.bench import print_report
from treeserve.errors import TreeserveError
from treeserve.settings import OneLineErrorParser
from treeserve.tree import MAX_BUDGET

WAYS = ("in_process", "scheduler", "grpc", "services")
DRAFTED_WAYS = ("in_process", "services")  # the ways a --drafter's rounds run
PROMPT = "def binary_search(values, wanted):\n    \"\"\"Return the index of wanted in the sorted list values.\"\"\"\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.round_ways", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--drafter", default="none", choices=("none", "ngram", "dflash", "merged"),
                        help="none (default): plain decoding; else the drafter whose rounds are timed, in process "
                             "and through the services")
    parser.add_argument("--budget", type=int, default=32, help="--drafter's tree budget (default %(default)s)")
    parser.add_argument("--ways", help=f"comma-separated, of {', '.join(WAYS)} (default: all of them; with --drafter "
                                       f"{', '.join(DRAFTED_WAYS)})")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens a request (default %(default)s)")
    parser.add_argument("--requests", type=int, default=3, help="requests of each way a turn (default %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="default %(default)s")
    parser.add_argument("--start-timeout-s", type=float, default=600, help="how long to wait for the services")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.max_new_tokens < 2 or args.requests < 2 or args.turns < 1:
        parser.error("--max-new-tokens and --requests must be at least 2, --turns at least 1")
    if not 1 <= args.budget <= MAX_BUDGET:
        parser.error(f"--budget must be between 1 and {MAX_BUDGET}, got {args.budget}")
    possible = WAYS if args.drafter == "none" else DRAFTED_WAYS
    args.ways = args.ways.split(",") if args.ways else list(possible)
    unknown = [way for way in args.ways if way not in possible]
    if unknown or not args.ways:
        parser.error(f"--ways: {', '.join(unknown) or 'none given'}; with --drafter {args.drafter} choose from "
                     f"{', '.join(possible)}")
    return args


def ms_each(first_s: float, end_s: float, count: int) -> float:
    """ms per token (or round) between the first token's arrival and the end."""
    return (end_s - first_s) / max(1, count) * 1e3


def in_process(target, verifier, prompt: list[int], params, drafter=None, budget: int = 0) -> float:
    from treeserve.verifier.engine import Generation

    generation = Generation(target.model, target.tokenizer, prompt, params, drafter, budget, verifier=verifier)
    try:
        generation.step()  # the prefill and first token
        first = time.perf_counter()
        while not generation.finished:
            generation.step()
        count = generation.rounds if drafter is not None else len(generation.output_ids) - 1
        return ms_each(first, time.perf_counter(), count)
    finally:
        generation.release()


async def through_scheduler(scheduler, target, verifier, prompt: list[int], params, name: str) -> float:
    from treeserve.verifier.engine import Generation

    outbox = scheduler.submit(name, Generation(target.model, target.tokenizer, prompt, params, verifier=verifier))
    first, tokens = None, 0
    while True:
        message = await outbox.get()
        if isinstance(message, Exception):
            raise message
        tokens += len(message.token_ids)
        first = first or time.perf_counter()
        if message.finish_reason:
            return ms_each(first, time.perf_counter(), tokens - 1)


def grpc_client(address: str, prompt: list[int], max_new_tokens: int, requests: int, results) -> None:
    """In another process: `requests` plain requests one after another, ms a token of each into `results`."""
    import grpc

    from treeserve.v1 import generation_pb2, verifier_pb2, verifier_pb2_grpc

    async def run() -> list[float]:
        found = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            for _ in range(requests):
                message = verifier_pb2.VerifierServiceGenerateRequest(
                    prompt_token_ids=prompt,
                    stop=generation_pb2.StopConditions(max_new_tokens=max_new_tokens, ignore_eos=True),
                    speculation=generation_pb2.SpeculationParams(disabled=True))
                first, tokens = None, 0
                async for reply in stub.Generate(message):
                    tokens += len(reply.token_ids)
                    first = first or time.perf_counter()
                found.append(ms_each(first, time.perf_counter(), tokens - 1))
        return found

    try:
        results.put(asyncio.run(run()))
    except Exception as error:  # the parent says what failed rather than waiting for a result that never comes
        results.put(f"{type(error).__name__}: {error}")


async def through_grpc(address: str, prompt: list[int], args) -> list[float]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    client = context.Process(target=grpc_client, args=(address, prompt, args.max_new_tokens, args.requests, results))
    client.start()
    try:
        found = await asyncio.to_thread(results.get, True, 600)
    finally:
        await asyncio.to_thread(client.join, 30)
    if isinstance(found, str):
        raise TreeserveError(f"the gRPC client failed: {found}")
    return found


def start_services(args, runtime: Path):
    """The three services as `treeserve up` starts them; returns the stack and the gateway's address."""
    from treeserve.cli import up_settings
    from treeserve.cli.launcher import Stack, start_stack

    drafted = args.drafter != "none"
    up = up_settings("--target", args.target, "--drafter", args.drafter if drafted else "auto",
                     "--budget", str(args.budget), "--device", args.device, "--dtype", args.dtype,
                     *(["--speculation", "fixed"] if drafted else []),
                     "--grace-s", "2", "--start-timeout-s", str(args.start_timeout_s))
    runtime.mkdir(parents=True, exist_ok=True)
    stack = Stack(runtime)
    try:
        return stack, start_stack(stack, up)
    except BaseException:
        stack.stop(up.grace_s)
        raise


async def through_services(gateway: str, args) -> float:
    """One request through the gateway: ms a token (plain) or a round (drafted) after its first token."""
    import grpc

    from treeserve.gateway.client import MESSAGE_OPTIONS
    from treeserve.serving import normalize_address
    from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2

    drafted = args.drafter != "none"
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, stop=generation_pb2.StopConditions(max_new_tokens=args.max_new_tokens, ignore_eos=True),
        speculation=generation_pb2.SpeculationParams(disabled=not drafted, budget=args.budget if drafted else 0))
    first, tokens, rounds = None, 0, 0
    async with grpc.aio.insecure_channel(normalize_address(gateway), options=MESSAGE_OPTIONS) as channel:
        async for reply in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request):
            tokens += len(reply.token_ids)
            if reply.token_ids and first is None:
                first = time.perf_counter()
            if reply.finish_reason:
                rounds = reply.stats.rounds
    return ms_each(first, time.perf_counter(), rounds if drafted else tokens - 1)


async def measure(args, target, verifier, drafter) -> dict[str, list[float]]:
    from treeserve import serving
    from treeserve.params import GenerationParams
    from treeserve.verifier.server import VerifierServicer

    prompt = target.tokenizer.encode(PROMPT)
    params = lambda: GenerationParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)  # noqa: E731
    folder = tempfile.TemporaryDirectory()
    service = running = stack = None
    medians: dict[str, list[float]] = {way: [] for way in args.ways}
    try:
        if "scheduler" in args.ways or "grpc" in args.ways:
            servicer = VerifierServicer(args.target, [], default_budget=16, default_max_new_tokens=16, max_batch=8)
            address = f"unix://{folder.name}/verifier.sock"
            service = await serving.start(address, servicer.register)
            scheduler = servicer.attach(target, verifier)
            running = asyncio.ensure_future(scheduler.run())
        if "services" in args.ways:
            stack, gateway = await asyncio.to_thread(start_services, args, Path(folder.name) / "stack")
        for turn in range(args.turns):
            for way in args.ways:
                if way == "in_process":
                    runs = [in_process(target, verifier, prompt, params(), drafter, args.budget)
                            for _ in range(args.requests)]
                elif way == "scheduler":
                    runs = [await through_scheduler(scheduler, target, verifier, prompt, params(), f"t{turn}r{i}")
                            for i in range(args.requests)]
                elif way == "grpc":
                    runs = await through_grpc(address, prompt, args)
                else:
                    runs = [await through_services(gateway, args) for _ in range(args.requests)]
                medians[way].append(statistics.median(runs[1:]))
            unit = "ms a round" if drafter is not None else "ms a token"
            print(f"round_ways: turn {turn + 1}: " + ", ".join(f"{way} {medians[way][-1]:.3f}" for way in args.ways)
                  + f" {unit}", file=sys.stderr, flush=True)
    finally:
        if running is not None:
            running.cancel()
        if service is not None:
            await service.stop(0)
        if stack is not None:
            stack.stop(2)
        folder.cleanup()
    return medians


def load(args):
    """The target, its verifier and (with --drafter) the drafter, as `treeserve generate` loads them; the
    verifier's pool holds a few requests, so that the services' verifier finds the device's memory free."""
    from treeserve.cli import make_drafter
    from treeserve.loading import load_target
    from treeserve.models.graphs import graphs_wanted
    from treeserve.verifier.graphs import build_verifier

    target = load_target(args.target, args.device, args.dtype)
    graphs = graphs_wanted("auto", args.device)
    drafted = args.drafter != "none"
    drafter = make_drafter(argparse.Namespace(drafter=args.drafter, drafter_path=None, tree="ddtree",
                                              device=args.device, dtype=args.dtype, budget=args.budget), target,
                           graphs) if drafted else None
    budget = args.budget if drafted else 0
    context = len(target.tokenizer.encode(PROMPT)) + args.max_new_tokens + budget
    verifier = build_verifier(target.model, 1 if drafted else 8, graphs, kv_cache_tokens=8 * context,
                              max_tree=budget + 1)
    if verifier.use_graphs:
        verifier.capture(tuple(drafter.feature_layer_ids) if drafter is not None else ())
    return target, verifier, drafter


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target, verifier, drafter = load(args)
        medians = asyncio.run(measure(args, target, verifier, drafter))
    except TreeserveError as error:
        print(f"round_ways: error: {error}", file=sys.stderr)
        return 1
    unit = "ms_a_round" if drafter is not None else "ms_a_token"
    report = {"command": " ".join(["python -m treeserve.bench.round_ways", *args.argv]), "target": args.target,
              "device": args.device, "dtype": args.dtype, "drafter": args.drafter,
              "budget": args.budget if drafter is not None else 0, "max_new_tokens": args.max_new_tokens,
              unit: {way: [round(ms, 4) for ms in values] for way, values in medians.items()}}
    if "in_process" in medians:
        in_process_ms = statistics.median(medians["in_process"])
        report["share_of_in_process"] = {way: round(in_process_ms / statistics.median(values), 3)
                                         for way, values in medians.items()}
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
