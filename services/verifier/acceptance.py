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
    children = tree.children()
    node, kept, emitted = 0, [0], []
    while True:
        token = choices[node]
        emitted.append(token)
        node = next((child for child in children[node] if tree.tokens[child] == token), -1)
        if node < 0:
            return kept, emitted
        kept.append(node)
