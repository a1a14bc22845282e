"""python -m treeserve.bench.stack_bench: greedy tokens per second of the three-service stack at one request,
with CUDA graphs on and off (the verifier's, and the DFlash drafter's), for plain decoding and each drafter.

For each mode it starts drafter, verifier and gateway (as `treeserve up` does) once per drafter configuration,
sends the prompts one at a time through the gateway (after untimed warm-up requests), and measures output
tokens over wall time at the client. Plain decoding (speculation disabled per request) runs on the first stack
of each mode, and every speculative output is compared with it token for token. Writes JSON with --out.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import tempfile
from pathlib import Path

from treeserve.cli import up_settings
from treeserve.settings import OneLineErrorParser
from treeserve.prompt_sets import read_prompts
from treeserve.errors import TreeserveError
from treeserve.cli.launcher import Stack, start_stack
from treeserve.params import GenerationParams
from treeserve.prompt_sets import WORKLOADS
from treeserve.serving import free_port
from treeserve.telemetry import round_phases, round_totals

DRAFTER_CONFIGS = {"ngram": ("ngram", "ddtree"), "dflash-chain": ("dflash", "chain"),
                   "dflash-ddtree": ("dflash", "ddtree"), "merged": ("merged", "ddtree")}


async def run_requests(gateway: str, prompts: list[dict], params: GenerationParams, speculate: bool) -> dict:
    from treeserve.gateway.client import generate_via_gateway

    outputs, tokens, elapsed, rounds = [], 0, 0.0, 0
    for prompt in prompts:
        result = await generate_via_gateway(gateway, prompt["prompt"], params, chat=prompt.get("chat", False),
                                            drafter_enabled=speculate)
        outputs.append(result["token_ids"])
        tokens += len(result["token_ids"])
        elapsed += result["elapsed_s"]
        rounds += result["rounds"]
    return {"outputs": outputs, "tokens": tokens, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 2), "tokens_per_round": round(tokens / max(1, rounds), 3)}


def start_graphs_stack(runtime: Path, args, kind: str, tree: str, graphs: str, metrics_address: str
                       ) -> tuple[Stack, str]:
    """The stack as `treeserve up` starts it, with graphs `on` or `off` in both the verifier and the drafter."""
    stack = Stack(runtime)
    up = up_settings("--target", args.target, "--drafter", kind, "--tree", tree, "--budget", str(args.budget),
                     "--device", args.device, "--dtype", args.dtype, "--max-batch", str(args.max_batch),
                     "--cuda-graphs", graphs, "--verifier-metrics", metrics_address, "--grace-s", "2",
                     "--start-timeout-s", str(args.start_timeout_s),
                     *(["--drafter-path", args.drafter_path] if args.drafter_path else []))
    try:
        return stack, start_stack(stack, up)
    except BaseException:  # a service that failed to start: stop the others
        stack.stop(up.grace_s)
        raise


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.stack_bench", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter-path", help="DFlash checkpoint (default: the one shipped for the target)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=Path, default=WORKLOADS["code"],
                   help='JSONL of {"prompt": ..., "chat": true|false} (default: the held-out code prompts)')
    p.add_argument("--limit", type=int, default=8, help="prompts to send (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=32, help="tree budget of every speculative request (default 32)")
    p.add_argument("--max-batch", type=int, default=8, help="the verifier's --max-batch (graphs captured up to it)")
    p.add_argument("--graphs", default="on,off", help="verifier modes to measure (default on,off)")
    p.add_argument("--drafters", default=",".join(DRAFTER_CONFIGS), help=f"of {', '.join(DRAFTER_CONFIGS)}")
    p.add_argument("--start-timeout-s", type=float, default=300)
    p.add_argument("--out", help="write the figures here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prompts = read_prompts(args.prompts)[:args.limit]
    except TreeserveError as error:
        print(f"stack_bench: error: {error}", file=sys.stderr)
        return 1
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    rows = []
    command = "python -m treeserve.bench.stack_bench " + shlex.join(sys.argv[1:] if argv is None else argv)

    def record(row: dict) -> None:
        """Print the row and rewrite the JSON, so a run cut off by a time limit keeps what it measured."""
        rows.append(row)
        print_row(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": command, "prompts": len(prompts), "budget": args.budget, "dtype": args.dtype,
                           "rows": rows}, f, indent=1)

    try:
        for graphs in args.graphs.split(","):
            plain = None
            for name in args.drafters.split(","):
                if name not in DRAFTER_CONFIGS:
                    raise TreeserveError(f"unknown drafter configuration {name!r}")
                metrics_address = f"127.0.0.1:{free_port()}"
                with tempfile.TemporaryDirectory(prefix="treeserve-bench-") as runtime:
                    stack, gateway = start_graphs_stack(Path(runtime), args, *DRAFTER_CONFIGS[name], graphs,
                                                        metrics_address)
                    try:
                        # Untimed: the first requests of a fresh stack compile kernels and pick GEMM algorithms.
                        asyncio.run(run_requests(gateway, prompts[:1], GenerationParams(max_new_tokens=16), True))
                        asyncio.run(run_requests(gateway, prompts[:1], GenerationParams(max_new_tokens=16), False))
                        before = round_totals(metrics_address)
                        if plain is None:
                            plain = asyncio.run(run_requests(gateway, prompts, params, speculate=False))
                            after = round_totals(metrics_address)
                            plain |= round_phases(before, after)
                            record({"graphs": graphs, "drafter": "none"} | without_outputs(plain))
                            before = after
                        found = asyncio.run(run_requests(gateway, prompts, params, speculate=True))
                        found |= round_phases(before, round_totals(metrics_address))
                    finally:
                        stack.stop(5)
                same = sum(a == b for a, b in zip(found["outputs"], plain["outputs"]))
                record({"graphs": graphs, "drafter": name, "identical_to_plain": f"{same}/{len(prompts)}"}
                       | without_outputs(found) | {"speedup": round(found["tokens_per_s"] / plain["tokens_per_s"], 3)})
    except TreeserveError as error:
        print(f"stack_bench: error: {error}", file=sys.stderr)
        return 1
    return 0


def without_outputs(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "outputs"}


def print_row(row: dict) -> None:
    print(f"graphs {row['graphs']:3s} {row['drafter']:14s} {row['tokens_per_s']:8.1f} tok/s "
          f"{row['tokens_per_round']:.2f} tok/round {row.get('identical_to_plain', ''):5s} ms/round: "
          f"{row.get('round_ms')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
