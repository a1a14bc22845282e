"""What rank 0's step costs to reach a tensor-parallel follower: one round of 64 requests with 17-node trees
(staged rows as TreeRows), broadcast over gloo and unpickled on rank 1, with its host tensors pickled as tensors
and as NumPy arrays (`tensor_parallel.to_wire`, what Mirror.send does), side by side in one run, on the CPU
machine. From the repository root: python docs/logs/2026-11-30-cpu-mirror-broadcast-64.py"""
import os, random, statistics, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from treeserve.models.graphs import stage_trees
    from treeserve.models.paged_kv import PagedKVCache
    from treeserve.tree import DraftTree
    from treeserve.verifier.graph_bench import SHAPES
    from treeserve.verifier.tensor_parallel import from_wire, to_wire
    pool, rng = PagedKVCache(SHAPES["tiny"], 64 * 40, 16, torch.float32, "cpu"), random.Random(0)
    sequences = []
    for _ in range(64):
        sequence = pool.sequence(); sequence.reserve(300); sequence.keep(list(range(300))); sequences.append(sequence)
    trees = [DraftTree([rng.randrange(96) for _ in range(17)], [-1] + [rng.randrange(i) for i in range(1, 17)])
             for _ in range(64)]
    staged = stage_trees(sequences, [t.tokens for t in trees], [torch.tensor(t.depths()) + 300 for t in trees],
                         [t.ancestor_mask() for t in trees], 64, 17, 520)  # 520: SmolLM2's table width
    for name, wrap, unwrap in (("tensors", lambda x: x, lambda x: x), ("arrays", to_wire, from_wire)) * 2:
        times = []
        for _ in range(100):
            dist.barrier()
            started = time.perf_counter()
            message = [("run", wrap({"key": (64, 17), "staged": staged}))] if rank == 0 else [None]
            dist.broadcast_object_list(message, src=0)
            unwrap(message[0][1])
            times.append(time.perf_counter() - started)
        if rank == 1:
            print(f"as {name}: {statistics.median(times) * 1000:.2f} ms (median of 100, rank 1)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, 29541), nprocs=2)
