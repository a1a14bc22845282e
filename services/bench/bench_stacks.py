"""python -m treeserve.bench.bench_stacks: the serving tables of docs/benchmarks.md in one command.

For each drafter, starts the three services as `treeserve up` does (with the verifier's metrics on), runs
`treeserve bench` for every workload and temperature against it (plain and speculative side by side), and stops
it; then writes `tables.md`: per workload and temperature, tok/s by concurrency (or by request rate, with
--request-rate: open loops, compared per request), each drafter's speculative run beside the plain run of its
own stack. Every bench's JSON and PNG, and each stack's logs, stay in --out-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.bench.stack_bench import DRAFTER_CONFIGS as DRAFTERS  # name -> (drafter --kind, --tree)


def bench_name(drafter: str, workload: str, temperature: float) -> str:
    return f"{drafter}-{workload}-t{temperature:g}"


def render_tables(out_dir: Path, drafters: list[str], workloads: list[str], temperatures: list[float]) -> str:
    """Markdown: one table per workload and temperature, a row per load, for each drafter its stack's plain run and
    its speculative run with the ratio. Closed loops: tok/s (the ratio while saturated too, where the run had such
    a stretch). Open loops: each request's own tok/s, the aggregate in brackets (below saturation both modes
    deliver what arrives)."""
    from treeserve.bench.load import level, ratio_summary

    lines = []
    for workload in workloads:
        for temperature in temperatures:
            reports = {d: json.loads((out_dir / f"{bench_name(d, workload, temperature)}.json").read_text())
                       for d in drafters}
            summaries = {d: ratio_summary(report["runs"]) for d, report in reports.items()}
            loads = sorted({level(row) for report in reports.values() for row in report["runs"]})
            open_loop = loads[0][0] == "request_rate"
            turns = max(entry["turns"] for summary in summaries.values() for entry in summary)
            about = ("each request's tok/s on average (all requests' together in brackets); speculative as a ratio "
                     "of the plain run of the same stack, per request" if open_loop else
                     "tok/s; speculative as a ratio of the plain run of the same stack (while saturated in brackets)")
            if turns > 1:
                about += f"; medians over {turns} turns of each mode, the ratios' range after them"
            lines += [f"### {workload}, temperature {temperature:g}", "", about, "",
                      f"| {'requests a second' if open_loop else 'concurrency'} | "
                      + " | ".join(f"plain ({d}) | {d}" for d in drafters) + " |",
                      "|---|" + "---|---|" * len(drafters)]
            for load in loads:
                cells = []
                for drafter in drafters:
                    entries = [entry for entry in summaries[drafter] if level(entry) == load]
                    plain = entries[0]  # each entry carries its load's plain medians
                    if open_loop:
                        cells.append(f"{plain['plain_per_request_tokens_per_s']:.0f} "
                                     f"[{plain['plain_tokens_per_s']:.0f}]")
                        cells += [f"{entry['per_request_tokens_per_s']:.0f} ({entry['per_request_speedup']:.2f}x"
                                  f"{ratio_range(entry, 'per_request_speedup_range')}) "
                                  f"[{entry['tokens_per_s']:.0f}], identical {entry['identical_to_plain']}"
                                  for entry in entries]
                        continue
                    cells.append(f"{plain['plain_tokens_per_s']:.0f}")
                    for entry in entries:
                        saturated = f" [{entry['saturated_speedup']:.2f}x]" if entry["saturated_speedup"] else ""
                        cells.append(f"{entry['tokens_per_s']:.0f} ({entry['speedup']:.2f}x{saturated}"
                                     f"{ratio_range(entry)}, identical {entry['identical_to_plain']})")
                lines.append(f"| {load[1]:g} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def ratio_range(entry: dict, key: str = "speedup_range") -> str:
    """The range of a load's ratios over its turns (nothing for one turn)."""
    if entry["turns"] < 2 or entry[key] is None:
        return ""
    low, high = entry[key]
    return f", {low:.2f}-{high:.2f}"


