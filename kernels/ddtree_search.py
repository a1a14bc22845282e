"""The DDTree search (`treeserve.drafter.trees.ddtree_select`) as one Triton launch: one program per request.

The reference searches depth by depth in PyTorch: per depth a gather, an add, a stable sort and two more gathers,
then a ranking over every depth's kept nodes; on a GPU that is about a hundred small kernels a round, more time than
the drafter's whole block forward at a small target. Here each program runs the same steps for its request, with
the same float32 sums in the same order, and sorts with the same tie rule, so its trees equal the reference's bit
for bit (ties included).

A stable descending sort of (score, index) pairs is one sort of 64-bit keys: the float32 score's bits, mapped to a
signed integer of the same order, in the high half, and 2^31 - 1 - index in the low half (the lower index first on
equal scores). Values a program works out and reads back by index (a parent's score, a column's place) go through
scratch memory of its own, with a barrier between the writes and the reads.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

LOW_BITS = tl.constexpr((1 << 31) - 1)  # the low half of a key: LOW_BITS - index
NO_KEY = tl.constexpr(-(1 << 63))  # padding: sorts after every real candidate, -inf included


@triton.jit
def _key(scores, index):
    """Keys whose descending order is (score descending, index ascending); -0.0 counts as +0.0, as in a sort."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (-index.to(tl.int64) + LOW_BITS)


@triton.jit
def _index(keys):
    """The index a key (`_key`) holds."""
    return (-(keys & LOW_BITS) + LOW_BITS).to(tl.int32)


