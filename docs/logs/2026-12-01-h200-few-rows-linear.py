"""Issue 5: the GEMMs of a 65-row tree (a 64-node tree and its root) with a Triton kernel for few rows (below)
instead of cuBLAS. cuBLAS takes 6.7 us more per gate/up call at 65 rows than at 1 (gemm-rows.json), most of the
65-row verification's extra GEMM time. The kernel: each program streams a slice of the weight's output columns once
against all the rows (the product computed transposed, so the weight's tile fills the matrix unit's 64-row side),
optionally over a part of the inner dimension, float32 partials then summed in a fixed order by a second kernel.
Measured on 2026-12-01 slower than cuBLAS on every projection, so it lives here, not in kernels/.
Two parts, in one process on the 8B shape, bfloat16:
  1. each projection (qkv, o, gate/up, down, LM head) at 65 rows: cuBLAS through F.linear and each tiling of the
     kernel, GPU time per call inside a CUDA graph (8 weight copies taken in turn, as -gemm-rows.py), the largest
     difference from cuBLAS's output; the fastest tiling per projection;
  2. the 64-node over 1-node ratio (verify_variants.measure, as 2026-11-30-h200-verify-ratio-64-nodes.py measures
     it) with the 65-row projections through the kernel at those tilings: all of them, and only those faster than
     cuBLAS by 2 % or more.
From the repository root on the H200: python3 docs/logs/2026-12-01-h200-few-rows-linear.py --out few-rows-linear.json
(writes few-rows-linear.json and, for part 2, few-rows-linear-ratio.json). On a CPU, TRITON_INTERPRET=1 and --cpu
check the script on the tiny shape with two tilings."""
import json, os, sys, time
from dataclasses import dataclass
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from treeserve.verifier.graph_bench import SHAPES
from verify_variants import TREE, measure

CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
SHAPE = "tiny" if CPU else "llama3-8b"
COPIES, CALLS = (1, 2) if CPU else (8, 32)


@dataclass(frozen=True)
class FewRowsTiles:
    """One launch's tiling: output columns a program, inner-dimension step, splits of the inner dimension, and the
    compiler's pipeline depth and warps."""
    block_n: int = 64
    block_k: int = 128
    splits: int = 1
    stages: int = 4
    warps: int = 4


@triton.jit
def _few_rows_linear_kernel(x_ptr, w_ptr, out_ptr, rows, n_size, stride_x, stride_w, stride_out, stride_split,
                            BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            K_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row = tl.arange(0, BLOCK_ROWS)
    col_ok = cols < n_size
    row_ok = row < rows
    k_start = split * K_PER_SPLIT
    # The product is computed transposed (columns x rows), so the weight's tile is the dot's left operand and
    # fills the matrix unit's 64-row side whatever the number of rows.
    acc = tl.zeros((BLOCK_N, BLOCK_ROWS), dtype=tl.float32)
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        inner = k_start + step + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None] * stride_w + inner[None, :], mask=col_ok[:, None], other=0.0)
        x = tl.load(x_ptr + row[None, :] * stride_x + inner[:, None], mask=row_ok[None, :], other=0.0)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    out = out_ptr + split * stride_split + row[None, :] * stride_out + cols[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + split * size + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=ok)


def fits(x: torch.Tensor, weight: torch.Tensor, tiles: FewRowsTiles) -> bool:
    """Whether the kernel takes these operands with these tiles: contiguous rows, an inner dimension that the
    splits and steps divide, and at most 128 rows (the matrix unit's operand is padded to a power of two)."""
    inner = weight.shape[1]
    return (x.dim() == 2 and x.shape[0] <= 128 and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.shape[1] == inner and inner % (tiles.splits * tiles.block_k) == 0)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, tiles: FewRowsTiles = FewRowsTiles()) -> torch.Tensor:
    """x (rows, K) @ weight (N, K).T -> (rows, N) in x's dtype, accumulated in float32; `fits` must hold."""
    rows, inner = x.shape
    n_size = weight.shape[0]
    out = torch.empty(rows, n_size, dtype=x.dtype, device=x.device)
    block_rows = max(16, triton.next_power_of_2(rows))
    grid = (triton.cdiv(n_size, tiles.block_n), tiles.splits)
    target = out if tiles.splits == 1 else torch.empty(tiles.splits, rows, n_size, dtype=torch.float32,
                                                       device=x.device)
    _few_rows_linear_kernel[grid](x, weight, target, rows, n_size, x.stride(0), weight.stride(0), n_size,
                                  rows * n_size, BLOCK_ROWS=block_rows, BLOCK_N=tiles.block_n,
                                  BLOCK_K=tiles.block_k, K_PER_SPLIT=inner // tiles.splits,
                                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 exact
                                  # Triton's interpreter multiplies bfloat16 matrices wrongly: upcast there.
                                  UPCAST=os.environ.get("TRITON_INTERPRET") == "1" and x.dtype != torch.float32,
                                  num_stages=tiles.stages, num_warps=tiles.warps)
    if tiles.splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n_size, block),)](target, out, rows * n_size, SPLITS=tiles.splits,
                                                                BLOCK=block)
    return out


