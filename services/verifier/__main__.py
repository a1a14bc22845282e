"""python -m treeserve.verifier: serve a target model, verifying draft trees from one or more drafters."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

from treeserve.errors import TreeserveError
from treeserve.settings import VerifierSettings, busy_loop_wanted

log = logging.getLogger("treeserve.verifier")


def parse_args(argv=None) -> VerifierSettings:
    parser = VerifierSettings.parser()
    settings = VerifierSettings.parse(argv, parser)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != settings.tp:
        parser.error(f"--tp {settings.tp}, but the launcher started {os.environ['WORLD_SIZE']} ranks")
    return settings


async def serve(args, shard=None, followers=()) -> None:
    """Rank 0's service (the only one with a `shard` is rank 0 of a tensor-parallel target; `followers`: the rank
    processes it started, watched so that one that dies takes the service down)."""
    from treeserve import parallel, serving, telemetry
    from treeserve.loading import load_target
    from treeserve.verifier.drafter_link import DrafterLink, expand_drafter_addresses
    from treeserve.models.graphs import graphs_wanted
    from treeserve.verifier.adaptive import AdaptiveSpeculation
    from treeserve.verifier import server
    from treeserve.verifier.server import VerifierServicer, use_intra_op_threads
    from treeserve.verifier.tensor_parallel import Mirror, build_mirrored_verifier

    metrics = telemetry.VerifierMetrics()
    tracing = telemetry.start_telemetry("verifier", metrics, args.metrics_listen)
    links = [DrafterLink(address, args.draft_timeout_s) for address in expand_drafter_addresses(args.drafter)]
    servicer = VerifierServicer(args.target, links, args.default_budget, args.default_max_new_tokens, args.max_batch,
                                tracing, metrics)
    service = await server.start(args.listen, servicer)
    log.info("verifier listening on %s%s; loading %s", service.address,
             f" (and Session streams as frames on {servicer.frames.path})" if servicer.frames.path else "", args.target)
    mirror = None if shard is None else Mirror(parallel.control_group())
    # All of torch's parallel work runs on this one thread, from loading to every forward that blocks. A second
    # thread's parallel op starts a second OpenMP team, more threads than cores, and every later round slows down
    # for the life of the process (docs/benchmarks.md, "On the CPU").
    compute = ThreadPoolExecutor(1, "verifier-compute")
    on_compute = functools.partial(asyncio.get_running_loop().run_in_executor, compute)
    try:
        target = await on_compute(load_target, args.target, args.device, args.dtype, shard)
        graphs = graphs_wanted(args.cuda_graphs, args.device)
        # The drafters up now: the pool leaves room for the target features they condition on.
        feature_layer_ids = ()
        for link in links:
            if await link.connect() and link.feature_layer_ids and not feature_layer_ids:
                feature_layer_ids = link.feature_layer_ids
        verifier = await on_compute(functools.partial(
            build_mirrored_verifier, target.model, mirror, max_batch=args.max_batch, graphs=graphs,
            kv_cache_tokens=args.kv_cache_tokens, feature_layer_ids=feature_layer_ids))
    except BaseException:
        await serving.abandon(service)
        raise
    adaptive = None
    if args.adaptive:
        adaptive = AdaptiveSpeculation(args.adaptive_min_budget, args.adaptive_max_budget,
                                       give_up_after_s=args.adaptive_give_up_s)
    scheduler = servicer.attach(target, verifier, adaptive, compute)  # (None: fixed speculation)
    if args.device == "cpu":  # the event loop's own torch work (picks, KV moves) is small: one thread, no team
        use_intra_op_threads(1)
    # A lost tensor-parallel rank: the scheduler has failed every stream; stop as on SIGTERM.
    scheduler.on_rank_lost = lambda error: os.kill(os.getpid(), signal.SIGTERM)
    watch_followers(followers, scheduler, mirror)
    for link in links:
        await scheduler.connect(link)
    if verifier.kernels:  # compile the prefill's kernels now rather than in the first requests
        seconds = await on_compute(verifier.warm_up_prefill, scheduler.feature_layer_ids)
        log.info("prefill kernels warmed up in %.1f s", seconds)
    if verifier.use_graphs:  # after the drafters: the graphs compute the features they asked for
        await on_compute(verifier.capture, scheduler.feature_layer_ids)
        if adaptive is not None:  # what each tree size adds, known from the start
            for (batch, rows), seconds in (await on_compute(verifier.time_graphs)).items():
                adaptive.costs.observe_graph(batch, rows, seconds)
    scheduler.round_traces.listen()
    scheduler_task = asyncio.ensure_future(scheduler.run())
    await service.ready(busy_loop=busy_loop_wanted(args.busy_loop, args.device))
    log.info("verifier ready: %s on %s, drafters: %s", args.target, args.device,
             ", ".join(link.address for link in links) or "none")

    async def stop():
        scheduler_task.cancel()
        for link in links:
            await link.close()
        tracing.shutdown()
        if scheduler.lost is not None:
            # A forward thread may still wait in a collective that will never complete: leave without it.
            parallel.stop_followers(list(followers), timeout_s=0)
            logging.shutdown()
            os._exit(1)
        if mirror is not None:
            mirror.close()

    await serving.run_until_signalled(service, args.grace_s, stop, on_drain=servicer.drain)


def watch_followers(followers, scheduler, mirror) -> None:
    """Fail the service (scheduler.lose) as soon as a follower rank process exits, unless rank 0 told it to."""
    if not followers:
        return
    import multiprocessing.connection
    import threading

    from treeserve.verifier.tensor_parallel import RankLost

    loop = asyncio.get_running_loop()

    def wait():
        gone = multiprocessing.connection.wait([process.sentinel for process in followers])
        process = next(p for p in followers if p.sentinel in gone)
        process.join(1)
        if mirror.closed:  # stopping: the followers were told to go
            return
        try:
            loop.call_soon_threadsafe(scheduler.lose, RankLost(f"tensor-parallel {process.name} exited "
                                                               f"(code {process.exitcode})"))
        except RuntimeError:  # the event loop has closed: the service is gone already
            pass

    threading.Thread(target=wait, name="treeserve-rank-watch", daemon=True).start()


def main(argv=None) -> int:
    args = parse_args(argv)
    from treeserve import parallel, serving

    serving.setup_logging(args.log_level)
    followers = []
    try:
        if args.tp == 1:
            serving.run(serve(args))
            return 0
        from treeserve.verifier.tensor_parallel import follower_main

        if "RANK" in os.environ and int(os.environ["RANK"]) != 0:  # a rank torchrun started: follow rank 0
            return follower_main(args)
        if "RANK" not in os.environ:
            followers = parallel.start_followers(follower_main, args, args.tp)
        serving.run(serve(args, parallel.join(args.device), followers))
    except TreeserveError as error:
        print(f"treeserve verifier: error: {error}", file=sys.stderr)
        return 1
    finally:
        parallel.stop_followers(followers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