@triton.jit
def _score(keys):
    """The float32 score a key (`_key`) holds."""
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ddtree_search_kernel(log_probs_ptr, token_ids_ptr, budgets_ptr, parent_ranks_ptr, choices_ptr, pair_counts_ptr,
                          level_starts_ptr, packed_ptr, node_log_probs_ptr, scores_ptr, pairs_ptr, sorted_ptr,
                          places_ptr,
                          DEPTH: tl.constexpr, TOP_K: tl.constexpr, KEEP: tl.constexpr, PAIRS: tl.constexpr,
                          COLUMNS: tl.constexpr, COLUMN_BLOCK: tl.constexpr, KEEP_BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lists = b * DEPTH * TOP_K  # this request's (DEPTH, TOP_K) top-k lists
    # Scratch rows of this program: every kept node's score and pair, by column (depth-major); a sort's output;
    # and every column's place in the tree, after the root's (0).
    scores_row, pairs_row = scores_ptr + b * COLUMN_BLOCK, pairs_ptr + b * COLUMN_BLOCK
    sorted_row = sorted_ptr + b * COLUMN_BLOCK
    places_row = places_ptr + b * (COLUMN_BLOCK + 1)

    pair = tl.arange(0, PAIRS)
    kept_index = tl.arange(0, KEEP_BLOCK)
    for depth in range(DEPTH):
        count = tl.load(pair_counts_ptr + depth)
        live = pair < count
        parent_ranks = tl.load(parent_ranks_ptr + depth * PAIRS + pair, mask=live, other=0)
        choices = tl.load(choices_ptr + depth * PAIRS + pair, mask=live, other=0)
        own = tl.load(log_probs_ptr + lists + depth * TOP_K + choices, mask=live, other=0.0).to(tl.float32)
        if depth == 0:
            candidates = 0.0 + own  # the root's score, 0, plus the token's
        else:
            parent_start = tl.load(level_starts_ptr + depth - 1)
            parents = tl.load(scores_row + parent_start + parent_ranks, mask=live, other=0.0)
            candidates = parents + own
        keys = tl.where(live, _key(candidates, pair), NO_KEY)
        tl.store(sorted_row + pair, tl.sort(keys, descending=True))
        tl.debug_barrier()
        kept = tl.minimum(count, KEEP)
        start = tl.load(level_starts_ptr + depth)
        best = tl.load(sorted_row + kept_index, mask=kept_index < kept, other=NO_KEY)
        tl.store(scores_row + start + kept_index, _score(best), mask=kept_index < kept)
        tl.store(pairs_row + start + kept_index, _index(best), mask=kept_index < kept)
        tl.debug_barrier()

    # Rank every kept node of every depth; the request's best `budget` are its tree.
    column = tl.arange(0, COLUMN_BLOCK)
    real = column < COLUMNS
    keys = tl.where(real, _key(tl.load(scores_row + column, mask=real, other=0.0), column), NO_KEY)
    ranked = tl.sort(keys, descending=True)
    budget = tl.load(budgets_ptr + b).to(tl.int32)
    # Chosen or not, column by column: written at each ranked column's own place, read back in column order.
    tl.store(sorted_row + _index(ranked), (column < budget).to(tl.int64), mask=real)
    tl.debug_barrier()
    chosen = tl.load(sorted_row + column, mask=real, other=0).to(tl.int32)
    places = tl.cumsum(chosen, axis=0) * chosen
    tl.store(places_row, 0)
    tl.store(places_row + 1 + column, places, mask=real)
    tl.debug_barrier()

    # Each chosen node's token, parent place and log-prob, at its place; the rest of the row zeros.
    depth = tl.zeros([COLUMN_BLOCK], dtype=tl.int32)
    for level in range(1, DEPTH):
        depth += (column >= tl.load(level_starts_ptr + level)).to(tl.int32)
    pairs = tl.load(pairs_row + column, mask=real, other=0)
    choices = tl.load(choices_ptr + depth * PAIRS + pairs, mask=real, other=0)
    parent_ranks = tl.load(parent_ranks_ptr + depth * PAIRS + pairs, mask=real, other=0)
    parent_start = tl.load(level_starts_ptr + tl.maximum(depth - 1, 0), mask=real, other=0)
    parent_places = tl.load(places_row + tl.where(depth == 0, 0, 1 + parent_start + parent_ranks), mask=real,
                            other=0)
    cells = lists + depth * TOP_K + choices
    out = b * (1 + 2 * KEEP)
    write = real & (chosen > 0)
    tl.store(packed_ptr + out + places, tl.load(token_ids_ptr + cells, mask=write, other=0), mask=write)
    tl.store(packed_ptr + out + KEEP + places, parent_places.to(tl.int64), mask=write)
    tl.store(node_log_probs_ptr + b * KEEP + places - 1, tl.load(log_probs_ptr + cells, mask=write, other=0.0),
             mask=write)
    total = tl.sum(chosen, axis=0)
    tl.store(packed_ptr + out, total.to(tl.int64))
    rest = (kept_index >= total) & (kept_index < KEEP)
    tl.store(packed_ptr + out + 1 + kept_index, tl.zeros([KEEP_BLOCK], dtype=tl.int64), mask=rest)
    tl.store(packed_ptr + out + 1 + KEEP + kept_index, tl.zeros([KEEP_BLOCK], dtype=tl.int64), mask=rest)
    tl.store(node_log_probs_ptr + b * KEEP + kept_index, tl.zeros([KEEP_BLOCK], dtype=tl.float32), mask=rest)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """A search's tables as the kernel reads them: per depth its (parent rank, choice) pairs, padded to `pairs`
    columns, how many there are, and where its kept nodes start among all depths' (depth-major)."""

    parent_ranks: torch.Tensor  # (depth, pairs) int32
    choices: torch.Tensor  # (depth, pairs) int32
    pair_counts: torch.Tensor  # (depth,) int32
    level_starts: torch.Tensor  # (depth,) int32
    pairs: int  # a power of two
    columns: int  # kept nodes over all depths


def kernel_plan(pairs: list[tuple[list[int], list[int]]], keep: int, device: torch.device) -> KernelPlan:
    """The tables of a search that expands, at each depth, these (parent ranks, choices) pairs and keeps the best
    `keep` (the drafter's search plan: treeserve.drafter.trees.search_plan)."""
    counts = [len(parent_ranks) for parent_ranks, _ in pairs]
    width = triton.next_power_of_2(max(counts))
    parent_ranks = torch.zeros(len(pairs), width, dtype=torch.int32)
    choices = torch.zeros(len(pairs), width, dtype=torch.int32)
    starts, column = [], 0
    for level, (ranks, picks) in enumerate(pairs):
        parent_ranks[level, :len(ranks)] = torch.as_tensor(ranks)
        choices[level, :len(picks)] = torch.as_tensor(picks)
        starts.append(column)
        column += min(keep, len(ranks))
    as_device = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return KernelPlan(parent_ranks.to(device), choices.to(device), as_device(counts), as_device(starts), width, column)


def ddtree_search(log_probs: torch.Tensor, token_ids: torch.Tensor, budgets: torch.Tensor, keep: int,
                  plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for treeserve.drafter.trees.ddtree_select (the same arguments, with the search's `plan`;
    the same results; log_probs float32, bfloat16 or float16). Allocates only its outputs and scratch: a CUDA
    graph can capture it (call it once first, to compile)."""
    batch, depth, top_k = log_probs.shape
    device = log_probs.device
    column_block = triton.next_power_of_2(max(plan.columns, plan.pairs))
    packed = torch.empty(batch, 1 + 2 * keep, dtype=torch.long, device=device)
    node_log_probs = torch.empty(batch, keep, dtype=log_probs.dtype, device=device)
    scores = torch.empty(batch, column_block, dtype=torch.float32, device=device)
    pairs = torch.empty(batch, column_block, dtype=torch.int32, device=device)
    sorted_keys = torch.empty(batch, column_block, dtype=torch.int64, device=device)
    places = torch.empty(batch, column_block + 1, dtype=torch.int32, device=device)
    if batch:
        _ddtree_search_kernel[(batch,)](
            log_probs.contiguous(), token_ids.contiguous(), budgets.contiguous(), plan.parent_ranks, plan.choices,
            plan.pair_counts, plan.level_starts, packed, node_log_probs, scores, pairs, sorted_keys, places,
            DEPTH=depth, TOP_K=top_k, KEEP=keep, PAIRS=plan.pairs, COLUMNS=plan.columns, COLUMN_BLOCK=column_block,
            KEEP_BLOCK=triton.next_power_of_2(keep), num_warps=4)
    return packed, node_log_probs
