"""A small causal LM as drafter: it shares the target's tokenizer and grows a tree by top-k expansion over its
own autoregressive steps.

Each request keeps the draft model's own KV cache over its committed tokens but the last (the root), as the
target's cache does. A round first brings every request's cache up to date (one batched forward), then grows
the trees one level per draft forward: every node of a tree so far is run against the cache with the tree's
ancestor mask (the tree is at most budget + 1 nodes, so recomputing it is cheap and keeps the cache untouched),
the deepest level's nodes give their top-k next tokens, and the best candidates by summed log-probability, at
most `width` per level, join the tree until its budget is spent.
"""

from __future__ import annotations

import torch

from treeserve.errors import TreeserveError
from treeserve.models import BatchAttention, DecoderLM, KVCache, TreeAttention
from treeserve.tree import DraftTree


class DraftModelContext:
    def __init__(self, cache: KVCache):
        self.tokens: list[int] = []
        self.cache = cache  # the draft model's KV over tokens[:-1]


class DraftModelDrafter:
    name = "model"
    feature_layer_ids: tuple[int, ...] = ()
    feature_size = 0

    def __init__(self, model: DecoderLM, top_k: int = 4, width: int = 8, max_context: int | None = None):
        if top_k < 1 or width < 1:
            raise TreeserveError("the draft model's top_k and width must be at least 1")
        self.model, self.top_k, self.width = model, top_k, width
        self.max_context = max_context or model.config.max_context

    @classmethod
    def load(cls, spec: str, device: str, dtype: str, target_tokenizer, **options) -> "DraftModelDrafter":
        """Load the draft model at `spec` (any target spec); its vocabulary must be the target's, token for
        token (checked on a sample of ids)."""
        from treeserve.loading import load_target

        draft = load_target(spec, device=device, dtype=dtype)
        step = max(1, target_tokenizer.vocab_size // 512)
        if draft.tokenizer.vocab_size != target_tokenizer.vocab_size or any(
                draft.tokenizer.decode([i]) != target_tokenizer.decode([i])
                for i in range(0, target_tokenizer.vocab_size, step)):
            raise TreeserveError(f"draft model {spec!r} does not share the target's tokenizer")
        return cls(draft.model, **options)

    def new_context(self) -> DraftModelContext:
        cfg = self.model.config
        return DraftModelContext(KVCache(cfg, self.max_context + 1, self.model.dtype, self.model.device))

    def release(self, context: DraftModelContext) -> None:
        pass  # its contiguous cache goes with the context

    def extend(self, context: DraftModelContext, tokens: list[int], features=None) -> None:
        if features is not None:
            raise TreeserveError("the draft-model drafter takes no target features")
        if len(context.tokens) + len(tokens) > self.max_context:
            raise TreeserveError(f"the draft model's context of {self.max_context} tokens is full")
        context.tokens.extend(tokens)

    @torch.inference_mode()
    def propose(self, contexts: list[DraftModelContext], budgets: list[int]) -> list[DraftTree]:
        self._catch_up(contexts)
        trees = [([context.tokens[-1]], [-1], [0.0]) for context in contexts]  # tokens, parents, path scores
        levels = [[0] for _ in contexts]  # each tree's deepest nodes, the ones that grow next
        while True:
            growing = [i for i, (tree, budget) in enumerate(zip(trees, budgets))
                       if levels[i] and len(tree[0]) <= budget and self._fits(contexts[i], tree)]
            if not growing:
                break
            log_probs = self._tree_log_probs([contexts[i] for i in growing], [trees[i] for i in growing],
                                             [levels[i] for i in growing])
            for i, rows in zip(growing, log_probs):
                levels[i] = self._grow(trees[i], levels[i], rows, budgets[i])
        return [DraftTree(tokens, parents) for tokens, parents, _ in trees]

    def _fits(self, context: DraftModelContext, tree) -> bool:
        return context.cache.length + len(tree[0]) <= context.cache.capacity

    def _catch_up(self, contexts: list[DraftModelContext]) -> None:
        """Run the committed tokens the draft cache lacks (all but each root) in one batched forward."""
        behind = [c for c in contexts if c.cache.length < len(c.tokens) - 1]
        if not behind:
            return
        device = self.model.device
        parts, tokens, positions = [], [], []
        for context in behind:
            new = context.tokens[context.cache.length:-1]
            n = len(new)
            parts.append(TreeAttention(context.cache, torch.ones(n, n, dtype=torch.bool, device=device).tril_()))
            tokens += new
            positions.append(torch.arange(context.cache.length, context.cache.length + n, device=device))
        self.model(torch.tensor(tokens, device=device), torch.cat(positions), BatchAttention(parts),
                   logits_rows=torch.empty(0, dtype=torch.long, device=device))
        for context, part in zip(behind, parts):
            context.cache.keep(list(range(part.end - part.start)))

    def _tree_log_probs(self, contexts, trees, levels) -> list[torch.Tensor]:
        """One draft forward over every tree so far; the next-token log-probs of each tree's deepest nodes."""
        device = self.model.device
        parts, tokens, positions, rows, offset = [], [], [], [], 0
        for context, (tree_tokens, parents, _), level in zip(contexts, trees, levels):
            tree = DraftTree(tree_tokens, parents)
            parts.append(TreeAttention(context.cache, tree.ancestor_mask(device)))
            tokens += tree_tokens
            positions.append(torch.tensor(tree.depths(), device=device) + context.cache.length)
            rows += [offset + node for node in level]
            offset += len(tree_tokens)
        logits, _ = self.model(torch.tensor(tokens, device=device), torch.cat(positions), BatchAttention(parts),
                               logits_rows=torch.tensor(rows, device=device))
        return list(torch.log_softmax(logits.float(), dim=-1).split([len(level) for level in levels]))

    def _grow(self, tree, level: list[int], log_probs: torch.Tensor, budget: int) -> list[int]:
        """Add the best children of the `level` nodes (top_k each, at most `width`, within the budget); returns
        the new deepest level."""
        tokens, parents, scores = tree
        top = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
        candidates = sorted(((scores[node] + value, node, token) for node, values, ids in
                             zip(level, top.values.tolist(), top.indices.tolist())
                             for value, token in zip(values, ids)), key=lambda c: -c[0])
        room = min(self.width, budget + 1 - len(tokens))
        new_level = []
        for score, node, token in candidates[:max(room, 0)]:
            new_level.append(len(tokens))
            tokens.append(token)
            parents.append(node)
            scores.append(score)
        return new_level
