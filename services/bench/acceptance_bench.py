"""python -m treeserve.bench.acceptance_bench: mean accepted length of drafters side by side, greedy.

Loads the target once and generates every prompt of a JSONL file ({"prompt": ..., "chat": bool} per line) with
plain decoding, the n-gram drafter, and a DFlash checkpoint (--drafter-path, default the one shipped for the
target) as chain, as DDTree and merged with prompt lookup at each budget (--drafters picks among them). Reports
per configuration the tokens per round (bonus included: 1.0 is plain decoding) over all prompts, and how many
outputs equal plain decoding token for token. On a GPU the verifier and the DFlash drafter replay CUDA graphs, as
`treeserve generate` does. Writes JSON with --out and prints a Markdown table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.tree import MAX_BUDGET


DRAFTERS = {"ngram": "ngram", "chain": "dflash chain", "ddtree": "dflash ddtree", "merged": "merged"}  # -> label
DFLASH_DRAFTERS = {  # -> (load_drafter kind, tree)
    "chain": ("dflash", "chain"), "ddtree": ("dflash", "ddtree"), "merged": ("merged", "ddtree")}


def configurations(args) -> list[tuple[str, str, int]]:
    """(label, kind, budget) in table order."""
    kinds = [k for k in DRAFTERS if k in args.drafters]
    return [(DRAFTERS[kind], kind, budget) for kind in kinds for budget in args.budgets]


def run(args) -> dict:
    from treeserve.drafter import load_drafter
    from treeserve.prompt_sets import encode_prompts, read_prompts
    from treeserve.loading import load_target
    from treeserve.params import GenerationParams
    from treeserve.verifier import generate

    records = read_prompts(args.prompts)[:args.limit]  # a bad prompts file fails before the target loads
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    tok = target.tokenizer
    encoded = encode_prompts(tok, records)
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    graphs = args.device == "cuda"
    drafters = {"ngram": load_drafter("ngram")}
    for kind, (drafter_kind, tree) in DFLASH_DRAFTERS.items():  # (without a path: the target's shipped one)
        if kind in args.drafters:
            drafters[kind] = load_drafter(drafter_kind, args.drafter_path, tree, target=target, max_batch=1,
                                          graphs=graphs, max_budget=max(args.budgets))
    verifiers = one_request_verifiers(target.model, drafters.values(), encoded, args) if graphs else {}
    plain = [generate(target.model, tok, ids, params, verifier=verifiers.get(())).token_ids for ids in encoded]
    rows = []
    results = {"command": " ".join(["python -m treeserve.bench.acceptance_bench", *args.argv]),
               "target": args.target, "drafter_path": str(args.drafter_path or "shipped"),
               "device": args.device, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
               "prompts_file": str(args.prompts), "rows": rows}
    for label, kind, budget in configurations(args):
        started, rounds, tokens, identical = time.perf_counter(), 0, 0, 0
        drafter = drafters[kind]
        for ids, reference in zip(encoded, plain):
            result = generate(target.model, tok, ids, params, drafter, budget,
                              verifiers.get(tuple(drafter.feature_layer_ids)))
            rounds, tokens = rounds + result.rounds, tokens + result.round_tokens
            identical += result.token_ids == reference
        rows.append({"drafter": label, "budget": budget, "mean_accepted": tokens / max(rounds, 1),
                     "rounds": rounds, "identical_to_plain": identical, "prompts": len(encoded),
                     "seconds": round(time.perf_counter() - started, 2)})
        print(f"{label} budget {budget}: {rows[-1]['mean_accepted']:.2f} tokens/round, {identical}/{len(encoded)} "
              "identical to plain", file=sys.stderr, flush=True)
        if args.out:  # after every row, so that a run cut short keeps what it measured
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


def one_request_verifiers(model, drafters, encoded: list[list[int]], args) -> dict:
    """On a GPU, one verifier per set of feature layers the drafters read, its CUDA graphs captured once for one
    request and every tree size up to the largest budget, as `treeserve generate` verifies."""
    from treeserve.verifier.graphs import build_verifier

    largest = max(args.budgets)
    verifiers = {}
    for layers in {()} | {tuple(d.feature_layer_ids) for d in drafters}:
        verifier = build_verifier(model, max_batch=1, graphs=True, max_tree=largest + 1,
                                  kv_cache_tokens=max(map(len, encoded)) + args.max_new_tokens + largest + 1)
        verifier.capture(layers)
        verifiers[layers] = verifier
    return verifiers


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m treeserve.bench.acceptance_bench", description=__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter-path", type=Path,
                        help="a DFlash checkpoint folder (default: the one shipped for the target)")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL of {\"prompt\", \"chat\"}")
    parser.add_argument("--limit", type=int, help="use the first N prompts")
    parser.add_argument("--budgets", default="8,16,32,64", help="comma-separated (default 8,16,32,64)")
    parser.add_argument("--drafters", default=",".join(DRAFTERS),
                        help=f"comma-separated, of {', '.join(DRAFTERS)} (default all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    try:
        args.budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets: {args.budgets!r} is not a comma-separated list of numbers")
    if not all(1 <= b <= MAX_BUDGET for b in args.budgets):
        parser.error(f"--budgets: each must be between 1 and {MAX_BUDGET}")
    args.drafters = args.drafters.split(",")
    unknown = [d for d in args.drafters if d not in DRAFTERS]
    if unknown:
        parser.error(f"--drafters: unknown {', '.join(unknown)}; choose from {', '.join(DRAFTERS)}")
    try:
        results = run(args)
    except TreeserveError as error:
        print(f"acceptance_bench: error: {error}", file=sys.stderr)
        return 1
    print("| drafter | budget | mean accepted | identical to plain |")
    print("|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['drafter']} | {row['budget']} | {row['mean_accepted']:.2f} | "
              f"{row['identical_to_plain']}/{row['prompts']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
