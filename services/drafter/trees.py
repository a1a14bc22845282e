"""DDTree draft trees from per-position top-K lists (DFlash outputs), batched on the inputs' device.

A DFlash forward gives, for each future position i = 1..D, a distribution that does not depend on the path;
we keep its top-K tokens and log-probabilities sorted descending. A candidate node at depth d is a path of
choice indices (k_1..k_d) with token token_ids[d-1, k_d] and score sum_i log_probs[i-1, k_i].

DDTree (arXiv 2604.12989) keeps the `budget` highest-scoring nodes. Log-probs are <= 0, so a child never
scores above its parent, and a top-`budget` node's parent ranks above it; so the top-`budget` nodes of depth d
all hang from the top-`budget` nodes of depth d - 1. The search therefore runs depth by depth, D steps whatever
the budget: expand the previous depth's best M nodes (M at least the largest budget of the batch) and keep the
best M; then take each request's top `budget` over all depths. Every chosen node's parent is chosen too, so the
result is a tree; nodes come out depth by depth (parents before children).

Nothing is lost by keeping each position's top M tokens only: a node whose token is a position's (k+1)-th has k
elder siblings that rank above it, so it is in the top M only if k < M. Nor by expanding only the pairs (parent
rank i, choice k) with (i + 1)(k + 1) <= M: every pair (i' <= i, k' <= k) ranks above (i, k), so a pair with more
than M of them cannot be among the best M. That is about M ln M candidates a depth instead of M * M.

The search is fixed-shape tensor work for a given (batch, D, K, M) (ddtree_select), so the DFlash drafter
replays it from CUDA graphs, with the budgets as an input; on a GPU as one Triton launch (ddtree_select_kernel).

Ties: a shallower node ranks before a deeper one of equal score (so a parent always before its child), and
within a depth the order is (parent's rank, choice index): elder siblings first.

Every width M from the largest budget up gives the same trees, ties included, so the DFlash drafter searches each
round at the narrowest of a few widths that holds its largest budget, from each position's top M tokens. Within a
depth the order above is total, and the M nodes a search keeps at a depth are the first M of it over all that
depth's nodes (by induction on depth): such a node has fewer than M nodes ahead of it, while its (i + 1)(k + 1) - 1
pairs (i' <= i, k' <= k) all are (no lower scores, as a float sum rounds monotonically, and earlier in (parent
rank, choice) order), so the search expands it. Over all depths, a node beyond its depth's first M has at least
M nodes ahead of it, so the top `budget` <= M are the same for any such M, and so are their places in the tree.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from treeserve.errors import TreeserveError
from treeserve.tree import DraftTree


def ddtree_from_distributions(roots: torch.Tensor, log_probs: torch.Tensor, budgets) -> list[DraftTree]:
    """Per request, the best tree of min(budget, all possible nodes) drafted nodes, from each position's whole
    distribution: log_probs (B, D, vocab). Sorts only each position's top min(largest budget, vocab) tokens."""
    largest = max(_budget_list(budgets, len(roots)), default=0)
    top = log_probs.topk(max(1, min(largest, log_probs.shape[-1])), dim=-1)
    return ddtree_trees(roots, top.values, top.indices, budgets)


def ddtree_trees(roots: torch.Tensor, log_probs: torch.Tensor, token_ids: torch.Tensor, budgets,
                 with_log_probs: bool = False):
    """Per request, the DDTree of min(budget, all possible nodes) drafted nodes under its root.

    roots (B,) long; log_probs (B, D, K) float and token_ids (B, D, K) long, each position sorted by
    descending log-prob; budgets: B non-negative ints (list or 1-D tensor). Nodes come depth by depth. With
    with_log_probs, also returns per tree the draft log-prob of each node's own token (0.0 for the root, which
    is already committed), aligned with tree.tokens.
    """
    batch, depth, top_k = log_probs.shape
    if token_ids.shape != log_probs.shape or roots.shape != (batch,):
        raise TreeserveError(f"ddtree: roots {tuple(roots.shape)}, log_probs {tuple(log_probs.shape)} and "
                             f"token_ids {tuple(token_ids.shape)} do not describe one batch")
    budget_list = _budget_list(budgets, batch)
    if batch == 0:
        return ([], []) if with_log_probs else []
    keep = min(max(budget_list), possible_nodes(depth, top_k))
    if keep == 0:
        trees = [DraftTree([root], [-1]) for root in roots.tolist()]
        return (trees, [[0.0] for _ in trees]) if with_log_probs else trees
    packed, node_log_probs = ddtree_select(log_probs, token_ids, torch.tensor(budget_list, device=log_probs.device),
                                           keep)
    trees = unpack_trees(roots.tolist(), packed.tolist())
    if not with_log_probs:
        return trees
    return trees, [[0.0] + row[:tree.size - 1] for row, tree in zip(node_log_probs.tolist(), trees)]


