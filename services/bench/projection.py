"""python -m treeserve.bench.projection: projected speculative decoding speed for a target whose verification
costs were measured (graph_bench's JSON) and whose acceptance was measured on another (acceptance_bench's JSON).

A PROJECTION, not a measurement: tokens per round come from one target and its drafters; round times from
another's verification costs (by batch and tree bucket) plus fixed per-round drafter costs (given per drafter:
its compute and transport measured at one request; held constant over batch sizes, which flatters large
batches). Per batch size and drafter configuration:

    tokens/s per request = tokens per round / (verify ms(batch, budget + 1 nodes) + drafter ms)
    speedup              = that / (1 / decode ms(batch))
    break-even           = round ms / decode ms: the tokens per round a drafter must reach to pay at all

and the adaptive choice: the budget (0 = plain decoding) with the best tokens/s. Writes JSON with --out.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.loading.hf_folder import read_json
from treeserve.verifier.graphs import TREE_BUCKETS


def verify_costs(report: dict) -> dict[tuple[int, int], float]:
    """(batch, tree nodes) -> ms, graphs mode, from graph_bench's JSON."""
    costs = {(row["batch"], row["tree_nodes"]): row["ms"] for row in report.get("verification", [])
             if row.get("graphs") and "ms" in row}
    if not costs:
        raise TreeserveError("no graph-mode verification rows in the costs file (graph_bench --modes graphs)")
    return costs


def acceptance(report: dict) -> dict[str, dict[int, float]]:
    """drafter configuration -> budget -> tokens per round, from acceptance_bench's JSON."""
    found: dict[str, dict[int, float]] = {}
    for row in report.get("rows", []):
        found.setdefault(row["drafter"].replace(" ", "-"), {})[row["budget"]] = row["mean_accepted"]
    if not found:
        raise TreeserveError("no rows in the acceptance file")
    return found


def project(costs: dict[tuple[int, int], float], accepted: dict[str, dict[int, float]],
            drafter_ms: dict[str, float]) -> list[dict]:
    rows = []
    for batch in sorted({b for b, _ in costs}):
        decode_ms = costs.get((batch, 1))
        if decode_ms is None:
            continue
        for drafter, by_budget in sorted(accepted.items()):
            options = {0: (1.0, decode_ms)}
            for budget, tokens in by_budget.items():
                nodes = next((size for size in TREE_BUCKETS if size >= budget + 1), None)
                if nodes is None or (batch, nodes) not in costs:
                    continue
                options[budget] = (tokens, costs[(batch, nodes)] + drafter_ms.get(drafter, 0.0))
            for budget, (tokens, ms) in sorted(options.items()):
                if budget == 0:
                    continue
                rows.append(_row(batch, drafter, budget, tokens, ms, decode_ms))
            best = max(options, key=lambda b: options[b][0] / options[b][1])
            rows.append(_row(batch, drafter, best, *options[best], decode_ms) | {"adaptive": True})
    return rows


def _row(batch: int, drafter: str, budget: int, tokens: float, ms: float, decode_ms: float) -> dict:
    per_request = tokens / ms * 1000
    return {"batch": batch, "drafter": drafter, "budget": budget, "tokens_per_round": round(tokens, 3),
            "round_ms": round(ms, 3), "tokens_per_s_per_request": round(per_request, 1),
            "tokens_per_s": round(per_request * batch, 1),
            "plain_tokens_per_s": round(batch * 1000 / decode_ms, 1),
            "speedup": round(per_request * decode_ms / 1000, 3),
            "break_even_tokens_per_round": round(ms / decode_ms, 3)}


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.projection", description=__doc__)
    p.add_argument("--costs", required=True, help="graph_bench JSON (graphs mode) of the target to project for")
    p.add_argument("--acceptance", required=True, help="acceptance_bench JSON (tokens per round by budget)")
    p.add_argument("--drafter-ms", default="",
                   help="per-round drafter cost, compute plus transport: NAME=MS,... (names as in the acceptance "
                        "file, spaces as dashes; default 0)")
    p.add_argument("--out", help="write the rows here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        drafter_ms = {}
        for item in filter(None, args.drafter_ms.split(",")):
            name, _, value = item.partition("=")
            try:
                drafter_ms[name] = float(value)
            except ValueError:
                raise TreeserveError(f"--drafter-ms: expected NAME=MS, got {item!r}") from None
        rows = project(verify_costs(read_json(Path(args.costs))), acceptance(read_json(Path(args.acceptance))),
                       drafter_ms)
    except TreeserveError as error:
        print(f"projection: error: {error}", file=sys.stderr)
        return 1
    print("PROJECTION (acceptance of one target, verification costs of another)")
    for row in rows:
        mark = "adaptive ->" if row.get("adaptive") else ""
        print(f"batch {row['batch']:3d} {row['drafter']:14s} {mark:11s} budget {row['budget']:3d}: "
              f"{row['tokens_per_round']:.2f} tok/round, {row['round_ms']:7.2f} ms/round, "
              f"{row['tokens_per_s']:8.1f} tok/s ({row['plain_tokens_per_s']:.1f} plain), x{row['speedup']}, "
              f"break-even {row['break_even_tokens_per_round']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m treeserve.bench.projection "
                       + shlex.join(sys.argv[1:] if argv is None else argv), "projection": True,
                       "drafter_ms": drafter_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
