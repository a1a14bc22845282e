"""Tensor parallelism: the target split across ranks of torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank holds 1/N of every layer: q/k/v and gate/up split by output rows (whole heads, whole MLP columns),
o_proj and down_proj by input columns, their partial outputs summed across ranks (one all-reduce after each).
Embedding, norms and LM head are replicated for now. A rank reads each checkpoint tensor whole, keeps its slice
and drops the rest, so no rank ever holds the whole model.

Ranks run the same deterministic program in lockstep (same prompt, drafter and seed), so after each all-reduce
every rank holds the same hidden states and takes the same decisions without exchanging them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch
import torch.distributed as dist

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, ModelConfig

# Checkpoint tensors split by output rows (dim 0) and by input columns (dim 1); the rest are replicated.
ROW_SPLIT = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
             "gate_proj.weight", "up_proj.weight")
COLUMN_SPLIT = ("o_proj.weight", "down_proj.weight")


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """This rank's share of the model: its heads and MLP columns. Raises for counts that do not divide."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(cfg, name) % self.world:
                raise TreeserveError(f"--tp {self.world}: the model's {name} ({getattr(cfg, name)}) does not divide "
                                     f"by {self.world}")
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.world,
                                   num_kv_heads=cfg.num_kv_heads // self.world,
                                   intermediate_size=cfg.intermediate_size // self.world)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF naming)."""
        if name.endswith(ROW_SPLIT):
            return tensor.chunk(self.world, dim=0)[self.rank].contiguous()
        if name.endswith(COLUMN_SPLIT):
            return tensor.chunk(self.world, dim=1)[self.rank].contiguous()
        return tensor


def sum_partial_outputs(model: DecoderLM) -> None:
    """All-reduce the outputs of the input-split projections, so every rank carries the full hidden state."""
    def all_reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(all_reduce)
        layer.mlp.down_proj.register_forward_hook(all_reduce)


def join(device: str) -> Shard:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
    torchrun and `launch` set them): NCCL for CUDA (one GPU per local rank), gloo for the CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    return Shard(rank, world)


def _rank_main(rank: int, world: int, port: int, function, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = function(args)
    dist.destroy_process_group()
    if code:
        raise SystemExit(code)


def launch(function, args, world: int) -> int:
    """Run `function(args)` on `world` local ranks (processes) that join one process group; returns the first
    non-zero exit code, or 0. Ranks print their own errors; an exception a rank did not catch is printed here."""
    import torch.multiprocessing as mp

    from treeserve.serving import free_port

    # When one rank fails, torch stops the others, and would log a warning per rank it stops.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        mp.start_processes(_rank_main, args=(world, free_port(), function, args), nprocs=world,
                           start_method="spawn")
    except mp.ProcessExitedException as error:
        return error.exit_code or 1
    except mp.ProcessRaisedException as error:  # a bug, not a bad input: show where
        print(error, file=sys.stderr)
        return 1
    return 0
