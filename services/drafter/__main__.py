"""`python -m treeserve.drafter`: serve a drafter over gRPC until SIGTERM or SIGINT (flags and their
TREESERVE_DRAFTER_<FLAG> environment variables: treeserve.settings.DrafterSettings)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

from treeserve import serving, telemetry
from treeserve.drafter import load_drafter, resolve_kind
from treeserve.drafter.server import DrafterServicer, start
from treeserve.errors import TreeserveError
from treeserve.settings import DrafterSettings, busy_loop_wanted

log = logging.getLogger("treeserve.drafter")


def parse_args(argv: list[str] | None = None) -> DrafterSettings:
    settings = DrafterSettings.parse(argv)
    return dataclasses.replace(settings, kind=resolve_kind(settings.kind, settings.target))


async def serve(args: DrafterSettings) -> None:
    metrics = telemetry.DrafterMetrics()
    tracing = telemetry.start_telemetry("drafter", metrics, args.metrics_listen)
    servicer = DrafterServicer(None, args.max_budget, tracing, metrics)
    service = await start(args.listen, servicer)
    log.info("drafter %s listening on %s; loading", args.kind, service.address)
    try:
        from treeserve.models.graphs import graphs_wanted

        graphs = graphs_wanted(args.cuda_graphs, args.device)
        servicer.attach(await asyncio.to_thread(load_drafter, args.kind, args.drafter_path or None, args.tree,
                                                target_spec=args.target, device=args.device, dtype=args.dtype,
                                                max_batch=args.max_batch, kv_cache_tokens=args.kv_cache_tokens,
                                                graphs=graphs, max_budget=args.max_budget))
    except BaseException:
        await serving.abandon(service)
        raise
    servicer.round_traces.listen()
    await service.ready(busy_loop=busy_loop_wanted(args.busy_loop, args.device))
    log.info("drafter %s (max budget %d) serving on %s%s", args.kind, args.max_budget, service.address,
             f" (and Draft streams as frames on {servicer.frames.path})" if servicer.frames.path else "")
    await serving.run_until_signalled(service, args.grace_s)
    tracing.shutdown()
    log.info("drafter stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serving.setup_logging(args.log_level)
    try:
        serving.run(serve(args))
    except TreeserveError as error:
        print(f"{DrafterSettings.PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