def projections(cfg) -> dict:
    """name -> (output columns, inner dimension) of the model's linear layers."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q_size + 2 * kv_size, cfg.hidden_size), "o": (cfg.hidden_size, q_size),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def tilings(n_size: int) -> list:
    """The tilings tried for `n_size` output columns: splits of the inner dimension only where the column tiles
    alone would not fill two waves of the 132 multiprocessors."""
    if CPU:
        return [FewRowsTiles(block_n=32, block_k=32), FewRowsTiles(block_n=32, block_k=32, splits=2)]
    found = []
    for block_n, block_k, stages, warps in [(64, 64, 3, 4), (64, 64, 5, 4), (64, 128, 3, 4), (64, 128, 5, 4),
                                            (128, 64, 3, 4), (128, 64, 5, 4), (128, 128, 3, 4), (128, 128, 5, 4),
                                            (128, 128, 3, 8), (128, 128, 5, 8)]:
        for splits in (1, 2, 4, 7) if n_size // block_n < 264 else (1,):
            found.append(FewRowsTiles(block_n, block_k, splits, stages, warps))
    return found


def gpu_us_per_call(call, weights: list) -> float:
    """Median GPU microseconds of one call, from a graph of CALLS calls taking the weight copies in turn."""
    if CPU:
        started = time.perf_counter(); call(weights[0])
        return (time.perf_counter() - started) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            call(weights[i % len(weights)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(weights[i % len(weights)])
    graph.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def sweep(cfg) -> dict:
    result = {}
    dtype = torch.float32 if CPU else torch.bfloat16
    for name, (n_size, inner) in projections(cfg).items():
        generator = torch.Generator(DEVICE).manual_seed(0)
        weights = [torch.randn(n_size, inner, device=DEVICE, dtype=dtype, generator=generator) * 0.02
                   for _ in range(COPIES if n_size < 100000 else 2)]
        x = torch.randn(TREE, inner, device=DEVICE, dtype=dtype, generator=generator)
        want = F.linear(x, weights[0]).float()
        line = {"floor_us": round(n_size * inner * 2 / 4.8e12 * 1e6, 2),
                "cublas_us": round(gpu_us_per_call(lambda w: F.linear(x, w), weights), 2), "tilings": []}
        for tiles in tilings(n_size):
            if not fits(x, weights[0], tiles):
                continue
            try:
                difference = float((few_rows_linear(x, weights[0], tiles).float() - want).abs().max())
                us = gpu_us_per_call(lambda w: few_rows_linear(x, w, tiles), weights)
            except Exception as error:  # a tiling past the multiprocessor's shared memory fails to compile
                line["tilings"].append({**vars(tiles), "error": type(error).__name__})
                continue
            line["tilings"].append({**vars(tiles), "us": round(us, 2), "max_difference": difference})
        timed = [t for t in line["tilings"] if "us" in t]
        line["best"] = min(timed, key=lambda t: t["us"])
        result[name] = line
        best = line["best"]
        print(f"{name}: floor {line['floor_us']} us, cuBLAS {line['cublas_us']}, best {best['us']} "
              f"{ {k: best[k] for k in ('block_n', 'block_k', 'splits', 'stages', 'warps')} } "
              f"(max difference {best['max_difference']:.2g}; {len(timed)} of {len(line['tilings'])} tilings ran)",
              flush=True)
        del weights
    return result


def tree_forward(chosen: dict):
    """nn.Linear.forward with 65-row inputs of the chosen weight shapes through the kernel."""
    original = torch.nn.Linear.forward

    def forward(self, x):
        tiles = chosen.get(tuple(self.weight.shape))
        if tiles is None or x.dim() != 2 or x.shape[0] != TREE or not fits(x, self.weight, tiles):
            return original(self, x)
        out = few_rows_linear(x, self.weight, tiles)
        return out if self.bias is None else out + self.bias
    return forward


if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    cfg = SHAPES[SHAPE]
    swept = sweep(cfg)
    command = "python3 docs/logs/2026-12-01-h200-few-rows-linear.py --out " + out + (" --cpu" if CPU else "")
    with open(out, "w") as f:
        json.dump({"command": command, "shape": SHAPE, "rows": TREE, "projections": swept}, f, indent=1)

    def tiles_of(line):
        return FewRowsTiles(*(line["best"][k] for k in ("block_n", "block_k", "splits", "stages", "warps")))
    every = {(n, k): tiles_of(swept[name]) for name, (n, k) in projections(cfg).items()}
    faster = {(n, k): tiles_of(swept[name]) for name, (n, k) in projections(cfg).items()
              if swept[name]["best"]["us"] <= 0.98 * swept[name]["cublas_us"]}
    variants = {"default": {}, "kernel_everywhere": {(torch.nn.Linear, "forward"): tree_forward(every)}}
    described = {"default": "cuBLAS", "kernel_everywhere": {name: vars(tiles_of(swept[name])) for name in swept}}
    if faster and faster != every:
        variants["kernel_where_faster"] = {(torch.nn.Linear, "forward"): tree_forward(faster)}
        described["kernel_where_faster"] = [name for name, (n, k) in projections(cfg).items() if (n, k) in faster]
    ratio_out = os.path.splitext(out)[0] + "-ratio.json"
    measure(variants, described, command, ratio_out, shape=SHAPE, device=DEVICE,
            **({"context": 48, "calls": 1, "alternations": 1} if CPU else {}))
