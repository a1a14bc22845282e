"""Prompt-lookup drafting that proposes a tree: where the latest tokens occurred before (in the prompt or the
output so far), what followed them then is a good guess for what follows now. Several earlier occurrences
with different continuations become branches of one tree instead of one chain."""

from __future__ import annotations

from treeserve.tree import DraftTree, TokenContext, TokenDrafter


class NgramDrafter(TokenDrafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_continuations: int = 16):
        self.max_ngram, self.min_ngram, self.max_continuations = max_ngram, min_ngram, max_continuations

    def continuations(self, context: TokenContext | list[int], length: int, limit: int | None = None
                      ) -> list[list[int]]:
        """Continuations of earlier occurrences of the context's suffix: longest suffix match (up to max_ngram)
        first, then the most recent occurrence first; each occurrence once; the first `limit` of them (default
        max_continuations).

        Only the earlier occurrences of the last token are candidates, from the context's index, most recent
        first, and the walk stops once `limit` of them match as far back as any can. This replaced
        NumPy over each whole context, whose cost on a large batch's critical path was mostly call overhead on
        small arrays (docs/benchmarks.md, "Host work")."""
        if not isinstance(context, TokenContext):
            context = TokenContext(context)
        limit = self.max_continuations if limit is None else limit
        tokens = context.tokens
        last = len(tokens) - 1
        longest = min(self.max_ngram, last)  # the longest suffix an earlier occurrence can match
        found, full = [], 0  # (-matched, -end) of each match; how many matched `longest`
        ends = context.occurrences.get(tokens[-1], []) if tokens else []
        for i in range(len(ends) - 2, -1, -1):  # every occurrence but the last token itself, newest first
            end, matched = ends[i], 1
            while matched < longest and end >= matched and tokens[end - matched] == tokens[last - matched]:
                matched += 1
            if matched >= self.min_ngram:
                found.append((-matched, -end))
                full += matched == longest
                if full == limit:  # older occurrences can no longer rank among the first
                    break
        found.sort()
        return [tokens[1 - minus_end:1 - minus_end + length] for _, minus_end in found[:limit]]

    def tree(self, context: TokenContext | list[int], budget: int) -> DraftTree:
        """The tree for one context (or list of tokens): continuations merged into a trie of at most `budget`
        drafted nodes, the better-ranked continuations' nodes first."""
        tokens = context.tokens if isinstance(context, TokenContext) else context
        tree_tokens, parents = [tokens[-1]], [-1]
        children: list[dict[int, int]] = [{}]  # node -> its children by token: shared prefixes merge
        merged: set[tuple[int, ...]] = set()
        for continuation in self.continuations(context, budget):
            path = tuple(continuation)
            if path in merged:  # repetitive text repeats whole continuations: they add no node
                continue
            merged.add(path)
            node = 0
            for token in continuation:
                child = children[node].get(token)
                if child is None:
                    if len(tree_tokens) > budget:
                        return DraftTree(tree_tokens, parents)
                    child = children[node][token] = len(tree_tokens)
                    children.append({})
                    tree_tokens.append(token)
                    parents.append(node)
                node = child
        return DraftTree(tree_tokens, parents)
