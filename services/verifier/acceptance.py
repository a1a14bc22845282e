"""Which drafted tokens the target accepts.

Walk from the root: at each node the target makes its own choice (argmax, or a draw from its distribution);
if a child holds that token, the walk moves there, otherwise that choice is the bonus token and the walk ends.
Every emitted token is therefore exactly what the target alone would have produced at that point, whatever
the drafter proposed: the output is lossless by construction.
"""

from __future__ import annotations

from treeserve.tree import DraftTree


def walk_tree(tree: DraftTree, choices: list[int]) -> tuple[list[int], list[int]]:
    """choices[i]: the target's next token after node i's path.

    Returns (kept_nodes, emitted): the root plus accepted nodes, whose KV stays, and the emitted tokens
    (accepted drafted tokens, then the bonus); emitted[i] == choices[kept_nodes[i]].
    """
    parents, tokens = tree.parents, tree.tokens
    node, kept, emitted = 0, [0], []
    while True:
        token = choices[node]
        emitted.append(token)
        if token not in tokens:  # the bonus token, mostly (and a plain step's): no child holds it
            return kept, emitted
        # The first child of `node` that holds the token: the first drafted node holding it whose parent is `node`
        # (list.index scans in C; without a list of every node's children, which cost more than the walk).
        child = 0
        while True:
            try:
                child = tokens.index(token, child + 1)
            except ValueError:
                return kept, emitted
            if parents[child] == node:
                break
        node = child
        kept.append(node)


def chain_accepted(kept: list[int], chain_nodes: int | None) -> int | None:
    """How far the accepted path `kept` (walk_tree's) followed a tree's leading chain, nodes 1..chain_nodes each
    the child of the one before (a merged tree's lookup chain): what that chain alone would have accepted, since
    no two children of a node hold the same token. None for a tree without such a chain."""
    if chain_nodes is None:
        return None
    accepted = 0
    while accepted < chain_nodes and accepted + 1 < len(kept) and kept[accepted + 1] == accepted + 1:
        accepted += 1
    return accepted