def possible_nodes(depth: int, top_k: int) -> int:
    """Nodes below the root of the full tree of `top_k` choices at each of `depth` positions."""
    return sum(top_k ** d for d in range(1, depth + 1))


def ddtree_select(log_probs: torch.Tensor, token_ids: torch.Tensor, budgets: torch.Tensor, keep: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The search itself, in tensors whose shapes depend only on (B, D, K, keep), so that a CUDA graph can
    capture it: budgets (B,) long on the inputs' device, each at most `keep` (1 <= keep <= possible_nodes(D, K)).

    Returns packed (B, 1 + 2 * keep) long, per request its drafted-node count n, then its nodes' tokens and
    their parents (0 is the root, node j is j + 1), each in keep columns of which the first n hold the tree
    (unpack_trees reads it); and node_log_probs (B, keep), the draft log-prob of each drafted node's token."""
    batch, depth, top_k = log_probs.shape
    device = log_probs.device
    plan = search_plan(depth, top_k, keep, device)
    # Summed in at least float32: a bf16 running sum would blur which path is best.
    scores_in = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))

    # Per depth, the kept nodes' path scores and, as `orders`, which of the depth's candidate pairs they are.
    level_scores, orders = [], []
    previous = torch.zeros(batch, 1, dtype=scores_in.dtype, device=device)  # the root
    for position, (parent_ranks, choices) in enumerate(plan.pairs):
        candidates = previous[:, parent_ranks] + scores_in[:, position, choices]  # in (parent rank, choice) order
        order = candidates.argsort(dim=1, descending=True, stable=True)[:, :keep]
        previous = candidates.gather(1, order)
        level_scores.append(previous)
        orders.append(order)

    # Rank every kept node of every depth; depth-major concatenation makes ties go to the shallower node.
    scores = torch.cat(level_scores, dim=1)
    ranked = scores.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(ranked).scatter_(1, ranked, plan.columns.expand_as(ranked))
    chosen = rank < budgets[:, None]
    # A chosen node's place in its tree (0 is the root; unchosen nodes get 0 and are written to a dump column).
    places = chosen.long().cumsum(dim=1) * chosen
    # Every kept node's pair, looked up once for all depths: its token, and its parent's place (the root's, 0,
    # in front of the places, for depth 1).
    pair = torch.cat(orders, dim=1) + plan.pair_offsets
    cell = plan.cells[pair]  # its (position, choice) in the flattened top-k lists
    tokens = token_ids.reshape(batch, -1).gather(1, cell)
    parents = torch.cat([torch.zeros_like(places[:, :1]), places], dim=1).gather(1, plan.parent_columns[pair])

    def compact(values: torch.Tensor) -> torch.Tensor:
        """Column 0 collects the unchosen nodes; columns 1..keep are a tree's drafted nodes in order."""
        return torch.zeros(batch, scores.shape[1] + 1, dtype=values.dtype, device=device).scatter_(
            1, places, values)[:, 1:keep + 1]

    counts = chosen.sum(dim=1, keepdim=True)
    packed = torch.cat([counts, compact(tokens), compact(parents)], dim=1)
    return packed, compact(log_probs.reshape(batch, -1).gather(1, cell))


