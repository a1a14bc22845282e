"""Issue 5: what one projection of the 8B shape costs at each row count, bfloat16, cuBLAS through F.linear, GPU
time per call inside a CUDA graph (8 weight copies taken in turn, so no call finds its weights in L2). Shows
whether 65 rows (a 64-node tree and its root) pay for cuBLAS's tile choice against, say, 64 or 80.
From the repository root on the H200: python3 docs/logs/2026-12-01-h200-gemm-rows.py --out gemm-rows.json"""
import json, sys
import torch
import torch.nn.functional as F

out = sys.argv[sys.argv.index("--out") + 1]
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
rows = [1, 16, 32, 48, 64, 65, 72, 80, 96, 128]
copies, calls = 8, 32
result = {"command": "python3 docs/logs/2026-12-01-h200-gemm-rows.py --out " + out, "us_per_call": {}}
for name, (k, n) in shapes.items():
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies if n < 100000 else 2)]
    floor_us = n * k * 2 / 4.2e12 * 1e6
    line = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        outs = [None] * calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):
                F.linear(x, weights[i % len(weights)])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                outs[i] = F.linear(x, weights[i % len(weights)])
        graph.replay(); torch.cuda.synchronize()
        times = []
        for _ in range(15):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); graph.replay(); end.record(); end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / calls)
        times.sort()
        line[m] = round(times[len(times) // 2], 2)
        del graph
    result["us_per_call"][name] = {"floor_us": round(floor_us, 2), **{str(m): t for m, t in line.items()}}
    print(name, f"floor {floor_us:.1f} us;", " ".join(f"{m}:{t:.1f}" for m, t in line.items()), flush=True)
    del weights
json.dump(result, open(out, "w"), indent=1)
