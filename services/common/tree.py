"""Draft trees: what a drafter proposes and the verifier scores in one target forward.

Node 0 is the root, the last committed token (its KV is not cached yet); every other node is a drafted token.
Parents come before children (parents[i] < i), so depth and ancestry follow in one pass.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from treeserve.errors import TreeserveError


@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int) -> None:
        if not self.tokens or len(self.tokens) != len(self.parents):
            raise TreeserveError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.parents[0] != -1:
            raise TreeserveError("draft tree: node 0 must be the root (parent -1)")
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise TreeserveError(f"draft tree: node {i} has parent {parent}; parents must precede children")
        bad = [t for t in self.tokens if not 0 <= t < vocab_size]
        if bad:
            raise TreeserveError(f"draft tree: token id {bad[0]} outside the vocabulary (size {vocab_size})")

    def depths(self) -> list[int]:
        depths = [0] * self.size
        for i in range(1, self.size):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            children[self.parents[i]].append(i)
        return children

    def ancestor_mask(self, device="cpu"):
        """(N, N) bool: mask[i, j] is True when j is i or one of its ancestors."""
        import torch  # here, not at the top: drafters use trees without needing torch

        mask = torch.eye(self.size, dtype=torch.bool)
        for i in range(1, self.size):
            mask[i] |= mask[self.parents[i]]
        return mask.to(device)

    def truncated(self, max_depth: int) -> "DraftTree":
        """The nodes at depth <= max_depth (a round never needs to verify more tokens than it may emit)."""
        depths = self.depths()
        if max(depths) <= max_depth:
            return self
        new_index: dict[int, int] = {}
        tokens, parents = [], []
        for i, depth in enumerate(depths):
            if depth <= max_depth:
                new_index[i] = len(tokens)
                tokens.append(self.tokens[i])
                parents.append(new_index[self.parents[i]] if i else -1)
        return DraftTree(tokens, parents)


# The largest tree a round verifies: the root plus this many drafted nodes.
MAX_BUDGET = 128


class Drafter(Protocol):
    """Proposes a tree rooted at the last token of `context` (the prompt plus everything generated so far),
    with at most `budget` drafted nodes below the root."""

    name: str

    def propose(self, context: list[int], budget: int) -> DraftTree: ...
