"""Moving keys and values between slots of the paged KV cache, in every layer at once: after a round, each
request's accepted path goes to the first slots after its committed prefix.

The cache is viewed as (slabs, slots, row): one slab per (keys or values, layer), a row per slot (kv_heads *
head_dim). Move i copies slot `sources[i]` to slot `targets[i]` in every slab. One launch, whatever the pool's
size: PyTorch's indexing over a pool larger than 2 GiB splits into a kernel per piece of 32-bit offsets, about one
per slab, and those launches were a visible part of a small target's round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Moves per launch, and elements a program holds at once (moves x columns).
MOVES_PER_LAUNCH, TILE = 4096, 16384
# The move counts a launch is compiled for (a count is padded up to the next): few, and each compiled at start-up
# (`warm_up`), since a compilation during serving stops every request for a good part of a second.
PADDED_MOVES = tuple(1 << bits for bits in range(4, MOVES_PER_LAUNCH.bit_length()))


def padded_moves(moves: int) -> int:
    return max(PADDED_MOVES[0], triton.next_power_of_2(moves))


# `moves` (1, or a multiple of 16) and the slot pointers' alignment would each compile apart: the pool stages a
# move's targets right after its sources, so an odd count leaves them off 16 bytes.
@triton.jit(do_not_specialize=["moves"], do_not_specialize_on_alignment=["sources_ptr", "targets_ptr"])
def _kv_move_kernel(cache_ptr, sources_ptr, targets_ptr, moves, slab_stride, ROW_SIZE: tl.constexpr,
                    MOVES: tl.constexpr, BLOCK: tl.constexpr):
    slab = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    index = tl.arange(0, MOVES)
    live = index < moves
    sources = tl.load(sources_ptr + index, mask=live, other=0)
    targets = tl.load(targets_ptr + index, mask=live, other=0)
    ok = live[:, None] & (cols < ROW_SIZE)[None, :]
    base = cache_ptr + slab * slab_stride
    # Every source row of this program's columns is read before any target is written: overlaps are safe.
    rows = tl.load(base + sources[:, None] * ROW_SIZE + cols[None, :], mask=ok)
    tl.store(base + targets[:, None] * ROW_SIZE + cols[None, :], rows, mask=ok)


def kv_move(cache: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """The Triton kernel for `references.kv_move_reference` (same arguments). Beyond MOVES_PER_LAUNCH moves, the
    launches go one after another: then no move may read a slot that an earlier launch's moves write."""
    if not cache.is_contiguous():
        raise ValueError("the cache must be contiguous")
    slabs, slots, row_size = cache.shape
    sources, targets = sources.to(torch.int64).contiguous(), targets.to(torch.int64).contiguous()
    for start in range(0, len(sources), MOVES_PER_LAUNCH):
        moves = min(MOVES_PER_LAUNCH, len(sources) - start)
        padded = padded_moves(moves)
        block = max(1, min(triton.next_power_of_2(row_size), TILE // padded))
        _kv_move_kernel[(slabs, triton.cdiv(row_size, block))](
            cache, sources[start:], targets[start:], moves, slots * row_size, ROW_SIZE=row_size, MOVES=padded,
            BLOCK=block)


def warm_up(cache: torch.Tensor) -> None:
    """Compile the kernel for every padded move count on `cache` (its row size, dtype and strides), moving slot 0
    onto itself: the cache is as before."""
    for moves in PADDED_MOVES:
        zeros = torch.zeros(moves, dtype=torch.int64, device=cache.device)
        kv_move(cache, zeros, zeros)
