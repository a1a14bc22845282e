"""`python -m treeserve.drafter`: serve a drafter over gRPC until SIGTERM or SIGINT.

Every flag can also come from the environment, TREESERVE_DRAFTER_<FLAG> (e.g. TREESERVE_DRAFTER_LISTEN);
a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys

from treeserve import serving, telemetry
from treeserve.cli import OneLineErrorParser
from treeserve.drafter import load_drafter, resolve_kind
from treeserve.drafter.server import DrafterServicer
from treeserve.errors import TreeserveError
from treeserve.tree import MAX_BUDGET

PROG = "python -m treeserve.drafter"
KINDS = ("auto", "ngram", "dflash", "merged", "model")
TREES = ("chain", "ddtree")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger("treeserve.drafter")


env = functools.partial(serving.env_default, "drafter")


def number(convert, minimum):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description="Serve a treeserve drafter (DrafterService) over gRPC. "
                                "Every flag can also be set as TREESERVE_DRAFTER_<FLAG>, e.g. "
                                "TREESERVE_DRAFTER_LISTEN.")
    parser.add_argument("--listen", default=env("listen", serving.default_address("drafter")),
                        help="unix:///path/to.sock or host:port (default %(default)s)")
    parser.add_argument("--kind", default=env("kind", "auto"),
                        help="auto (default): merged, with the DFlash drafter shipped for --target (smollm2-135m), "
                             "else ngram; ngram: prompt-lookup trees; dflash: a DFlash block drafter; merged: prompt "
                             "lookup's best continuation, then the DFlash tree for the rest of the budget; model: the "
                             "small LM at --drafter-path")
    parser.add_argument("--drafter-path", default=env("drafter-path"),
                        help="dflash, merged: the checkpoint folder (default: the one shipped for --target); model: the "
                             "draft model (name, HF folder, .gguf)")
    parser.add_argument("--target", default=env("target", "smollm2-135m"),
                        help="dflash, merged, model: the verifier's model (name, HF folder or .gguf); DFlash uses its "
                             "embedding and LM head, a draft model must share its tokenizer (default %(default)s)")
    parser.add_argument("--tree", default=env("tree", "ddtree"),
                        help="dflash, merged: chain (the argmax path) or ddtree (the best tree for the budget; default)")
    parser.add_argument("--device", default=env("device", "cpu"), help="dflash, merged, model: cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default=env("dtype", "float32"),
                        help="dflash, merged, model: float32 (default) or bfloat16")
    parser.add_argument("--kv-cache-tokens", type=number(int, 0), default=env("kv-cache-tokens", 0),
                        help="dflash: context tokens its pool holds over all requests (default 0: 262144 on "
                             "cuda, 32768 on the CPU)")
    parser.add_argument("--max-batch", type=number(int, 1), default=env("max-batch", 64),
                        help="dflash with --cuda-graphs: requests per round the graphs cover (default %(default)s)")
    parser.add_argument("--cuda-graphs", default=env("cuda-graphs", "auto"),
                        help="dflash: replay the block forward from CUDA graphs: auto (with --device cuda), on, off")
    parser.add_argument("--max-budget", type=number(int, 1), default=env("max-budget", MAX_BUDGET),
                        help="largest tree a request may ask for, in drafted nodes (default %(default)s)")
    parser.add_argument("--grace-s", type=number(float, 0), default=env("grace-s", 10.0),
                        help="on SIGTERM, seconds open streams get to finish (default %(default)s)")
    parser.add_argument("--metrics-listen", default=env("metrics-listen", ""), metavar="HOST:PORT",
                        help="serve Prometheus metrics over HTTP here (default: off)")
    parser.add_argument("--log-level", type=str.upper, default=env("log-level", "INFO"),
                        help=f"one of {', '.join(LOG_LEVELS)} (default %(default)s)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse checks `choices` on the command line only, so values from the environment are checked here.
    for flag, value, allowed in (("--kind", args.kind, KINDS), ("--log-level", args.log_level, LOG_LEVELS),
                                 ("--tree", args.tree, TREES), ("--device", args.device, ("cpu", "cuda")),
                                 ("--dtype", args.dtype, ("float32", "bfloat16")),
                                 ("--cuda-graphs", args.cuda_graphs, ("auto", "on", "off"))):
        if value not in allowed:
            parser.error(f"argument {flag}: invalid choice {value!r} (choose from {', '.join(allowed)})")
    if args.kind == "model" and not args.drafter_path:
        parser.error("--kind model needs --drafter-path")
    if args.cuda_graphs == "on" and args.device != "cuda":
        parser.error("--cuda-graphs on needs --device cuda")
    args.kind = resolve_kind(args.kind, args.target)
    return args


async def serve(args: argparse.Namespace) -> None:
    metrics = telemetry.DrafterMetrics()
    tracing = telemetry.start_telemetry("drafter", metrics, args.metrics_listen)
    servicer = DrafterServicer(None, args.max_budget, tracing, metrics)
    service = await serving.start(args.listen, servicer.register)
    log.info("drafter %s listening on %s; loading", args.kind, service.address)
    try:
        from treeserve.models.graphs import graphs_wanted

        graphs = graphs_wanted(args.cuda_graphs, args.device)
        servicer.attach(await asyncio.to_thread(load_drafter, args.kind, args.drafter_path, args.tree,
                                                target_spec=args.target, device=args.device, dtype=args.dtype,
                                                max_batch=args.max_batch, kv_cache_tokens=args.kv_cache_tokens,
                                                graphs=graphs, max_budget=args.max_budget))
    except BaseException:
        await serving.abandon(service)
        raise
    await service.ready()
    log.info("drafter %s (max budget %d) serving on %s", args.kind, args.max_budget, service.address)
    await serving.run_until_signalled(service, args.grace_s)
    tracing.shutdown()
    log.info("drafter stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serving.setup_logging(args.log_level)
    try:
        serving.run(serve(args))
    except TreeserveError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
