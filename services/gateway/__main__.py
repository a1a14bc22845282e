"""python -m treeserve.gateway: the public text API, in front of one or more verifiers."""

from __future__ import annotations

import logging
import sys

from treeserve.errors import TreeserveError
from treeserve.settings import GatewaySettings

log = logging.getLogger("treeserve.gateway")


def parse_args(argv=None) -> GatewaySettings:
    return GatewaySettings.parse(argv)


async def serve(args, tokenizer) -> None:
    from treeserve import telemetry
    from treeserve.gateway.server import GatewayServicer, serve as start_gateway
    from treeserve.serving import run_until_signalled

    http_socket = None
    if args.http:
        from treeserve.gateway import openai_api

        http_socket = openai_api.bind(args.http)  # first: a port that is taken stops the gateway before it starts
    metrics = telemetry.GatewayMetrics()
    tracing = telemetry.start_telemetry("gateway", metrics, args.metrics_listen)
    servicer = GatewayServicer(tokenizer, args.verifier, args.max_inflight, args.default_max_new_tokens, tracing,
                               metrics)
    service, ready = await start_gateway(args.listen, servicer)
    log.info("gateway listening on %s; verifiers: %s", service.address, ", ".join(args.verifier))
    if http_socket is not None:
        http = openai_api.HttpListener(servicer, http_socket, args.http_timeout_s, args.grace_s)
        await http.start()
        service.listeners.append(lambda grace_s: http.stop())  # (its grace period is its own, the same)

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
