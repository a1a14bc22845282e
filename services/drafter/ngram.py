"""Prompt-lookup drafting that proposes a tree: where the latest tokens occurred before (in the prompt or the
output so far), what followed them then is a good guess for what follows now. Several earlier occurrences
with different continuations become branches of one tree instead of one chain."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from treeserve.tree import DraftTree, TokenDrafter


class NgramDrafter(TokenDrafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_continuations: int = 16):
        self.max_ngram, self.min_ngram, self.max_continuations = max_ngram, min_ngram, max_continuations

    def continuations(self, context: list[int], length: int) -> list[np.ndarray]:
        """Continuations of earlier occurrences of the context's suffix: longest suffix match first, then the
        most recent occurrence first; each occurrence once."""
        tokens = np.asarray(context, dtype=np.int64)
        found, used_starts = [], set()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            # Windows over all but the last token, so every match has at least one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            for start in np.flatnonzero((windows == tokens[-n:]).all(axis=1))[::-1] + n:
                if start not in used_starts:
                    used_starts.add(start)
                    found.append(tokens[start:start + length])
                    if len(found) == self.max_continuations:
                        return found
        return found

    def tree(self, context: list[int], budget: int) -> DraftTree:
        """The tree for one context: continuations merged into a trie of at most `budget` drafted nodes."""
        tokens, parents = [context[-1]], [-1]
        node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node: shared prefixes merge
        for continuation in self.continuations(context, budget):
            node = 0
            for token in continuation.tolist():
                child = node_of.get((node, token))
                if child is None:
                    if len(tokens) > budget:
                        return DraftTree(tokens, parents)
                    child = node_of[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child
        return DraftTree(tokens, parents)
