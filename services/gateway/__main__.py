"""python -m treeserve.gateway: the public text API, in front of one or more verifiers."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from treeserve import serving
from treeserve.cli import OneLineErrorParser
from treeserve.errors import TreeserveError

log = logging.getLogger("treeserve.gateway")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

env = functools.partial(serving.env_default, "gateway")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineErrorParser(prog="python -m treeserve.gateway", description=__doc__,
                           epilog="Every flag can also come from TREESERVE_GATEWAY_<FLAG> "
                                  "(several verifiers comma-separated).")
    p.add_argument("--target", default=env("target", "smollm2-135m"),
                   help="the verifier's model (name, HF folder or .gguf), for its tokenizer (default smollm2-135m)")
    p.add_argument("--verifier", action="append", default=None, metavar="ADDRESS",
                   help=f"a verifier (repeatable; default {serving.default_address('verifier')})")
    p.add_argument("--listen", default=env("listen", serving.default_address("gateway")), help="default %(default)s")
    p.add_argument("--max-inflight", type=int, default=env("max_inflight", "256"),
                   help="requests in flight at most; more are refused with RESOURCE_EXHAUSTED (default 256)")
    p.add_argument("--default-max-new-tokens", type=int, default=env("default_max_new_tokens", "64"),
                   help="for requests that leave max_new_tokens unset (default 64)")
    p.add_argument("--grace-s", type=float, default=env("grace_s", "10"), help="drain period on SIGTERM (default 10)")
    p.add_argument("--metrics-listen", default=env("metrics_listen", ""), metavar="HOST:PORT",
                   help="serve Prometheus metrics over HTTP here (default: off)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=env("log_level", "INFO"))
    args = p.parse_args(argv)
    if args.verifier is None:
        args.verifier = [a.strip() for a in env("verifier", serving.default_address("verifier")).split(",") if a.strip()]
    if not args.verifier:
        p.error("give at least one --verifier")
    if args.max_inflight < 1 or args.default_max_new_tokens < 1 or args.grace_s < 0:
        p.error("--max-inflight and --default-max-new-tokens must be positive, --grace-s not negative")
    from treeserve.serving import normalize_address

    try:
        for address in [args.listen, *args.verifier]:
            normalize_address(address)
    except TreeserveError as error:
        p.error(str(error))
    return args


async def serve(args, tokenizer) -> None:
    from treeserve import telemetry
    from treeserve.gateway.server import GatewayServicer, serve as start_gateway
    from treeserve.serving import run_until_signalled

    metrics = telemetry.GatewayMetrics()
    tracing = telemetry.start_telemetry("gateway", metrics, args.metrics_listen)
    servicer = GatewayServicer(tokenizer, args.verifier, args.max_inflight, args.default_max_new_tokens, tracing,
                               metrics)
    service, ready = await start_gateway(args.listen, servicer)
    log.info("gateway listening on %s; verifiers: %s", service.address, ", ".join(args.verifier))

    async def stop():
        ready.cancel()
        await servicer.close()
        tracing.shutdown()

    await run_until_signalled(service, args.grace_s, stop)


def main(argv=None) -> int:
    args = parse_args(argv)
    from treeserve.loading import load_tokenizer
    from treeserve.serving import run, setup_logging

    setup_logging(args.log_level)
    try:
        tokenizer = load_tokenizer(args.target)
        run(serve(args, tokenizer))
    except TreeserveError as error:
        print(f"treeserve gateway: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
