"""Draft trees: what a drafter proposes and the verifier scores in one target forward.

Node 0 is the root, the last committed token (its KV is not cached yet); every other node is a drafted token.
Parents come before children (parents[i] < i), so depth and ancestry follow in one pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

from treeserve.errors import TreeserveError


@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]
    # A merged drafter's tree: its first `lookup_nodes` drafted nodes (1..lookup_nodes) are prompt lookup's chain,
    # so what lookup alone would have accepted can be read off the accepted path. None: not such a tree.
    lookup_nodes: int | None = None

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

    def shape(self) -> "TreeShape":
        """What follows from the parents alone (depths, ancestor mask), worked out once per shape."""
        return _shape(tuple(self.parents))

    def depths(self) -> list[int]:
        return list(self.shape().depths)

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            children[self.parents[i]].append(i)
        return children

    def ancestor_mask(self, device="cpu"):
        """(N, N) bool: mask[i, j] is True when j is i or one of its ancestors. On the CPU, one tensor per tree
        shape, shared by every tree of that shape: only ever read."""
        mask = self.shape().mask()
        return mask if device == "cpu" else mask.to(device)

    def truncated(self, max_depth: int) -> "DraftTree":
        """The nodes at depth <= max_depth (a round never needs to verify more tokens than it may emit)."""
        depths = self.shape().depths
        if max(depths) <= max_depth:
            return self
        new_index: dict[int, int] = {}
        tokens, parents = [], []
        for i, depth in enumerate(depths):
            if depth <= max_depth:
                new_index[i] = len(tokens)
                tokens.append(self.tokens[i])
                parents.append(new_index[self.parents[i]] if i else -1)
        # The chain's node d sits at depth d, ahead of every other node: it keeps its place.
        lookup_nodes = None if self.lookup_nodes is None else min(self.lookup_nodes, max_depth)
        return DraftTree(tokens, parents, lookup_nodes)


class TreeShape:
    """What follows from a tree's parents alone, worked out in one pass: each node's depth (and the deepest, `height`)
    and its ancestors (itself included) as the bits of an integer; the depths as an array and the ancestor mask
    once asked for. Shared by the trees of one shape: only ever read."""

    __slots__ = ("depths", "height", "ancestors", "_depth_array", "_mask")

    def __init__(self, parents: tuple[int, ...]):
        # Node by node, as the definitions go (depth[i] = depth[parent] + 1; mask row i = row of the parent, plus
        # i): parents before children make that one pass.
        n = len(parents)
        depths, ancestors = [0] * n, [1 << i for i in range(n)]
        for i in range(1, n):
            parent = parents[i]
            depths[i] = depths[parent] + 1
            ancestors[i] |= ancestors[parent]
        self.depths, self.height, self.ancestors = tuple(depths), max(depths, default=0), ancestors
        self._depth_array = self._mask = None

    def depth_array(self):
        """The depths as int64 NumPy (only ever read)."""
        if self._depth_array is None:
            import numpy as np  # here, not at the top: drafters use trees without needing NumPy or torch

            self._depth_array = np.array(self.depths, dtype=np.int64)
        return self._depth_array

    def mask(self):
        """The ancestor mask (N, N) as a bool tensor: row i holds the bits of ancestors[i], unpacked in one NumPy
        call rather than one row operation per node."""
        if self._mask is None:
            import numpy as np
            import torch

            n = len(self.ancestors)
            if n <= 64:  # each row's bits in one little-endian 64-bit word
                words = np.array(self.ancestors, dtype="<u8").view(np.uint8).reshape(n, 8)
            else:
                width = (n + 7) // 8
                words = np.frombuffer(b"".join([bits.to_bytes(width, "little") for bits in self.ancestors]),
                                      dtype=np.uint8).reshape(n, width)
            self._mask = torch.from_numpy(np.unpackbits(words, axis=1, count=n, bitorder="little").view(bool))
        return self._mask


@functools.lru_cache(maxsize=1024)  # at most 17 MB of 129-node masks
def _shape(parents: tuple[int, ...]) -> TreeShape:
    """The TreeShape of trees with these parents. Trees of a few shapes come back round after round (a drafter at
    budget 4 makes few, chains come in one shape a length), while a DDTree tree hardly ever has the shape of
    another: working a shape out must be cheap too."""
    return TreeShape(parents)


# The largest tree a round verifies: the root plus this many drafted nodes.
MAX_BUDGET = 128


class DraftPoolFull(TreeserveError):
    """A drafter cannot hold one more request's context; the request goes on without its trees."""


class DraftContext(Protocol):
    """What a drafter keeps for one request: at least the prompt and output so far (the last token is the
    root of the next tree)."""

    tokens: list[int]


class Drafter(Protocol):
    """Proposes trees for a batch of requests, each rooted at the last token of its context.

    A drafter that conditions on the target (DFlash) names the target layers whose outputs it needs in
    `feature_layer_ids`; it then gets, with each request's newly committed tokens, the target's hidden states
    (concatenated over those layers) for every token that entered the target's KV cache since the last call:
    all committed tokens but the last, which is the root of the next tree. Such a drafter may take rows later than
    their tokens (`rows_wanted` says how many a context lacks), but proposes only for contexts that lack none.
    """

    name: str
    feature_layer_ids: tuple[int, ...]  # empty: the drafter needs only tokens
    feature_size: int  # columns of the features: len(feature_layer_ids) * the target's hidden size

    def new_context(self) -> DraftContext: ...

    def extend(self, context: DraftContext, tokens: list[int], features=None) -> None:
        """Raises DraftPoolFull when the context no longer fits what the drafter holds."""
        ...

    def propose(self, contexts: list[DraftContext], budgets: list[int]) -> list[DraftTree]:
        """One tree per context, with at most budgets[i] drafted nodes below its root."""
        ...

    def release(self, context: DraftContext) -> None:
        """The request is over: free what its context holds beyond Python objects (pool blocks)."""
        ...

    # A drafter with feature_layer_ids also has write_context(): the feature rows its contexts took without a tree
    # are written now rather than before their next tree (DrafterServicer calls it between rounds).


class TokenContext:
    """A request's tokens so far, with where each token occurs, kept up to date as tokens come: a drafter looks a
    token's earlier occurrences up instead of scanning the whole context."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        self.occurrences: dict[int, list[int]] = {}  # token -> its positions, ascending
        self.add(tokens)

    def add(self, tokens: list[int]) -> None:
        for token in tokens:
            self.occurrences.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)


class TokenDrafter:
    """Base for drafters that need only the tokens so far: subclasses implement `tree(context, budget)`."""

    name = "tokens"
    feature_layer_ids: tuple[int, ...] = ()
    feature_size = 0

    def new_context(self) -> TokenContext:
        return TokenContext()

    def extend(self, context: TokenContext, tokens: list[int], features=None) -> None:
        if features is not None:
            raise TreeserveError(f"the {self.name} drafter takes no target features")
        context.add(tokens)

    def propose(self, contexts: list[TokenContext], budgets: list[int]) -> list[DraftTree]:
        return [self.tree(context, budget) for context, budget in zip(contexts, budgets)]

    def release(self, context: TokenContext) -> None:
        pass

    def tree(self, context: TokenContext, budget: int) -> DraftTree:
        raise NotImplementedError
