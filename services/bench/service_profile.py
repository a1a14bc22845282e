"""python -m treeserve.bench.service_profile: where a round's time goes in each of the three services.

Starts the stack as `treeserve up` does, and at each concurrency runs a closed loop of one mode (plain, then
speculative) for --seconds. Meanwhile it scrapes the verifier's round phases and, where py-spy is installed,
samples every service's threads (idle ones included, so a wait shows as the frame it waits in). Writes, per
concurrency and mode, the raw py-spy stacks and a summary JSON: tok/s, the verifier's ms per round by phase, and
per service and thread the functions that hold the most samples (their own, and with what they call). py-spy
samples without pausing the services and can lose a sample whose stack changed while it read it: a busy thread's
shares came out low against an idle one's (docs/benchmarks.md), so they say where a thread works, and the round
phases how long.

With --torch-trace, torch's profiler replaces py-spy: once the load is steady, the verifier and the drafter each
trace their next rounds (treeserve.round_traces), and each run's summary holds, per service, the medians of a
round's timeline: its host span, the device's busy time, when the device's first work began and its last ended,
and the CUDA runtime calls by name. The traces themselves (Chrome format, gzipped) stay in --out-dir. The
profiler slows the services' host work several times over, the traced runs' tok/s and phases with it: a trace
says where a round's time goes and what the device does meanwhile, not how fast the stack is.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from treeserve.errors import TreeserveError

TOP_FRAMES = 25


def parse_args(argv=None):
    from treeserve.bench.load import int_list
    from treeserve.bench.stack_bench import DRAFTER_CONFIGS
    from treeserve.prompt_sets import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m treeserve.bench.service_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="raw stacks, stack logs and profile.json go here")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", default="merged", choices=sorted(DRAFTER_CONFIGS))
    p.add_argument("--budget", type=int, default=16, help="the speculative mode's tree budget (default 16)")
    p.add_argument("--speculation", default="fixed", choices=("fixed", "adaptive"),
                   help="the verifier's policy (default fixed; adaptive: the speculative mode's requests ask for "
                        "trees, and the policy chooses which rounds draft)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--workload", default="code", choices=sorted(WORKLOADS))
    p.add_argument("--prompts", help="a JSONL prompt file instead of --workload")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64], help="comma-separated (default 1,16,64)")
    p.add_argument("--modes", default="plain,speculative", help="comma-separated, of plain, speculative")
    p.add_argument("--seconds", type=float, default=5.0, help="sampled stretch of each run (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rate", type=int, default=1000, help="py-spy samples a second (default 1000)")
    p.add_argument("--torch-trace", action="store_true",
                   help="trace the verifier's and the drafter's rounds under torch's profiler instead of py-spy")
    p.add_argument("--metrics-port", type=int, default=9464)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--up-flags", default="", metavar="FLAGS",
                   help="more `treeserve up` flags for the stack, quoted as one argument (e.g. --drafter-path DIR)")
    args = p.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not set(args.modes) <= {"plain", "speculative"} or not args.modes:
        p.error("--modes: plain and/or speculative")
    return args


async def closed_loop(address: str, requests: list, concurrency: int, seconds: float, on_warm) -> dict:
    """Keep `concurrency` requests in flight (cycling through `requests`) for one warm-up second and then
    `seconds`, calling `on_warm()` (which starts the samplers and returns their stop function) between them;
    returns the tokens received while sampled."""
    import grpc

    from treeserve.serving import normalize_address
    from treeserve.v1 import gateway_pb2_grpc

    sampled = {"tokens": 0, "messages": 0}
    window = {"open": False}
    async with grpc.aio.insecure_channel(normalize_address(address)) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def worker(first: int):
            index = first
            while True:
                async for reply in stub.Generate(requests[index % len(requests)]):
                    if window["open"] and reply.token_ids:
                        sampled["tokens"] += len(reply.token_ids)
                        sampled["messages"] += 1
                index += concurrency

        workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        try:
            await asyncio.sleep(1.0)
            stop = on_warm()
            window["open"], opened = True, time.perf_counter()
            await asyncio.sleep(seconds)
            window["open"] = False
            sampled["seconds"] = time.perf_counter() - opened
            stop()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return sampled


def start_samplers(py_spy: str | None, pids: dict[str, int], seconds: float, rate: int, prefix: Path):
    """py-spy on each service for `seconds`; returns the function that waits for them (a no-op without py-spy)."""
    if py_spy is None:
        return lambda: None
    samplers = [subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                                  "--rate", str(rate), "--format", "raw", "--threads", "--idle", "--nonblocking",
                                  "--output", str(prefix.with_name(f"{prefix.name}-{name}.txt"))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                for name, pid in pids.items()]

    def wait():
        for sampler in samplers:
            try:
                _, error = sampler.communicate(timeout=seconds + 20)
            except subprocess.TimeoutExpired:  # a sampler that hangs on its way out: its stacks are written
                sampler.kill()
                _, error = sampler.communicate()
            if sampler.returncode != 0:
                print(f"py-spy: {error.decode(errors='replace').strip()[-400:]}", file=sys.stderr)
    return wait


def summarize_stacks(path: Path) -> dict:
    """From py-spy's raw format (`thread;frame;...;leaf count`, root first): per thread, its share of the samples,
    and the functions holding the most samples, their own (leaf) and with what they call (inclusive)."""
    if not path.exists():
        return {}
    threads: dict[str, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, frames, n = frames[0], frames[1:], int(count)
        entry = threads.setdefault(thread, {"samples": 0, "own": collections.Counter(),
                                            "inclusive": collections.Counter()})
        entry["samples"] += n
        if frames:
            entry["own"][frames[-1]] += n
        for frame in set(frames):
            entry["inclusive"][frame] += n
    total = sum(entry["samples"] for entry in threads.values()) or 1
    return {thread: {"share": round(entry["samples"] / total, 4), "samples": entry["samples"],
                     "own": [[frame, n] for frame, n in entry["own"].most_common(TOP_FRAMES)],
                     "inclusive": [[frame, n] for frame, n in entry["inclusive"].most_common(TOP_FRAMES)]}
            for thread, entry in sorted(threads.items(), key=lambda item: -item[1]["samples"])}


def trace_services(pids: dict[str, int]):
    """Have each service trace its rounds from now (round_traces); returns the function that ends the traces."""
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)

    def stop():
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR2)
    return stop


def new_traces(folder: Path, before: set[Path], wanted: int, timeout_s: float = 30.0) -> set[Path]:
    """The traces written in `folder` since `before`, once `wanted` of them are there (a service writes its trace
    after its last traced round), or what is there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = set(folder.glob("*.json.gz")) - before
        if len(found) >= wanted or time.monotonic() > deadline:
            if len(found) < wanted:
                print(f"service_profile: {len(found)} of {wanted} traces written", file=sys.stderr)
            return found
        time.sleep(0.2)