def parse_args(argv: list[str] | None):
    from treeserve.bench.load import WORKLOADS, float_list, int_list

    p = argparse.ArgumentParser(prog="python -m treeserve.bench.bench_stacks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="bench JSON and plots, stack logs, and tables.md go here")
    p.add_argument("--target", default="smollm2-135m", help="default smollm2-135m")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--speculation", default="adaptive", choices=("fixed", "adaptive"), help="default adaptive")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help=f"comma-separated, of {', '.join(DRAFTERS)} (default all)")
    p.add_argument("--workloads", default="code,chat", help=f"comma-separated, of {', '.join(sorted(WORKLOADS))}")
    p.add_argument("--prompts", help="a JSONL prompt file instead of --workloads (its tables say 'prompts')")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated (default 0,0.7)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated (default 1,4,16,64)")
    p.add_argument("--request-rate", metavar="R[,R...]",
                   help="open loops instead of --concurrency: requests a second, comma-separated (treeserve bench's)")
    p.add_argument("--requests", type=int, help="requests per run (default: treeserve bench's, four waves)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--budget", type=int, default=16, help="the requests' tree budget (default 16)")
    p.add_argument("--repeats", type=int, default=1,
                   help="turns of each mode at each load (treeserve bench's --repeats; default 1)")
    p.add_argument("--metrics-port", type=int, default=9464, help="the verifier's metrics port (default 9464)")
    p.add_argument("--start-timeout-s", type=float, default=600, help="how long to wait for each stack")
    p.add_argument("--up-flags", default="", metavar="FLAGS",
                   help="more `treeserve up` flags for every stack, as one string (say \"--verifier-adaptive-give-up-s "
                        "0.25\"): a service setting compared across runs")
    args = p.parse_args(argv)
    args.drafters = [d for d in args.drafters.split(",") if d]
    unknown = [d for d in args.drafters if d not in DRAFTERS]
    if unknown or not args.drafters:
        p.error(f"--drafters: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(DRAFTERS)}")
    args.workloads = ["prompts"] if args.prompts else [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in args.workloads) and not args.prompts:
        p.error(f"--workloads: choose from {', '.join(sorted(WORKLOADS))}")
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
        int_list(args.concurrency)
        rates = float_list(args.request_rate) if args.request_rate is not None else None
    except (ValueError, argparse.ArgumentTypeError) as error:
        p.error(str(error))
    if rates is not None and (not rates or min(rates) <= 0):
        p.error("--request-rate must be positive requests a second")
    return args


def main(argv: list[str] | None = None) -> int:
    from treeserve.cli import main as treeserve_main, up_settings
    from treeserve.cli.launcher import Stack, start_stack

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for drafter in args.drafters:
        kind, tree = DRAFTERS[drafter]
        runtime = out_dir / f"runtime-{drafter}"
        runtime.mkdir(exist_ok=True)
        up = up_settings("--target", args.target, "--drafter", kind, "--tree", tree, "--budget", str(args.budget),
                         "--device", args.device, "--dtype", args.dtype, "--speculation", args.speculation,
                         "--verifier-metrics", f"127.0.0.1:{args.metrics_port}", "--grace-s", "2",
                         "--start-timeout-s", str(args.start_timeout_s), *shlex.split(args.up_flags))
        stack = Stack(runtime)
        try:
            print(f"== {drafter}: starting the stack (logs in {runtime})", file=sys.stderr, flush=True)
            gateway = start_stack(stack, up)
            for workload in args.workloads:
                for temperature in args.temperatures:
                    out = out_dir / f"{bench_name(drafter, workload, temperature)}.json"
                    flags = ["bench", "--address", gateway, "--temperature", f"{temperature:g}", "--concurrency",
                             args.concurrency, "--max-new-tokens", str(args.max_new_tokens), "--budgets",
                             str(args.budget), "--verifier-metrics", up.verifier_metrics, "--out", str(out)]
                    flags += ["--request-rate", args.request_rate] if args.request_rate else []
                    flags += ["--prompts", args.prompts] if args.prompts else ["--workload", workload]
                    flags += ["--requests", str(args.requests)] if args.requests else []
                    flags += ["--repeats", str(args.repeats)] if args.repeats > 1 else []
                    print(f"== {drafter}: {workload}, temperature {temperature:g}", file=sys.stderr, flush=True)
                    if treeserve_main(flags) != 0:
                        raise TreeserveError(f"treeserve bench failed for {drafter}, {workload}, "
                                             f"temperature {temperature:g}")
        finally:
            stack.stop(up.grace_s)
    tables = out_dir / "tables.md"
    tables.write_text(render_tables(out_dir, args.drafters, args.workloads, args.temperatures))
    print(f"wrote {tables}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TreeserveError as error:
        print(f"bench_stacks: error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # the running stack was stopped on the way out
        print("bench_stacks: interrupted", file=sys.stderr)
        sys.exit(130)
