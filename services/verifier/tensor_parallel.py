"""The verifier across tensor-parallel ranks: rank 0 decides, the other ranks repeat.

Rank 0 runs everything a single-GPU verifier runs (gRPC, scheduler, KV allocator, acceptance). Its TreeVerifier
holds a `Mirror`: before each step that touches the model or the pool, the step goes to the other ranks over a
gloo group, with the KV moves (accepted rows compacted by `PagedSequence.keep`) made since the last one. A
follower (`follow`) holds its own shard of the model and of the pool, builds the same TreeVerifier, and runs
each step as it comes: the same staged rows, the same slots, the same graph buckets, so the collectives inside
the model (and inside the captured graphs) meet. Only rank 0 reads logits and features.

A rank that dies breaks the group: rank 0's next message or collective fails with `RankLost` (the service
then closes its streams with UNAVAILABLE and exits), and followers stop with their parent (`start_followers`).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from treeserve.errors import TreeserveError

class RankLost(TreeserveError):
    """Another tensor-parallel rank is gone: this verifier cannot run another forward."""


class WireArray:
    """A host tensor on its way to the other ranks, as a NumPy array: pickled as raw bytes, where a pickled tensor
    goes through torch's storage serialisation, several times slower for a large batch's staged rows, which every
    follower waits for before its forward."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, array):
        self.array = array


def _map_leaves(value, leaf):
    """`value` with `leaf` applied to everything inside its dataclasses, tuples, lists and dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{field.name: _map_leaves(getattr(value, field.name), leaf)
                              for field in dataclasses.fields(value)})
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(item, leaf) for item in value)
    if isinstance(value, dict):
        return {key: _map_leaves(item, leaf) for key, item in value.items()}
    return leaf(value)


def to_wire(value):
    """`value` with its host tensors as WireArrays."""
    def leaf(item):
        if isinstance(item, torch.Tensor) and item.device.type == "cpu" and item.dtype != torch.bfloat16:
            return WireArray(item.numpy())
        return item
    return _map_leaves(value, leaf)


def from_wire(value):
    """The inverse of `to_wire`: tensors again (sharing the arrays' memory)."""
    return _map_leaves(value, lambda item: torch.from_numpy(item.array) if isinstance(item, WireArray) else item)


class Mirror:
    """Rank 0's channel to the follower ranks."""

    def __init__(self, group):
        self.group = group
        self.pool = None
        self.closed = False

    def attach(self, verifier) -> None:
        """Record the verifier's KV moves from now on, and have it send every step it runs first."""
        self.pool = verifier.pool
        verifier.mirror_to(self)

    def send(self, step: str, **payload) -> None:
        if self.pool is not None:
            payload["moves"], self.pool.recorded_moves = self.pool.recorded_moves, []
        try:
            dist.broadcast_object_list([(step, to_wire(payload))], src=0, group=self.group)
        except RuntimeError as error:  # gloo: a peer closed its connection
            raise RankLost(f"a tensor-parallel rank is gone ({str(error).splitlines()[0]})") from None

    def close(self) -> None:
        """Tell the followers to stop (nothing to tell when one is already gone)."""
        self.closed = True
        try:
            self.send("stop")
        except RankLost:
            pass


def follow(model, group) -> int:
    """A follower rank's whole life after loading its shard: build the verifier rank 0 builds, then repeat its
    steps until it says stop. Returns an exit code."""
    from treeserve.models.graphs import packed_rows
    from treeserve.models.paged_kv import PagedAttention
    from treeserve.verifier.graphs import build_verifier

    verifier = None
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=group)
        except RuntimeError as error:
            print(f"treeserve: rank {dist.get_rank()}: rank 0 is gone ({str(error).splitlines()[0]}); stopping",
                  file=sys.stderr)
            return 1
        step, payload = message[0][0], from_wire(message[0][1])
        if verifier is not None:
            for source, target in payload.pop("moves", ()):
                verifier.pool.move(source, target)
        if step == "stop":
            return 0
        if step == "build":
            verifier = build_verifier(model, **payload)
        elif step == "capture":
            verifier.capture(payload["feature_layer_ids"])
        elif step == "warm_up_kernels":
            verifier.warm_up_kernels()
        elif step == "time_graphs":
            verifier.time_graphs()
        elif step == "run":
            verifier.feature_layer_ids = payload["feature_layer_ids"]
            verifier.runner.execute(payload["key"], packed_rows(payload["staged"], *payload["shape"]))
        elif step == "prefill":
            attention = PagedAttention.on_device(verifier.pool, payload["inputs"], verifier.kernels,
                                                 payload["packed_rows"])
            verifier.prefill(attention, payload["tokens"], payload["positions"], payload["logits_rows"],
                             payload["feature_layer_ids"])
        else:
            raise TreeserveError(f"unknown tensor-parallel step {step!r}")


def build_mirrored_verifier(model, mirror: Mirror | None, **build_args):
    """build_verifier on rank 0, and the same on every follower when `mirror` is given."""
    from treeserve.verifier.graphs import build_verifier

    if mirror is None:
        return build_verifier(model, **build_args)
    mirror.send("build", **build_args)
    verifier = build_verifier(model, **build_args)
    mirror.attach(verifier)
    return verifier


def follower_main(args) -> int:
    """Entry of ranks 1 .. N-1 (`args`: the command's, with target, device and dtype): load this rank's shard of
    the target, then follow rank 0."""
    from treeserve import parallel, serving
    from treeserve.loading import load_target

    serving.setup_logging(getattr(args, "log_level", "WARNING"))
    try:
        shard = parallel.join(args.device)
        target = load_target(args.target, device=args.device, dtype=args.dtype, shard=shard)
    except TreeserveError:  # a bad target or flag: rank 0 loads the same and says it once
        return 1
    serving.freeze_startup_objects()  # a collection's pause here would hold up every rank's round
    with torch.inference_mode():
        return follow(target.model, parallel.control_group())


def agreed_blocks(num_blocks: int, device: torch.device) -> int:
    """The smallest pool any rank can hold: every rank's pool must have the same blocks (rank 0 hands out slots
    for all of them)."""
    if not (dist.is_available() and dist.is_initialized()):
        return num_blocks
    count = torch.tensor([num_blocks], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())