def summarize_traces(paths: set[Path], prefix: Path) -> dict:
    """Per service, the medians of its traced rounds' timelines (round_traces.timeline_medians), each trace
    renamed after the run (`prefix`) it belongs to."""
    from treeserve.round_traces import read_events, timeline_medians, timeline_of

    timelines = {}
    for path in sorted(paths):
        service = path.name.split("-")[0]
        timelines[service] = timeline_medians(timeline_of(read_events(path)))
        path.rename(prefix.with_name(f"{prefix.name}-{service}-trace.json.gz"))
    return timelines


def main(argv=None) -> int:
    from treeserve.bench.load import build_requests
    from treeserve.bench.stack_bench import DRAFTER_CONFIGS
    from treeserve.cli import up_settings
    from treeserve.cli.launcher import Stack, start_stack
    from treeserve.params import GenerationParams
    from treeserve.prompt_sets import WORKLOADS, read_prompts
    from treeserve.round_traces import TRACE_DIR_ENV
    from treeserve.telemetry import round_phases, round_totals

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    py_spy = None if args.torch_trace else shutil.which("py-spy")
    if py_spy is None and not args.torch_trace:
        print("service_profile: py-spy not found; recording round phases only", file=sys.stderr)
    traces = out_dir / "traces"
    kind, tree = DRAFTER_CONFIGS[args.drafter]
    up = up_settings("--target", args.target, "--drafter", kind, "--tree", tree, "--budget", str(args.budget),
                     "--device", args.device, "--dtype", args.dtype, "--speculation", args.speculation,
                     "--verifier-metrics", f"127.0.0.1:{args.metrics_port}", "--grace-s", "2",
                     "--start-timeout-s", str(args.start_timeout_s), *shlex.split(args.up_flags))
    prompts = read_prompts(Path(args.prompts) if args.prompts else WORKLOADS[args.workload])
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    stack = Stack(out_dir / "runtime")
    (out_dir / "runtime").mkdir(exist_ok=True)
    command = " ".join(["python -m treeserve.bench.service_profile", *(argv or sys.argv[1:])])
    report = {"command": command, "drafter": args.drafter, "budget": args.budget, "speculation": args.speculation,
              "device": args.device,
              "dtype": args.dtype, "prompts": args.prompts or args.workload, "py_spy": py_spy is not None, "runs": []}
    if args.torch_trace:  # (the services read it as they start)
        os.environ[TRACE_DIR_ENV] = str(traces.resolve())
    try:
        gateway = start_stack(stack, up)
        pids = {name: process.pid for name, (process, _, _) in stack.children.items()}
        for concurrency in args.concurrency:
            for mode in args.modes:
                speculate = mode == "speculative"
                requests = build_requests(prompts, max(len(prompts), concurrency), params, speculate, args.budget)
                prefix = out_dir / f"{mode}-c{concurrency}"
                snapshots = []
                traced_before = set(traces.glob("*.json.gz"))
                traced = ("verifier", "drafter") if speculate else ("verifier",)

                def on_warm():
                    snapshots.append(round_totals(up.verifier_metrics))
                    if args.torch_trace:  # (a plain round asks the drafter nothing)
                        return trace_services({name: pids[name] for name in traced})
                    return start_samplers(py_spy, pids, args.seconds, args.rate, prefix)

                print(f"== {mode}, {concurrency} in flight", file=sys.stderr, flush=True)
                sampled = asyncio.run(closed_loop(gateway, requests, concurrency, args.seconds, on_warm))
                after = round_totals(up.verifier_metrics)
                rounds = after.phases.get("round", (0.0, 0.0))[1] - snapshots[0].phases.get("round", (0.0, 0.0))[1]
                run = {"mode": mode, "concurrency": concurrency,
                       "tokens_per_s": round(sampled["tokens"] / sampled["seconds"], 1),
                       "messages_per_s": round(sampled["messages"] / sampled["seconds"], 1),
                       "rounds": int(rounds)} | round_phases(snapshots[0], after) | {
                       "services": {name: summarize_stacks(prefix.with_name(f"{prefix.name}-{name}.txt"))
                                    for name in pids}}
                if args.torch_trace:
                    run["timelines"] = summarize_traces(new_traces(traces, traced_before, len(traced)), prefix)
                print(f"   {run['tokens_per_s']} tok/s, round ms {run['round_ms']} (medians {run['round_ms_p50']})",
                      file=sys.stderr, flush=True)
                report["runs"].append(run)
    finally:
        stack.stop(up.grace_s)
        if args.torch_trace:
            os.environ.pop(TRACE_DIR_ENV, None)
    out = out_dir / "profile.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TreeserveError as error:
        print(f"service_profile: error: {error}", file=sys.stderr)
        sys.exit(1)
