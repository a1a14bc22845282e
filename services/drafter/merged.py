"""One tree from two drafters: prompt lookup's best continuation, then DFlash's tree for the rest of the budget.

Prompt lookup (n-gram) is right for long stretches where an answer copies its prompt or itself, and proposes
nothing elsewhere; DFlash drafts new text. Each round the merged tree takes the n-gram drafter's best continuation
as a chain (at most half the budget, so DFlash always keeps the other half), then the best DFlash tree of the
budget left, merged in as a trie: a DFlash node that repeats the chain's prefix is the chain's node, so its
subtree hangs from the chain. Where lookup finds nothing, the whole budget is DFlash's. The tree says how long its
chain is (`DraftTree.lookup_nodes`), so the verifier learns what lookup alone would have accepted.

A round may also ask for prompt lookup's tree alone (`propose_lookup`): no DFlash forward, for rounds where its
cost would not pay (a larger batch). Such rounds need no target features: the DFlash context takes the tokens, and
their feature rows come with the next round that drafts with DFlash.
"""

from __future__ import annotations

from treeserve.drafter.ngram import NgramDrafter
from treeserve.tree import DraftTree, TokenContext


class MergedContext:
    """A request's context in both drafters: the lookup index of its tokens and the DFlash context."""

    def __init__(self, dflash_context):
        self.lookup = TokenContext()
        self.dflash = dflash_context

    @property
    def tokens(self) -> list[int]:
        return self.lookup.tokens


class MergedDrafter:
    name = "merged"

    def __init__(self, dflash, ngram: NgramDrafter | None = None):
        self.dflash, self.ngram = dflash, ngram or NgramDrafter()
        self.feature_layer_ids, self.feature_size = dflash.feature_layer_ids, dflash.feature_size

    def new_context(self) -> MergedContext:
        return MergedContext(self.dflash.new_context())

    def extend(self, context: MergedContext, tokens: list[int], features=None) -> None:
        self.dflash.extend(context.dflash, tokens, features)  # first: it may refuse (DraftPoolFull)
        context.lookup.add(tokens)

    def release(self, context: MergedContext) -> None:
        self.dflash.release(context.dflash)

    def write_context(self) -> None:
        """Write the DFlash contexts' feature rows that wait for their next block forward, now."""
        self.dflash.write_context()

    def rows_wanted(self, context: MergedContext, new_tokens: int = 0) -> int:
        """Feature rows the DFlash context lacks once `new_tokens` more tokens join."""
        return context.dflash.rows_wanted(new_tokens)

    def propose(self, contexts: list[MergedContext], budgets: list[int]) -> list[DraftTree]:
        chains = [self.lookup_chain(context, budget) for context, budget in zip(contexts, budgets)]
        trees = self.dflash.propose([c.dflash for c in contexts], [b - len(c) for b, c in zip(budgets, chains)])
        return [merge(context.tokens[-1], chain, tree) for context, chain, tree in zip(contexts, chains, trees)]

    def propose_lookup(self, contexts: list[MergedContext], budgets: list[int]) -> list[DraftTree]:
        """Prompt lookup's own trees (its continuations as a trie of the whole budget), without DFlash."""
        return self.ngram.propose([context.lookup for context in contexts], budgets)

    def lookup_chain(self, context: MergedContext, budget: int) -> list[int]:
        """The n-gram drafter's best continuation, at most half the budget (none at budget 1: DFlash's own
        first guess is the better single token)."""
        found = self.ngram.continuations(context.lookup, budget // 2, limit=1) if budget >= 2 else []
        return found[0] if found else []


def merge(root: int, chain: list[int], tree: DraftTree) -> DraftTree:
    """`chain` below the root, then `tree`'s nodes (parents before children) merged in as a trie. A DFlash node
    can only repeat a node of the chain (no two of its own nodes share parent and token): the one whose parent
    lies on the chain at depth d and whose token is the chain's next, chain[d]."""
    if not chain:
        return DraftTree(tree.tokens, tree.parents, lookup_nodes=0)
    tokens, parents = [root, *chain], list(range(-1, len(chain)))
    merged_of = [0]  # tree node -> merged node
    chain_depth = [0]  # tree node -> its depth on the chain, or -1 off it
    for token, parent in zip(tree.tokens[1:], tree.parents[1:]):
        depth = chain_depth[parent]
        if 0 <= depth < len(chain) and chain[depth] == token:
            merged_of.append(depth + 1)
            chain_depth.append(depth + 1)
        else:
            merged_of.append(len(tokens))
            chain_depth.append(-1)
            tokens.append(token)
            parents.append(merged_of[parent])
    return DraftTree(tokens, parents, lookup_nodes=len(chain))
