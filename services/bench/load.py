"""treeserve bench: load a running gateway at several concurrencies, speculative and plain side by side.

For each concurrency C (and each tree budget), N requests go through the gateway with at most C in flight (a
closed loop: a new request starts when one ends), first with speculation off, then on, on the same stack, so
every ratio is measured in one run. N defaults to four waves (4 C, at least 16): with a single wave the run
lasts as long as its slowest request, and speculation, whose requests finish at different rounds, would be
judged on its tail. With --request-rate instead, each level is an open loop: N requests (default 64) arrive
as a Poisson process at R a second, whatever is in flight, at the same seeded times in both modes; that is the
load a server sees from many independent users, where a closed loop slows its arrivals down with its own
latency. Per run: output tokens per second (over the run's wall time; while all C were in flight,
which leaves the final drain out; and the mean of each request's own rate), time to the first token and
inter-token latency (p50/p99), the mean tokens per verification round, the verifier's mean round time by phase
(with --verifier-metrics), errors by gRPC status, and for greedy runs where each output that differs from the first
plain run's parts from it (for python -m treeserve.bench.near_ties). The JSON goes to --out, and a PNG plot
beside it (tokens per second against concurrency; tokens per round against budget).

One pair of runs resolves no difference below a few percent: runs that did the same work differ by about that
much (docs/benchmarks.md). With --repeats K each load runs each mode K times, the modes taking
turns (plain first, then speculative first, ...) so that drift falls on both; each speculative run is compared
with the plain run of its turn, and the report's `summary` gives per load and budget the medians and the range
of the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import grpc

from treeserve.divergence import divergence
from treeserve.errors import TreeserveError
from treeserve.params import GenerationParams
from treeserve.prompt_sets import WORKLOADS
from treeserve.serving import normalize_address
from treeserve.telemetry import percentile
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from treeserve.wire import params_to_proto



@dataclasses.dataclass
class RequestResult:
    tokens: int = 0
    first_token_s: float | None = None
    elapsed_s: float = 0.0
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (perf_counter, tokens) a message
    rounds: int = 0
    round_tokens: int = 0
    error: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def token_gaps_s(self) -> list[float]:
        """Per token after the first message: a message of k tokens waited (its time - the previous one's), and
        each of its tokens a k-th of that."""
        return [(at - before) / n for (before, _), (at, n) in zip(self.arrivals, self.arrivals[1:])
                for _ in range(n)]


async def one_request(stub, request: gateway_pb2.GenerateRequest, timeout_s: float) -> RequestResult:
    result = RequestResult()
    started = time.perf_counter()
    try:
        async for reply in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if reply.token_ids:
                if result.first_token_s is None:
                    result.first_token_s = now - started
                result.tokens += len(reply.token_ids)
                result.token_ids += reply.token_ids
                result.arrivals.append((now, len(reply.token_ids)))
            if reply.finish_reason:
                result.rounds, result.round_tokens = reply.stats.rounds, reply.stats.round_tokens
    except grpc.aio.AioRpcError as error:
        result.error = error.code().name
    result.elapsed_s = time.perf_counter() - started
    return result


def summarize(results: list[RequestResult], started: float, wall_s: float, saturated_s: float) -> dict:
    """`saturated_s`: how long after `started` every worker still had a request (until the last was handed out)."""
    done = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in done)
    saturated_tokens = sum(n for r in done for at, n in r.arrivals if at - started <= saturated_s)
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    first = [r.first_token_s * 1000 for r in done if r.first_token_s is not None]
    gaps = [gap * 1000 for r in done for gap in r.token_gaps_s]
    rounds = sum(r.rounds for r in done)
    ms = lambda value: None if value is None else round(value, 3)  # noqa: E731
    return {
        "requests": len(results), "completed": len(done), "errors": errors, "output_tokens": tokens,
        "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        # None for a single wave: every request was handed out at once, so there is no such stretch
        "saturated_tokens_per_s": round(saturated_tokens / saturated_s, 2) if saturated_s > 0 else None,
        "per_request_tokens_per_s": round(statistics.mean(r.tokens / r.elapsed_s for r in done), 2) if done else 0.0,
        "ttft_ms": {"p50": ms(percentile(first, 50)), "p99": ms(percentile(first, 99))},
        "itl_ms": {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99))},
        "tokens_per_round": round(sum(r.round_tokens for r in done) / rounds, 3) if rounds else None,
        # Request i (prompt i modulo the prompt set, as build_requests deals them): what it got and in how many
        # rounds (after its prefill), so that a slow request can be traced to its prompt.
        "by_request": {"tokens": [r.tokens for r in results], "rounds": [r.rounds for r in results],
                       "elapsed_s": [round(r.elapsed_s, 3) for r in results]},
    }


class Progress:
    """One line on stderr, rewritten as requests finish."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done = self.tokens = 0
        self.started = time.perf_counter()

    def advance(self, result: RequestResult) -> None:
        self.done += 1
        self.tokens += result.tokens
        if self.enabled:
            rate = self.tokens / max(1e-9, time.perf_counter() - self.started)
            bar = "#" * (20 * self.done // self.total)
            print(f"\r{self.label:28s} [{bar:20s}] {self.done}/{self.total} requests, {rate:8.1f} tok/s",
                  end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)


async def run_level(address: str, requests: list[gateway_pb2.GenerateRequest], concurrency: int,
                    timeout_s: float, progress: Progress) -> tuple[list[RequestResult], float, float, float]:
    """Every request, at most `concurrency` in flight; returns the results (in request order), the start time,
    the wall time, and how long every worker stayed busy (until the last request was handed out)."""
    async with grpc.aio.insecure_channel(normalize_address(address)) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        queue = list(enumerate(requests))
        results: list[RequestResult | None] = [None] * len(requests)
        saturated_s = 0.0

        async def worker():
            nonlocal saturated_s
            while queue:
                index, request = queue.pop(0)
                if not queue and len(requests) > concurrency:  # (a single wave is handed out at once)
                    saturated_s = time.perf_counter() - started
                results[index] = await one_request(stub, request, timeout_s)
                progress.advance(results[index])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        return results, started, time.perf_counter() - started, saturated_s


async def run_open_loop(address: str, requests: list[gateway_pb2.GenerateRequest], rate: float, timeout_s: float,
                        progress: Progress, seed: int = 0) -> tuple[list[RequestResult], float, float, float]:
    """Every request, started at Poisson arrival times of `rate` a second (seeded: the same times in every run),
    however many are in flight; returns what run_level does (no stretch with every worker busy: 0)."""
    arrivals = random.Random(seed)
    async with grpc.aio.insecure_channel(normalize_address(address)) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def send(request):
            result = await one_request(stub, request, timeout_s)
            progress.advance(result)
            return result

        started, due, sent = time.perf_counter(), 0.0, []
        for request in requests:
            await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
            sent.append(asyncio.ensure_future(send(request)))
            due += arrivals.expovariate(rate)
        results = await asyncio.gather(*sent)
        return list(results), started, time.perf_counter() - started, 0.0


def level(row: dict) -> tuple[str, float]:
    """A run's load: ("concurrency", C) for a closed loop, ("request_rate", R) for an open one."""
    return ("request_rate", row["request_rate"]) if "request_rate" in row else ("concurrency", row["concurrency"])


def level_label(row: dict) -> str:
    kind, value = level(row)
    return f"{value:g}/s" if kind == "request_rate" else f"x{value}"


def build_requests(prompts: list[dict], count: int, params: GenerationParams, speculate: bool,
                   budget: int) -> list[gateway_pb2.GenerateRequest]:
    """`count` requests over the prompts in order (repeating them when count is larger); request i samples with
    seed i, so a speculative and a plain run draw the same random numbers."""
    requests = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        sampling, stop = params_to_proto(dataclasses.replace(params, seed=i if params.temperature > 0 else None))
        requests.append(gateway_pb2.GenerateRequest(
            prompt=prompt["prompt"], chat=bool(prompt.get("chat")), sampling=sampling, stop=stop,
            speculation=generation_pb2.SpeculationParams(disabled=not speculate, budget=budget if speculate else 0)))
    return requests


async def model_info(address: str) -> dict:
    async with grpc.aio.insecure_channel(normalize_address(address)) as channel:
        try:
            info = await gateway_pb2_grpc.GatewayServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as error:
            raise TreeserveError(f"the gateway at {address} does not answer ({error.code().name}: "
                                 f"{error.details()})") from None
    return {"model": info.model, "max_context": info.max_context, "max_budget": info.max_budget}


def run_bench(args) -> dict:
    from treeserve.prompt_sets import read_prompts
    from treeserve.telemetry import checked_by_budget, round_phases, round_totals, rounds_by_budget

    path = Path(args.prompts) if args.prompts else WORKLOADS[args.workload]
    prompts = read_prompts(path)
    info = asyncio.run(model_info(args.address))
    if any(b > info["max_budget"] for b in args.budgets):
        raise TreeserveError(f"--budgets: the gateway allows at most {info['max_budget']}")
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos)
    params.validate()
    report = {"command": "treeserve bench " + shlex.join(args.argv), "gateway": info, "prompts": str(path),
              "workload": args.workload if not args.prompts else None, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "warmup": args.warmup, "runs": []}
    modes = [("plain", 0)] + [("speculative", budget) for budget in args.budgets]
    if args.request_rate:
        levels = [{"request_rate": rate} for rate in args.request_rate]
    else:
        levels = [{"concurrency": concurrency} for concurrency in args.concurrency]

    def run(load: dict, requests, label: str):
        progress = Progress(label, len(requests), not args.quiet)
        if "request_rate" in load:
            return asyncio.run(run_open_loop(args.address, requests, load["request_rate"], args.timeout_s, progress))
        return asyncio.run(run_level(args.address, requests, load["concurrency"], args.timeout_s, progress))

    def count(load: dict) -> int:
        if "request_rate" in load:
            return args.requests or OPEN_LOOP_REQUESTS
        return requests_at(args.requests, load["concurrency"])

    if args.warmup:  # untimed: a fresh verifier compiles kernels for the first shapes it meets (batch sizes,
        # prompt lengths), seconds that would land in whichever run came first
        warm_params = dataclasses.replace(params, max_new_tokens=min(16, params.max_new_tokens))
        for load in levels:
            for mode, budget in modes:
                requests = build_requests(prompts, count(load), warm_params, mode == "speculative", budget)
                run(load, requests, f"warm-up {mode} {level_label(load)}")
    turns = [(load, turn) for load in levels for turn in range(args.repeats)]
    plain_outputs = {}  # level -> the first plain run's outputs
    for load, turn in turns:
        for mode, budget in modes if turn % 2 == 0 else modes[::-1]:  # plain first, then speculative first, ...
            requests = build_requests(prompts, count(load), params, mode == "speculative", budget)
            label = (f"{mode}{f' budget {budget}' if budget else ''} {level_label(load)}"
                     + (f" turn {turn + 1}/{args.repeats}" if args.repeats > 1 else ""))
            before = round_totals(args.verifier_metrics) if args.verifier_metrics else None
            results, started, wall_s, saturated_s = run(load, requests, label)
            row = {"mode": mode, "budget": budget, "turn": turn} | load | summarize(results, started, wall_s,
                                                                                  saturated_s)
            outputs = [r.token_ids if r.error is None else None for r in results]
            if level(row) not in plain_outputs:  # turn 0 runs plain first
                plain_outputs[level(row)] = outputs
            else:  # lossless: the same tokens as plain decoding (sampled requests too: request i has seed i)
                first = plain_outputs[level(row)]
                same = sum(a is not None and a == b for a, b in zip(outputs, first))
                row["identical_to_plain"] = f"{same}/{len(outputs)}"
                if params.temperature == 0:  # where greedy outputs part, for near_ties to check (bfloat16)
                    row["divergences"] = [{"request": i, "prompt": i % len(prompts)} | found
                                          for i, (a, b) in enumerate(zip(first, outputs))
                                          if a is not None and b is not None and (found := divergence(a, b))]
            if before is not None:
                after = round_totals(args.verifier_metrics)
                row |= round_phases(before, after)
                # How full the verifier's batches ran: the rounds each request spent in them (its prefill round
                # and its decode rounds) over the rounds there were.
                rounds = after.phases.get("round", (0.0, 0.0))[1] - before.phases.get("round", (0.0, 0.0))[1]
                if rounds:
                    row["verifier_rounds"] = int(rounds)
                    row["tokens_per_verifier_round"] = round(row["output_tokens"] / rounds, 2)
                    row["mean_batch"] = round(sum(1 + r.rounds for r in results if r.error is None) / rounds, 2)
                    # round_ms's round_with_prompts is the mean of these (the rest of the rounds decode only)
                    row["rounds_with_prompts"] = int(after.phases.get("round_with_prompts", (0.0, 0.0))[1]
                                                     - before.phases.get("round_with_prompts", (0.0, 0.0))[1])
                chosen = rounds_by_budget(before, after)
                if chosen:  # an adaptive verifier: the rounds by the budget it chose
                    row["adaptive_rounds_by_budget"] = chosen
                checked = checked_by_budget(before, after)
                if checked:  # and what it expected of them against what they did
                    row["adaptive_checked"] = checked
                # Requests it had decode plainly, from their start or midway: drafting did not pay at their batch.
                for key, requests_told in (
                        ("adaptive_plain_admissions", after.plain_admissions - before.plain_admissions),
                        ("adaptive_drafting_stopped", after.drafting_stopped - before.drafting_stopped)):
                    if requests_told:
                        row[key] = int(requests_told)
            report["runs"].append(row)
    for row in report["runs"]:  # each speculative run against the plain run at its load and turn
        if row["mode"] == "speculative":
            plain = next(r for r in report["runs"] if r["mode"] == "plain" and level(r) == level(row)
                         and r["turn"] == row["turn"])
            row["speedup"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else None
            if plain["per_request_tokens_per_s"]:  # what one user sees: below saturation, the open loop's ratio
                own, theirs = row["per_request_tokens_per_s"], plain["per_request_tokens_per_s"]
                row["per_request_speedup"] = round(own / theirs, 3)
            if row["saturated_tokens_per_s"] and plain["saturated_tokens_per_s"]:
                row["saturated_speedup"] = round(row["saturated_tokens_per_s"] / plain["saturated_tokens_per_s"], 3)
    report["summary"] = ratio_summary(report["runs"])
    return report


def ratio_summary(runs: list[dict]) -> list[dict]:
    """Per load and budget, over its turns: the median tok/s of each mode (aggregate and per request), the median
    of the speculative runs' ratios to the plain runs of their turns and their range, and the outputs identical to
    plain decoding's in all."""
    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    summary = []
    for load in sorted({level(row) for row in runs}):
        at_load = [row for row in runs if level(row) == load]
        plain = [row for row in at_load if row["mode"] == "plain"]
        for budget in sorted({row["budget"] for row in at_load if row["mode"] == "speculative"}):
            speculative = [row for row in at_load if row["mode"] == "speculative" and row["budget"] == budget]
            ratios = [row["speedup"] for row in speculative if row.get("speedup") is not None]
            own_ratios = [row["per_request_speedup"] for row in speculative if row.get("per_request_speedup")]
            same, total = (sum(int(row["identical_to_plain"].split("/")[i]) for row in speculative) for i in (0, 1))
            summary.append({load[0]: load[1], "budget": budget, "turns": len(speculative),
                            "plain_tokens_per_s": median(row["tokens_per_s"] for row in plain),
                            "tokens_per_s": median(row["tokens_per_s"] for row in speculative),
                            "plain_per_request_tokens_per_s": median(row["per_request_tokens_per_s"] for row in plain),
                            "per_request_tokens_per_s": median(row["per_request_tokens_per_s"] for row in speculative),
                            "speedup": median(ratios), "speedup_range": [min(ratios), max(ratios)] if ratios else None,
                            "per_request_speedup": median(own_ratios),
                            "per_request_speedup_range": [min(own_ratios), max(own_ratios)] if own_ratios else None,
                            "saturated_speedup": median(row.get("saturated_speedup") for row in speculative),
                            "identical_to_plain": f"{same}/{total}"})
    return summary


def plot(report: dict, path: Path) -> bool:
    """Tokens per second against concurrency (one line per mode and budget) and tokens per round against budget
    (one line per concurrency), as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (speed, accepted) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[tuple[float, float]]] = {}  # the median over turns at each load
    for entry in report["summary"]:
        load = entry.get("concurrency", entry.get("request_rate"))
        if entry["budget"] == report["summary"][0]["budget"]:
            series.setdefault("plain", []).append((load, entry["plain_tokens_per_s"]))
        series.setdefault(f"speculative, budget {entry['budget']}", []).append((load, entry["tokens_per_s"]))
    for name, points in series.items():
        speed.plot(*zip(*sorted(points)), marker="o", label=name)
    open_loop = level(report["runs"][0])[0] == "request_rate"
    loads = sorted({level(row)[1] for row in report["runs"]})
    speed.set_xscale("log", base=2)
    speed.set_xticks(loads, [f"{load:g}" for load in loads])
    speed.minorticks_off()
    speed.set(xlabel="requests a second (open loop)" if open_loop else "concurrent requests",
              ylabel="output tokens/s", title="throughput")
    speed.legend()
    by_load: dict[float, list[tuple[int, float]]] = {}
    for row in report["runs"]:
        # The first turn's: one point per budget (tokens per round hardly move between turns).
        if row["mode"] == "speculative" and row["tokens_per_round"] is not None and row["turn"] == 0:
            by_load.setdefault(level(row)[1], []).append((row["budget"], row["tokens_per_round"]))
    for load, points in sorted(by_load.items()):
        accepted.plot(*zip(*sorted(points)), marker="o", label=f"{load:g}/s" if open_loop else f"{load:g} concurrent")
    budgets = sorted({row["budget"] for row in report["runs"] if row["mode"] == "speculative"})
    accepted.set_xticks(budgets, [str(budget) for budget in budgets])
    accepted.set(xlabel="tree budget", ylabel="tokens per round", title="accepted length")
    if by_load:
        accepted.legend()
    figure.suptitle(f"{Path(report['gateway']['model']).name}: {report['workload'] or Path(report['prompts']).name}"
                    f", temperature {report['temperature']}, {report['max_new_tokens']} new tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def requests_at(asked: int | None, concurrency: int) -> int:
    """Requests in a run at this concurrency: four waves by default, never fewer than the concurrency (or the
    run would not reach it)."""
    return max(asked, concurrency) if asked is not None else max(16, 4 * concurrency)


# Requests per open-loop run when --requests is not given.
OPEN_LOOP_REQUESTS = 64


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_bench_arguments(parser) -> None:
    ints = int_list
    parser.add_argument("--address", required=True, help="the gateway (unix:///path.sock or host:port)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="code",
                        help="fixed prompt set held out from drafter training (default code)")
    parser.add_argument("--prompts", help="a JSONL prompt file instead of --workload")
    parser.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64],
                        help="requests in flight, comma-separated (default 1,4,16,64)")
    parser.add_argument("--request-rate", type=float_list, default=None, metavar="R[,R...]",
                        help="open loop instead of --concurrency: requests arrive at R a second (Poisson, seeded), "
                             "however many are in flight; comma-separated rates")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run, at least the concurrency (default: 4x the concurrency, at least 16; "
                             f"open loop: {OPEN_LOOP_REQUESTS})")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--budgets", type=ints, default=[16], help="tree budgets, comma-separated (default 16)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed warm-up (every mode at every concurrency, 16 new tokens)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--verifier-metrics", metavar="HOST:PORT",
                        help="the verifier's --metrics-listen, for its round time by phase")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode at each load, taking turns; ratios pair each turn's runs, and the "
                             "summary gives their median and range (default 1)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per request (default 600)")
    parser.add_argument("--out", default="bench.json", help="JSON results (default bench.json); the plot beside it")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def main_bench(args) -> int:
    counts = [args.max_new_tokens, args.repeats, *args.concurrency, *args.budgets] + (
        [args.requests] if args.requests else [])
    if not args.concurrency or not args.budgets or args.requests == 0 or min(counts) < 1:
        raise TreeserveError("--requests, --max-new-tokens, --repeats, --concurrency and --budgets must be positive")
    if args.request_rate is not None and (not args.request_rate or min(args.request_rate) <= 0):
        raise TreeserveError("--request-rate must be positive requests a second")
    report = run_bench(args)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1) + "\n")
    picture = out.with_suffix(".png")
    plotted = plot(report, picture)
    for row in report["runs"]:
        budget = f" budget {row['budget']}" if row["mode"] == "speculative" else ""
        turn = f" turn {row['turn'] + 1}" if args.repeats > 1 else ""
        print(f"{row['mode']:11s}{budget:10s} {level_label(row):<7s}{turn} {row['tokens_per_s']:9.1f} tok/s  "
              f"ttft p50 {row['ttft_ms']['p50']} ms  itl p50 {row['itl_ms']['p50']} ms  "
              f"tokens/round {row['tokens_per_round']}  errors {row['errors'] or 0}"
              + (f"  x{row['speedup']} vs plain (x{row.get('saturated_speedup')} while saturated, "
                 f"x{row.get('per_request_speedup')} per request), identical "
                 f"{row['identical_to_plain']}" if "speedup" in row else ""))
    if args.repeats > 1:
        for entry in report["summary"]:
            low, high = entry["speedup_range"]
            load = f"{entry['request_rate']:g}/s" if "request_rate" in entry else f"x{entry['concurrency']}"
            print(f"budget {entry['budget']} {load}: median x{entry['speedup']} vs plain over {entry['turns']} turns "
                  f"(x{low}-x{high}), identical {entry['identical_to_plain']}")
    print(f"wrote {out}" + (f" and {picture}" if plotted else " (no plot: matplotlib is not installed)"))
    return 0
