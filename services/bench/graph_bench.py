"""python -m treeserve.bench.graph_bench: what tree verification costs on a GPU, with and without CUDA graphs.

Builds a decoder of a given shape with random weights directly on the device (default: Llama-3-8B's shape in
bfloat16), gives every request a committed context of random keys and values, and times one verification
forward per (batch, tree size): CUDA-graph replay and eager execution of the same inputs, through the same
TreeVerifier the service uses (host staging and copies included, until the logits are ready). Then the
tree-attention kernel alone against PyTorch's SDPA over a contiguous cache at several context lengths.
Median milliseconds of --repeats timed runs after warm-up; writes JSON with --out.

With --kernels N, each (batch, tree size) also records --repeats verifications under torch's profiler and reports
the device's time per verification (`device_us`) and its N longest kernels or copies by name
(`device_us_by_kernel`): what a verification spends its device time on, with no model to stage (random weights).
"""

from __future__ import annotations

import json
import random
import shlex
import statistics
import sys
import time

import torch

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, ModelConfig
from treeserve.models.paged_kv import PagedKVCache
from treeserve.tree import DraftTree

SHAPES = {
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                             rope_theta=500000.0, max_context=32768, tie_word_embeddings=False),
    "smollm2-135m": ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, max_context=8192, tie_word_embeddings=True),
    # For a quick check of the bench itself on a CPU.
    "tiny": ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_context=4096, tie_word_embeddings=False),
}


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> DecoderLM:
    """Random weights made on the device in the target dtype (an 8B model never exists in float32 or on the
    host); scaled like a trained model's so activations stay in range."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def chain_or_tree(size: int, rng: random.Random, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, size)]  # deep and bushy, like DDTree's
    return DraftTree([rng.randrange(vocab) for _ in range(size)], parents)


def timed(step, repeats: int, device: str) -> float:
    """Median wall milliseconds of `step()` until its work on the device is done."""
    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def replay_ms(step, repeats: int, calls: int = 20) -> float:
    """Median GPU milliseconds of one `step()`, from a CUDA graph of `calls` back-to-back steps: the device's
    time alone, without the host's launch cost (the way steps run inside a captured verification)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def device_time(step, calls: int, top: int) -> tuple[float, dict[str, float]]:
    """`calls` runs of `step()` under torch's profiler: the device's µs per call, and by kernel or copy name (the
    `top` longest; round_traces.device_time_by_name). On the CPU there is no device work: (0, {})."""
    from torch.profiler import ProfilerActivity, profile

    from treeserve.round_traces import device_time_by_name

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
    work = [(event.name, event.device_time_total) for event in profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]
    return round(sum(us for _, us in work) / calls, 1), device_time_by_name(work, calls, top)


