"""python -m treeserve.bench.plain_round: what a plain decoding step costs through the verifier service, against
the same step in process.

One process loads the target and its verifier (CUDA graphs on a GPU) once, then, turn after turn, decodes
--max-new-tokens tokens of one prompt (EOS ignored) three ways: `Generation.step` in a loop (in process), the
verifier's scheduler fed a request directly and its stream read from the request's queue (the scheduler's loop,
no gRPC), and the verifier service's Generate stream read by a client in another process (the scheduler behind
gRPC). Each figure is ms a token after the first token, the median of a turn's requests but its first; the three
alternate within a turn, so that a drift of the machine moves all three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.settings import OneLineErrorParser

WAYS = ("in_process", "scheduler", "grpc")
PROMPT = "def binary_search(values, wanted):\n    \"\"\"Return the index of wanted in the sorted list values.\"\"\"\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.plain_round", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default %(default)s)")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens a request (default %(default)s)")
    parser.add_argument("--requests", type=int, default=3, help="requests of each way a turn (default %(default)s)")
    parser.add_argument("--turns", type=int, default=3, help="default %(default)s")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.max_new_tokens < 2 or args.requests < 2 or args.turns < 1:
        parser.error("--max-new-tokens and --requests must be at least 2, --turns at least 1")
    return args


def ms_a_token(first_s: float, end_s: float, tokens: int) -> float:
    return (end_s - first_s) / max(1, tokens - 1) * 1e3


def in_process(target, verifier, prompt: list[int], params) -> float:
    from treeserve.verifier.engine import Generation

    generation = Generation(target.model, target.tokenizer, prompt, params, verifier=verifier)
    try:
        generation.step()  # the prefill and first token
        first = time.perf_counter()
        while not generation.finished:
            generation.step()
        return ms_a_token(first, time.perf_counter(), len(generation.output_ids))
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
            return ms_a_token(first, time.perf_counter(), tokens)


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
                found.append(ms_a_token(first, time.perf_counter(), tokens))
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


async def measure(args, target, verifier) -> dict[str, list[float]]:
    from treeserve import serving
    from treeserve.params import GenerationParams
    from treeserve.verifier.server import VerifierServicer

    prompt = target.tokenizer.encode(PROMPT)
    params = lambda: GenerationParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)  # noqa: E731
    servicer = VerifierServicer(args.target, [], default_budget=16, default_max_new_tokens=16, max_batch=8)
    folder = tempfile.TemporaryDirectory()
    address = f"unix://{folder.name}/verifier.sock"
    service = await serving.start(address, servicer.register)
    scheduler = servicer.attach(target, verifier)
    running = asyncio.ensure_future(scheduler.run())
    medians: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for turn in range(args.turns):
            runs = [in_process(target, verifier, prompt, params()) for _ in range(args.requests)]
            medians["in_process"].append(statistics.median(runs[1:]))
            runs = [await through_scheduler(scheduler, target, verifier, prompt, params(), f"t{turn}r{i}")
                    for i in range(args.requests)]
            medians["scheduler"].append(statistics.median(runs[1:]))
            medians["grpc"].append(statistics.median((await through_grpc(address, prompt, args))[1:]))
            print(f"plain_round: turn {turn + 1}: " + ", ".join(f"{way} {medians[way][-1]:.3f}" for way in WAYS)
                  + " ms a token", file=sys.stderr, flush=True)
    finally:
        running.cancel()
        await service.stop(0)
        folder.cleanup()
    return medians


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from treeserve.loading import load_target
    from treeserve.models.graphs import graphs_wanted
    from treeserve.verifier.graphs import build_verifier

    try:
        target = load_target(args.target, args.device, args.dtype)
        verifier = build_verifier(target.model, 8, graphs_wanted("auto", args.device), 0)
        if verifier.use_graphs:
            verifier.capture(())
        medians = asyncio.run(measure(args, target, verifier))
    except TreeserveError as error:
        print(f"plain_round: error: {error}", file=sys.stderr)
        return 1
    report = {"command": " ".join(["python -m treeserve.bench.plain_round", *args.argv]), "target": args.target,
              "device": args.device, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "ms_a_token": {way: [round(ms, 4) for ms in values] for way, values in medians.items()}}
    in_process_ms = statistics.median(medians["in_process"])  # tok/s of each way as a share of in process's
    report["share_of_in_process"] = {way: round(in_process_ms / statistics.median(values), 3)
                                     for way, values in medians.items()}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
