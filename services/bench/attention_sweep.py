"""python -m treeserve.bench.attention_sweep: choose the tree-attention kernel's launch settings on this GPU.

Times one layer's tree attention (the Triton kernel, splits combined) for every combination of the settings in
`treeserve.kernels.tree_attention.TUNING` over a set of (batch, tree rows, context) shapes, each as GPU time
inside a CUDA graph. A setting's score is its mean slowdown against the best setting of each shape; the best
is printed (to set as TUNING's defaults for this GPU) and written with every figure to --out.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys

import torch

from treeserve.settings import OneLineErrorParser

SETTINGS = {"query_rows": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3),
            "programs_per_sm": (1, 2, 4)}


def attention_case(batch: int, rows: int, context: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype):
    """Arguments of tree_attention: `batch` requests with `context` committed tokens in shuffled 16-token
    pages and a `rows`-node chain each (random keys, values and queries)."""
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + context)
    block = 16
    pages = -(-(context + rows) // block)
    keys = torch.randn(batch * pages, block, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    values = torch.randn_like(keys)
    q = torch.randn(batch, rows, heads, head_dim, generator=g, device="cuda").to(dtype)
    tables = torch.randperm(batch * pages, generator=g, device="cuda").to(torch.int32).view(batch, pages)
    prefix = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    sizes = torch.full((batch,), rows, dtype=torch.int32, device="cuda")
    mask = torch.ones(rows, rows, dtype=torch.int8, device="cuda").tril().expand(batch, rows, rows).contiguous()
    return q, keys, values, tables, prefix, sizes, mask


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.attention_sweep", description=__doc__)
    p.add_argument("--shapes", default="1x1x1024,1x65x1024,1x129x1024,1x1x8192,1x65x8192,1x65x32768,16x17x1024,"
                   "64x9x1024", help="batch x tree rows x context, comma-separated (default: decode and trees at "
                   "1k-32k, and two batched shapes)")
    p.add_argument("--heads", default="32/8/128", help="query heads/key-value heads/head dim (default Llama-3-8B)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="write every figure here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_sweep: error: no CUDA device", file=sys.stderr)
        return 1
    from treeserve.kernels import tree_attention as kernel
    from treeserve.bench.graph_bench import replay_ms

    heads, kv_heads, head_dim = (int(x) for x in args.heads.split("/"))
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    cases = {shape: attention_case(*shape, heads, kv_heads, head_dim, getattr(torch, args.dtype)) for shape in shapes}
    results = []
    default = dict(kernel.TUNING)
    for values in itertools.product(*SETTINGS.values()):
        setting = dict(zip(SETTINGS, values))
        kernel.TUNING.update(setting)
        try:
            times = {shape: replay_ms(lambda case=case: kernel.tree_attention(*case), args.repeats)
                     for shape, case in cases.items()}
        except Exception as error:  # e.g. more shared memory than the GPU has: not a candidate
            print(f"{setting}: skipped ({type(error).__name__})", flush=True)
            continue
        results.append((setting, times))
        print(setting, " ".join(f"{t * 1000:.1f}" for t in times.values()), "us", flush=True)
    kernel.TUNING.update(default)
    best_per_shape = {shape: min(times[shape] for _, times in results) for shape in shapes}
    scored = sorted(((sum(times[s] / best_per_shape[s] for s in shapes) / len(shapes), setting, times)
                     for setting, times in results), key=lambda row: row[0])
    name = lambda shape: "x".join(map(str, shape))  # noqa: E731
    for score, setting, times in scored[:5]:
        print(f"score {score:.3f}: {json.dumps(setting)}")
    print("default:", json.dumps(default), "score",
          next((f"{score:.3f}" for score, setting, _ in scored if setting == default), "not swept"))
    print("best:", json.dumps(scored[0][1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "command": "python -m treeserve.bench.attention_sweep "
                       + shlex.join(sys.argv[1:] if argv is None else argv),
                       "best": scored[0][1], "default": default,
                       "runs": [{"setting": setting, "score": round(score, 4),
                                 "us": {name(s): round(times[s] * 1000, 2) for s in shapes}}
                                for score, setting, times in scored]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
