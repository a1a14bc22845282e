"""Draft trees from per-position top-K lists (DFlash outputs), batched on the inputs' device.

A DFlash forward gives, for each future position i = 1..D, a distribution that does not depend on the path;
we keep its top-K tokens and log-probabilities sorted descending. A candidate node at depth d is a path of
choice indices (k_1..k_d) with token token_ids[d-1, k_d] and score sum_i log_probs[i-1, k_i].

DDTree (arXiv 2604.12989) keeps the `budget` highest-scoring nodes. Log-probs are <= 0, so a child never
scores above its parent; each list is sorted, so a younger sibling (k+1) never scores above its elder (k).
Every node is therefore reached from a node scoring at least as high by one of two moves, "first child" or
"next younger sibling", and best-first search that pops the best frontier node and pushes those two
successors pops nodes in non-increasing score order: the first `budget` pops are a top-`budget` set. A node
is pushed only after its parent is popped (its elder sibling shares that parent), so the set is a tree and
the pop order puts parents before children.

Ties: among equal scores the node discovered (pushed) first wins, and in one step the first child is pushed
before the younger sibling.
"""

from __future__ import annotations

import torch

from treeserve.errors import TreeserveError
from treeserve.tree import DraftTree


def chain_trees(roots: torch.Tensor, token_ids: torch.Tensor, budgets) -> list[DraftTree]:
    """Per request, the argmax chain (choice 0 at every position), cut to its budget and to D."""
    batch, depth, _ = token_ids.shape
    budget_list = _budget_list(budgets, batch)
    root_list, argmax_tokens = roots.tolist(), token_ids[:, :, 0].tolist()
    return [
        DraftTree.chain([root] + tokens[:min(budget, depth)])
        for root, tokens, budget in zip(root_list, argmax_tokens, budget_list)
    ]


def ddtree_trees(roots: torch.Tensor, log_probs: torch.Tensor, token_ids: torch.Tensor, budgets,
                 with_log_probs: bool = False):
    """Per request, the DDTree of min(budget, all possible nodes) drafted nodes under its root.

    roots (B,) long; log_probs (B, D, K) float and token_ids (B, D, K) long, each position sorted by
    descending log-prob; budgets: B non-negative ints (list or 1-D tensor). Nodes come in selection order
    (non-increasing score, parents first). With with_log_probs, also returns per tree the draft log-prob of
    each node's own token (0.0 for the root, which is already committed), aligned with tree.tokens.
    """
    batch, depth, top_k = log_probs.shape
    if token_ids.shape != log_probs.shape or roots.shape != (batch,):
        raise TreeserveError(f"ddtree: roots {tuple(roots.shape)}, log_probs {tuple(log_probs.shape)} and "
                             f"token_ids {tuple(token_ids.shape)} do not describe one batch")
    device = log_probs.device
    budget_list = _budget_list(budgets, batch)
    if batch == 0:
        return ([], []) if with_log_probs else []
    budgets = torch.tensor(budget_list, dtype=torch.long, device=device)
    possible = sum(top_k ** d for d in range(1, depth + 1))
    steps = min(max(budget_list), possible)

    # Accumulate in at least float32: a bf16 running sum would blur which path is best.
    score_dtype = torch.promote_types(log_probs.dtype, torch.float32)
    scores_in = log_probs.to(score_dtype)
    rows = torch.arange(batch, device=device)

    # Frontier slots: slot 0 holds the root's first child, step t writes its two successors to slots
    # 1+2t and 2+2t, so slot order is discovery order (the tie rule) and no per-row write pointer is needed.
    slots = 2 * steps + 1
    live = torch.zeros(batch, slots, dtype=torch.bool, device=device)
    score = torch.full((batch, slots), float("-inf"), dtype=score_dtype, device=device)
    parent_score = torch.zeros(batch, slots, dtype=score_dtype, device=device)  # sibling = parent + own
    position = torch.zeros(batch, slots, dtype=torch.long, device=device)  # depth - 1
    choice = torch.zeros(batch, slots, dtype=torch.long, device=device)
    parent = torch.zeros(batch, slots, dtype=torch.long, device=device)  # node index in the output tree
    if steps:
        live[:, 0] = True
        score[:, 0] = scores_in[:, 0, 0]

    out_tokens = torch.zeros(batch, steps, dtype=torch.long, device=device)
    out_parents = torch.zeros(batch, steps, dtype=torch.long, device=device)
    out_log_probs = torch.zeros(batch, steps, dtype=log_probs.dtype, device=device)
    counts = torch.zeros(batch, dtype=torch.long, device=device)

    for step in range(steps):
        # Best live slot per row, the first one among equals (argmax returns the first maximum). Comparing
        # against the row max rather than taking argmax of scores keeps -inf scores apart from empty slots.
        masked = torch.where(live, score, float("-inf"))
        is_best = live & (masked == masked.max(dim=1, keepdim=True).values)
        best = is_best.to(torch.int32).argmax(dim=1)
        # A row that stops taking (budget reached or frontier empty) never resumes: nothing more is pushed
        # for it, so each row's nodes are a prefix of the output columns.
        take = live[rows, best] & (step < budgets)
        best_position, best_choice = position[rows, best], choice[rows, best]
        best_score, best_parent = score[rows, best], parent[rows, best]

        out_tokens[:, step] = token_ids[rows, best_position, best_choice]
        out_parents[:, step] = best_parent
        out_log_probs[:, step] = log_probs[rows, best_position, best_choice]
        counts += take
        live[rows, best] &= ~take
        node = step + 1  # node 0 is the root

        child, sibling = 1 + 2 * step, 2 + 2 * step
        child_position = best_position + 1
        child_ok = take & (child_position < depth)
        child_position = child_position.clamp(max=depth - 1)  # keep gathers in range where not ok
        live[:, child] = child_ok
        position[:, child], choice[:, child], parent[:, child] = child_position, 0, node
        parent_score[:, child] = best_score
        score[:, child] = best_score + scores_in[rows, child_position, 0]

        sibling_choice = best_choice + 1
        sibling_ok = take & (sibling_choice < top_k)
        sibling_choice = sibling_choice.clamp(max=top_k - 1)
        sibling_parent_score = parent_score[rows, best]
        live[:, sibling] = sibling_ok
        position[:, sibling], choice[:, sibling], parent[:, sibling] = best_position, sibling_choice, best_parent
        parent_score[:, sibling] = sibling_parent_score
        score[:, sibling] = sibling_parent_score + scores_in[rows, best_position, sibling_choice]

    # One transfer for the structure (and one for the log-probs when asked), then plain Python per request.
    packed = torch.cat([roots.to(torch.long)[:, None], counts[:, None], out_tokens, out_parents], dim=1).tolist()
    trees = []
    for row in packed:
        root, count = row[0], row[1]
        tokens, parents = row[2:2 + count], row[2 + steps:2 + steps + count]
        trees.append(DraftTree([root] + tokens, [-1] + parents))
    if not with_log_probs:
        return trees
    node_log_probs = [[0.0] + row[:tree.size - 1] for row, tree in zip(out_log_probs.tolist(), trees)]
    return trees, node_log_probs


def _budget_list(budgets, batch: int) -> list[int]:
    budget_list = budgets.tolist() if isinstance(budgets, torch.Tensor) else [int(b) for b in budgets]
    if len(budget_list) != batch:
        raise TreeserveError(f"{len(budget_list)} budgets for a batch of {batch}")
    if any(b < 0 for b in budget_list):
        raise TreeserveError("budgets must be non-negative")
    return budget_list
