"""Tensor parallelism: the target split across ranks of torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank holds 1/N of every layer: q/k/v and gate/up split by output rows (whole heads, whole MLP columns;
each rank stacks its parts into its own fused projection), o_proj and down_proj by input columns, their partial
outputs summed across ranks (one all-reduce after each). The LM head is split by vocabulary rows: each rank
computes its share of the logits of the rows asked for, and one all-gather assembles them. Embedding and norms are
replicated. A rank reads each checkpoint tensor whole, keeps its slice and drops the rest, so no rank ever holds
the whole model.

Rank 0 decides everything (scheduling, KV slots, acceptance) and sends each forward's inputs to the others
(treeserve.verifier.tensor_parallel); after each all-reduce every rank holds the same hidden states.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, ModelConfig

# Checkpoint tensors split by output rows (dim 0) and by input columns (dim 1); the rest are replicated.
ROW_SPLIT = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
             "gate_proj.weight", "up_proj.weight", "lm_head.weight")
COLUMN_SPLIT = ("o_proj.weight", "down_proj.weight")


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """This rank's share of the model: its heads, MLP columns and LM-head rows (vocab_size). Raises for
        counts that do not divide."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(cfg, name) % self.world:
                raise TreeserveError(f"--tp {self.world}: the model's {name} ({getattr(cfg, name)}) does not divide "
                                     f"by {self.world}")
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.world,
                                   num_kv_heads=cfg.num_kv_heads // self.world,
                                   intermediate_size=cfg.intermediate_size // self.world,
                                   vocab_size=cfg.vocab_size // self.world)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF naming)."""
        if name.endswith(ROW_SPLIT):
            return tensor.chunk(self.world, dim=0)[self.rank].contiguous()
        if name.endswith(COLUMN_SPLIT):
            return tensor.chunk(self.world, dim=1)[self.rank].contiguous()
        return tensor


def add_collectives(model: DecoderLM, world: int) -> None:
    """All-reduce the outputs of the input-split projections, so every rank carries the full hidden state; and
    all-gather the LM head's vocabulary shards, so every rank has whole logits."""
    def all_reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    def all_gather(module, inputs, output):
        rows = output.reshape(-1, output.shape[-1]).contiguous()
        shards = rows.new_empty(world * rows.shape[0], rows.shape[1])  # rank r's rows at r * len(rows)
        dist.all_gather_into_tensor(shards, rows)
        whole = shards.view(world, *rows.shape).permute(1, 0, 2).reshape(rows.shape[0], -1)
        return whole.view(*output.shape[:-1], whole.shape[-1])

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(all_reduce)
        layer.mlp.down_proj.register_forward_hook(all_reduce)
    model.lm_head.register_forward_hook(all_gather)


_control_group = None


def join(device: str) -> Shard:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
    torchrun and `start_followers` set them): NCCL for CUDA (one GPU per local rank), gloo for the CPU; plus a
    gloo group for rank 0's messages to the others (host objects, whatever the model's backend)."""
    global _control_group
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    # Followers wait on this group for rank 0's next step as long as a server stays idle: no timeout to speak of.
    _control_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=3650))
    return Shard(rank, world)


def control_group():
    return _control_group


def _follower_main(rank: int, world: int, port: int, function, args) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    code = function(args)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


def _die_with_parent() -> None:
    """On Linux, have the kernel stop this process when its parent (rank 0) dies, even by SIGKILL: a rank left
    waiting in a collective would wait forever."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_followers(function, args, world: int) -> list:
    """The one-host launcher: start ranks 1 .. world - 1 as processes running `function(args)`, and make this
    process rank 0 of the same group (its environment set for `join`). Returns the follower processes."""
    import multiprocessing

    from treeserve.serving import free_port

    port = free_port()
    context = multiprocessing.get_context("spawn")
    followers = [context.Process(target=_follower_main, args=(rank, world, port, function, args), daemon=True,
                                 name=f"treeserve-rank-{rank}") for rank in range(1, world)]
    for process in followers:
        process.start()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return followers


def stop_followers(followers: list, timeout_s: float = 30.0) -> None:
    """Wait for followers told to stop; stop the ones that do not (rank 0 failed before it could tell them)."""
    for process in followers:
        process.join(timeout_s if process.exitcode is None else 0)
        if process.is_alive():
            process.terminate()
            process.join(5)