def ddtree_select_kernel(log_probs: torch.Tensor, token_ids: torch.Tensor, budgets: torch.Tensor, keep: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """ddtree_select as one Triton launch, one program per request (treeserve.kernels.ddtree_search): the same
    results, bit for bit; on a GPU, a fraction of the many small kernels of the search in PyTorch."""
    from treeserve.kernels.ddtree_search import ddtree_search  # Triton: only where the kernel runs

    batch, depth, top_k = log_probs.shape
    return ddtree_search(log_probs, token_ids, budgets, keep, kernel_tables(depth, top_k, keep, log_probs.device))


@functools.lru_cache(maxsize=64)
def kernel_tables(depth: int, top_k: int, keep: int, device: torch.device):
    """The kernel's tables of a search of this shape, made once (a graph that replays the kernel reads them: its
    owner keeps them alive, whatever the cache lets go of)."""
    from treeserve.kernels.ddtree_search import kernel_plan

    pairs = [(ranks.tolist(), choices.tolist())
             for ranks, choices in search_plan(depth, top_k, keep, torch.device("cpu")).pairs]
    return kernel_plan(pairs, keep, torch.device(device))


@dataclasses.dataclass(frozen=True)
class SearchPlan:
    """The index tables of a search of shape (D, K, keep), on its device: per depth, the (parent rank, choice)
    pairs it expands; and over every depth's pairs concatenated, each pair's cell in the flattened (D * K)
    top-k lists and its parent's column among [root] + every depth's kept nodes."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    pair_offsets: torch.Tensor  # (kept nodes,): where each depth's pairs start, for each of its kept columns
    cells: torch.Tensor
    parent_columns: torch.Tensor
    columns: torch.Tensor  # 0 .. kept nodes - 1


@functools.lru_cache(maxsize=64)
def search_plan(depth: int, top_k: int, keep: int, device: torch.device) -> SearchPlan:
    """The tables of a search of this shape, made once (a graph that replays the search reads these very tensors:
    its owner keeps them alive, whatever the cache lets go of)."""
    pairs, offsets, cells, parent_columns = [], [], [], []
    width, pair_start, level_start = 1, 0, 0  # the previous depth's kept nodes; where its pairs and columns start
    for position in range(depth):
        parent_ranks, choices = _expandable(width, top_k, keep)
        pairs.append((torch.tensor(parent_ranks, device=device), torch.tensor(choices, device=device)))
        kept = min(keep, len(parent_ranks))
        offsets += [pair_start] * kept
        cells += [position * top_k + choice for choice in choices]
        # Parent columns count the root as column 0, so depth d's parents start after depth d - 1's start.
        parent_columns += [0 if position == 0 else level_start + 1 + rank for rank in parent_ranks]
        if position:
            level_start += width
        width, pair_start = kept, pair_start + len(parent_ranks)
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return SearchPlan(pairs, as_tensor(offsets), as_tensor(cells), as_tensor(parent_columns),
                      torch.arange(len(offsets), device=device))


def unpack_trees(roots: list[int], packed: list[list[int]]) -> list[DraftTree]:
    """The trees ddtree_select packed (its rows as lists), under their roots."""
    trees = []
    for root, row in zip(roots, packed):
        keep, count = (len(row) - 1) // 2, row[0]
        trees.append(DraftTree([root] + row[1:1 + count], [-1] + row[1 + keep:1 + keep + count]))
    return trees


def _expandable(parents: int, choices: int, keep: int) -> tuple[list[int], list[int]]:
    """The (parent rank i, choice k) pairs with (i + 1)(k + 1) <= keep, in (i, k) order, as two index lists:
    the only children of `parents` sorted nodes that can rank among the best `keep` (see the module docstring).
    When parents * choices <= keep, that is every pair."""
    pairs = [(i, k) for i in range(parents) for k in range(min(choices, keep // (i + 1)))]
    return [i for i, _ in pairs], [k for _, k in pairs]


def _budget_list(budgets, batch: int) -> list[int]:
    budget_list = budgets.tolist() if isinstance(budgets, torch.Tensor) else [int(b) for b in budgets]
    if len(budget_list) != batch:
        raise TreeserveError(f"{len(budget_list)} budgets for a batch of {batch}")
    if any(b < 0 for b in budget_list):
        raise TreeserveError("budgets must be non-negative")
    return budget_list