def verification_costs(model: DecoderLM, batches: list[int], tree_sizes: list[int], context: int, repeats: int,
                       graphs: bool, device: str, verbose: bool = True, kernels: int = 0) -> list[dict]:
    from treeserve.verifier.graphs import TreeVerifier

    cfg = model.config
    block = 16
    blocks = max(batches) * -(-(context + max(tree_sizes)) // block) + 1
    pool = PagedKVCache(cfg, blocks, block, model.dtype, device)
    pool.data.normal_()  # every committed key and value is random, never zeros
    verifier = TreeVerifier(model, pool, max(batches), max(tree_sizes), graphs=graphs)
    if graphs:
        started = time.perf_counter()
        verifier.capture()
        capture_s = time.perf_counter() - started
    rng = random.Random(0)
    rows = []
    for batch in batches:
        sequences = []
        for _ in range(batch):
            sequence = pool.sequence()
            sequence.reserve(context)
            sequence.keep(list(range(context)))
            sequences.append(sequence)
        for size in tree_sizes:
            trees = [chain_or_tree(size, rng, cfg.vocab_size) for _ in sequences]
            args = ([t.tokens for t in trees], [torch.tensor(t.depths()) + context for t in trees],
                    [t.ancestor_mask() for t in trees])
            ms = timed(lambda: verifier.verify(sequences, *args), repeats, device)
            row = {"batch": batch, "tree_nodes": size, "context": context, "ms": round(ms, 4), "graphs": graphs}
            if kernels:
                row["device_us"], row["device_us_by_kernel"] = device_time(
                    lambda: verifier.verify(sequences, *args), repeats, kernels)
            rows.append(row)
            if verbose:
                print(f"  {'graphs' if graphs else 'eager '} batch {batch:3d} tree {size:3d}: {ms:8.3f} ms"
                      + (f", device {row['device_us']:9.1f} us" if kernels else ""), flush=True)
                for name, us in row.get("device_us_by_kernel", {}).items():
                    print(f"      {us:9.1f} us  {name[:100]}", flush=True)
        for sequence in sequences:
            sequence.release()
    if graphs:
        rows.append({"capture_s": round(capture_s, 2), "graphs_captured": len(verifier.runner.graphs)})
    return rows


def attention_costs(cfg: ModelConfig, contexts: list[int], tree_nodes: int, repeats: int, dtype: torch.dtype,
                    device: str) -> list[dict]:
    """One layer's tree attention: the Triton kernel over a paged cache against SDPA over a contiguous one
    (with the dense prefix + tree mask it needs), and the floor: reading the keys and values once. Both timed
    as GPU time inside a CUDA graph, as they run in a verification."""
    from treeserve.kernels.tree_attention import tree_attention

    g = torch.Generator(device=device).manual_seed(0)
    mask = torch.ones(tree_nodes, tree_nodes, dtype=torch.bool, device=device).tril()
    rows = []
    for context in contexts:
        length = context + tree_nodes
        block = 16
        num_blocks = -(-length // block)
        keys = torch.randn(num_blocks, block, cfg.num_kv_heads, cfg.head_dim, generator=g, device=device).to(dtype)
        values = torch.randn_like(keys)
        q = torch.randn(1, tree_nodes, cfg.num_heads, cfg.head_dim, generator=g, device=device).to(dtype)
        tables = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)[None]
        prefix, sizes = (torch.tensor([v], device=device, dtype=torch.int32) for v in (context, tree_nodes))
        kernel_ms = replay_ms(lambda: tree_attention(q, keys, values, tables, prefix, sizes, mask[None]), repeats)
        k = keys.flatten(0, 1)[:length].transpose(0, 1)[None]  # (1, KVH, L, D)
        v = values.flatten(0, 1)[:length].transpose(0, 1)[None]
        dense = torch.cat((torch.ones(tree_nodes, context, dtype=torch.bool, device=device), mask), dim=1)
        qt = q.transpose(1, 2)
        sdpa_ms = replay_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=dense,
                                                                                      enable_gqa=True), repeats)
        floor_ms = 2 * length * cfg.num_kv_heads * cfg.head_dim * keys.element_size() / 4.2e12 * 1000
        rows.append({"context": context, "tree_nodes": tree_nodes, "kernel_ms": round(kernel_ms, 4),
                     "sdpa_ms": round(sdpa_ms, 4), "kv_read_floor_ms": round(floor_ms, 4)})
        print(f"  attention context {context:6d}: kernel {kernel_ms:.3f} ms, SDPA {sdpa_ms:.3f} ms, "
              f"floor {floor_ms:.3f} ms", flush=True)
    return rows


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.graph_bench", description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="model shape (default llama3-8b)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes (default 1,4,16,64)")
    p.add_argument("--tree-sizes", default="1,2,3,5,9,17,33,65,129",
                   help="tree nodes per request, root included (default: every bucket)")
    p.add_argument("--context", type=int, default=1024, help="committed tokens per request (default 1024)")
    p.add_argument("--attention-contexts", default="1024,8192,32768",
                   help="contexts for the kernel against SDPA (default 1024,8192,32768; empty: skip)")
    p.add_argument("--modes", default="graphs,eager", help="graphs, eager or both (default graphs,eager)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile each verification: the device's time and its N longest kernels (default 0: off)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks, one GPU each (default 1): every rank runs the bench on its shard "
                        "in lockstep, rank 0 reports")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)
    if args.kernels < 0:
        p.error("--kernels must be 0 or more")
    if args.tp < 1 or (args.tp > 1 and args.device != "cuda"):
        p.error("--tp must be 1, or more with --device cuda")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("graph_bench: error: no CUDA device (use --device cpu --shape tiny to try the bench)", file=sys.stderr)
        return 1
    if args.tp == 1:
        return run(args)
    from treeserve import parallel

    followers = parallel.start_followers(run, args, args.tp)
    try:
        return run(args)
    finally:
        parallel.stop_followers(followers)


def run(args) -> int:
    """The bench on this process: the whole model, or (under --tp) this rank's shard of it."""
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    cfg, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    rank = 0
    if args.tp > 1:
        from treeserve import parallel

        shard = parallel.join(args.device)
        rank, cfg = shard.rank, shard.config(cfg)
    model = random_model(cfg, args.device, dtype)
    if args.tp > 1:
        parallel.add_collectives(model, args.tp)
    report = {"shape": args.shape, "dtype": args.dtype, "tp": args.tp, "device": torch.cuda.get_device_name()
              if args.device == "cuda" else "cpu", "command": "python -m treeserve.bench.graph_bench "
              + shlex.join(args.argv), "verification": []}
    try:
        modes = args.modes.split(",") if args.device == "cuda" else ["eager"]
        for graphs in [mode == "graphs" for mode in modes]:
            report["verification"] += verification_costs(model, ints(args.batches), ints(args.tree_sizes),
                                                          args.context, args.repeats, graphs, args.device,
                                                          verbose=rank == 0, kernels=args.kernels)
        if rank == 0 and args.device == "cuda" and ints(args.attention_contexts):
            report["attention"] = attention_costs(cfg, ints(args.attention_contexts), 65, args.repeats, dtype,
                                                  args.device)
    except TreeserveError as error:
        print(f"graph_bench: error: {error}", file=sys.stderr)
        return 1
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
