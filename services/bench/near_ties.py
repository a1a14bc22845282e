"""python -m treeserve.bench.near_ties: whether greedy outputs that part ways do so at near-ties of the target.

In bfloat16 a forward rounds differently with its shapes (the batch, the tree, the GEMM kernel picked for them),
so a speculative run's greedy output may part from plain decoding's, and one plain run's from another's. That is
lossless only where the two tokens are the target's top choices and hardly apart: at the first position where two
outputs differ, the target alone (one request, eager, on the same device and dtype) must give each of the two tokens
a logit within `tolerance` times the largest logit's magnitude (at least 1) of the largest. `treeserve bench`
records, for greedy runs, each request's divergence from the first plain run at its load ("divergences"); this
checks them.

    python -m treeserve.bench.near_ties BENCH.json [...] --target smollm2-135m --device cuda --dtype bfloat16
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import torch

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.loading import LoadedModel
from treeserve.loading.hf_folder import read_json
from treeserve.models import KVCache, TreeAttention

# bfloat16 keeps 8 bits of mantissa, so a logit of about 20 is held to 0.125, and the rounding of 30 layers in other
# shapes moves it by a few of those steps: plain decoding parts from itself at such gaps (docs/benchmarks.md, "Is it
# lossless?"). 2^-5 is also the bfloat16 tolerance the graph tests hold two shapes of one forward to.
NEAR_TIE = 2 ** -5


@torch.inference_mode()
def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The target's logits for the token after `ids`, alone: one request, a contiguous cache, eager, float32 out."""
    cache = KVCache(model.config, len(ids), model.dtype, model.device)
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool, device=model.device).tril()
    logits, _ = model(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device),
                      TreeAttention(cache, mask))
    return logits[-1].float()


@dataclasses.dataclass
class Gap:
    """Two tokens' logits after a context: how far the lower of them is below the largest logit, and the scale a
    tolerance is relative to."""

    gap: float
    scale: float  # the largest logit's magnitude, at least 1

    def near_tie(self, tolerance: float = NEAR_TIE) -> bool:
        return self.gap <= tolerance * self.scale


def logit_gap(model, context: list[int], one: int, other: int) -> Gap:
    logits = next_token_logits(model, context)
    top = logits.max()
    return Gap((top - torch.minimum(logits[one], logits[other])).item(), max(1.0, logits.abs().max().item()))


def usable(report: dict, prompts_file: Path | None = None) -> list[dict]:
    """The report's prompts, once it is known to hold greedy runs with their divergences recorded."""
    from treeserve.prompt_sets import read_prompts

    if not isinstance(report, dict) or not {"runs", "prompts", "temperature"} <= report.keys():
        raise TreeserveError("not a treeserve bench report (no runs, prompts or temperature)")
    compared = [row for row in report["runs"] if "identical_to_plain" in row]
    if report["temperature"] != 0 or any("divergences" not in row for row in compared):
        raise TreeserveError("the report holds no recorded divergences to check: not a greedy run, or made before "
                             "treeserve bench recorded them")
    prompts = read_prompts(prompts_file or Path(report["prompts"]))
    wanted = max((found["prompt"] for row in compared for found in row["divergences"]), default=-1)
    if wanted >= len(prompts):
        raise TreeserveError(f"the report's divergences name prompt {wanted}, and the prompt file holds "
                             f"{len(prompts)}: not the bench's prompt file")
    return prompts


def check(report: dict, prompts: list[dict], target: LoadedModel, tolerance: float = NEAR_TIE) -> dict:
    """Every divergence a bench report recorded, checked on `target` (`prompts`: the report's, from `usable`):
    counts, and each one that is not a near-tie or could not be checked (an output that ended where the other went
    on, or a request that failed in one of the runs, which identical_to_plain counts and no divergence records),
    with its run."""
    summary = {"tolerance": tolerance, "checked": 0, "near_ties": 0, "largest_relative_gap": None,
               "not_near_ties": [], "unchecked": []}
    for row in report["runs"]:
        if "identical_to_plain" not in row:
            continue
        run = {"mode": row["mode"], "turn": row["turn"], "concurrency": row.get("concurrency"),
               "request_rate": row.get("request_rate")}
        identical, requests = map(int, row["identical_to_plain"].split("/"))
        if identical + len(row["divergences"]) < requests:
            summary["unchecked"].append(run | {"failed_requests": requests - identical - len(row["divergences"])})
        for found in row["divergences"]:
            where = run | {"request": found["request"], "at": found["at"]}
            if found["first"] is None or found["other"] is None:
                summary["unchecked"].append(where)
                continue
            prompt = prompts[found["prompt"]]
            context = target.tokenizer.encode_prompt(prompt["prompt"], bool(prompt.get("chat"))) + found["shared"]
            gap = logit_gap(target.model, context, found["first"], found["other"])
            summary["checked"] += 1
            relative = gap.gap / gap.scale
            summary["largest_relative_gap"] = max(relative, summary["largest_relative_gap"] or 0.0)
            if gap.near_tie(tolerance):
                summary["near_ties"] += 1
            else:
                summary["not_near_ties"].append(where | {"gap": gap.gap, "scale": gap.scale})
    return summary


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.near_ties",
                           description="Check that greedy outputs recorded by treeserve bench part ways only at "
                                       "near-ties of the target. Exits 1 unless every divergence is one.")
    p.add_argument("reports", nargs="+", help="treeserve bench JSON files (greedy runs)")
    p.add_argument("--target", default="smollm2-135m", help="the model the bench served (name, HF folder, .gguf)")
    p.add_argument("--device", required=True, choices=("cpu", "cuda"), help="the device the bench's verifier ran on")
    p.add_argument("--dtype", required=True, choices=("float32", "bfloat16"),
                   help="the dtype the bench's verifier served in")
    p.add_argument("--tolerance", type=float, default=NEAR_TIE,
                   help="the largest logit gap of a near-tie, relative to the largest logit (default 2^-5)")
    p.add_argument("--prompts", help="the bench's prompt file, where its report names one not found from here")
    p.add_argument("--out", help="write the summaries here as JSON")
    args = p.parse_args(argv)
    if args.tolerance <= 0:
        p.error("--tolerance must be positive")
    return args


def main(argv=None) -> int:
    from treeserve.loading import load_target

    args = parse_args(argv)
    prompts_file = Path(args.prompts) if args.prompts else None
    try:
        reports = {path: read_json(Path(path)) for path in args.reports}
        prompts = {}
        for path, report in reports.items():  # every report usable before the model loads
            try:
                prompts[path] = usable(report, prompts_file)
            except TreeserveError as error:
                raise TreeserveError(f"{path}: {error}") from None
        target = load_target(args.target, args.device, args.dtype)
        summaries = {path: check(report, prompts[path], target, args.tolerance) for path, report in reports.items()}
    except TreeserveError as error:
        print(f"near_ties: error: {error}", file=sys.stderr)
        return 1
    clean = True
    for path, summary in summaries.items():
        bad, unchecked = summary["not_near_ties"], summary["unchecked"]
        clean = clean and not bad and not unchecked
        largest = summary["largest_relative_gap"]
        print(f"{path}: {summary['checked']} divergences checked, {summary['near_ties']} near-ties, {len(bad)} not, "
              f"{len(unchecked)} unchecked (an output that ended where the other went on, or failed requests)"
              + (f"; largest gap {largest:.4f} of the top logit" if largest is not None else ""))
        for where in bad:
            print(f"  NOT a near-tie: {where}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m treeserve.bench.near_ties "
                       + shlex.join(sys.argv[1:] if argv is None else argv), "summaries": summaries}, f, indent=1)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
