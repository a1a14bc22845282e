"""Tiny randomly initialised targets built directly in memory, plus test drafters and random requests in a paged
pool, for engine and graph tests.

(The loader tests build their tiny models through transformers and real files; the engine only needs a model
and a tokenizer, so these skip the files to stay fast.)
"""

from __future__ import annotations

import random

import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from treeserve.models import DecoderLM, KVCache, ModelConfig, RopeScaling, TreeAttention
from treeserve.models.paged_kv import PagedKVCache
from treeserve.tokenizer import Tokenizer
from treeserve.tree import DraftTree, TokenContext, TokenDrafter

ENGINE_FAMILIES = ("llama", "llama3", "qwen2", "qwen3")


def tiny_config(case: str, vocab_size: int = 96) -> ModelConfig:
    family = "llama" if case == "llama3" else case
    return ModelConfig(
        family=family, vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16 if case == "qwen3" else 12, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_context=512, tie_word_embeddings=case in ("llama3", "qwen2"),
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64) if case == "llama3" else None)


def word_tokenizer(vocab_size: int, eos_id: int | None = None) -> Tokenizer:
    """Token i is the word "w<i>": text and ids map one to one, so stop strings are easy to aim."""
    backend = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, frozenset() if eos_id is None else frozenset({eos_id}))


def random_target(case: str, seed: int = 0, vocab_size: int = 96, weight_scale: float = 1.0,
                  dtype: torch.dtype = torch.float32) -> DecoderLM:
    """weight_scale > 1 sharpens the next-token distributions (a random model is otherwise nearly uniform)."""
    torch.manual_seed(seed)
    model = DecoderLM(tiny_config(case, vocab_size))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            else:
                param.mul_(weight_scale)
    return model.to(dtype).eval().requires_grad_(False)


class RandomTreeDrafter(TokenDrafter):
    """Random trees (random shape, random tokens) with the true continuation hidden along one branch with
    probability `oracle_rate`; `continuation(context)` supplies the target's own next tokens. Trees have a random
    number of nodes up to the budget, or (`full`) always the whole budget."""

    name = "random-tree"

    def __init__(self, continuation, vocab_size: int, seed: int = 0, oracle_rate: float = 0.8, full: bool = False):
        self.continuation, self.vocab_size = continuation, vocab_size
        self.rng = random.Random(seed)
        self.oracle_rate, self.full = oracle_rate, full

    def tree(self, context: TokenContext, budget: int) -> DraftTree:
        rng = self.rng
        size = budget if self.full else rng.randint(1, budget)
        tokens, parents = [context.tokens[-1]], [-1]
        if rng.random() < self.oracle_rate:
            truth = self.continuation(context.tokens)[:rng.randint(0, size)]
            if truth and rng.random() < 0.3:  # a wrong token where the path would continue
                truth[-1] = (truth[-1] + 1) % self.vocab_size
            for token in truth:
                tokens.append(token)
                parents.append(len(tokens) - 2)
        while len(tokens) <= size:
            tokens.append(rng.randrange(self.vocab_size))
            parents.append(rng.randrange(len(tokens) - 1))
        # Shuffle node order while keeping parents before children, so the oracle path is not always 0,1,2..
        order = [0] + sorted(range(1, len(tokens)), key=lambda i: (self._depth(parents, i), rng.random()))
        index = {old: new for new, old in enumerate(order)}
        return DraftTree([tokens[i] for i in order], [index[parents[i]] if i else -1 for i in order])

    @staticmethod
    def _depth(parents: list[int], i: int) -> int:
        depth = 0
        while parents[i] >= 0:
            i, depth = parents[i], depth + 1
        return depth


def random_tree(size: int, rng: random.Random, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return DraftTree([rng.randrange(vocab) for _ in range(size)], parents)


def requests_in(pool: PagedKVCache, prefix_lens: list[int], tree_sizes: list[int], seed: int):
    """Sequences with committed prefixes of random keys/values, and a random tree for each: (sequences, tokens,
    positions, masks), as TreeVerifier.verify takes them."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    sequences, trees = [], []
    for prefix, size in zip(prefix_lens, tree_sizes):
        sequence = pool.sequence()
        slots = sequence.reserve(prefix).to(pool.data.device)
        flat = pool.data.flatten(2, 3)
        flat[:, :, slots] = torch.randn(flat[:, :, slots].shape, generator=g).to(flat)
        sequence.keep(list(range(prefix)))
        sequences.append(sequence)
        trees.append(random_tree(size, rng, vocab=96))
    tokens = [tree.tokens for tree in trees]
    positions = [torch.tensor(tree.depths()) + s.length for tree, s in zip(trees, sequences)]
    return sequences, tokens, positions, [tree.ancestor_mask() for tree in trees]


def random_dflash_drafter(target: DecoderLM, tree: str, seed: int = 0, block_size: int = 6):
    """An untrained DFlash drafter for `target`: one layer, random weights, reading target layers 0 and 1."""
    from treeserve.drafter.dflash import DFlashConfig, DFlashDrafter, DFlashModel

    cfg = target.config
    layers = ModelConfig(family="qwen3", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_context=cfg.max_context,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    config = DFlashConfig(layers, block_size, (0, 1), cfg.vocab_size - 1, cfg.num_layers)
    model = DFlashModel(config).eval().requires_grad_(False)
    return DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, tree)


def target_features(target, tokens: list[int], layer_ids) -> torch.Tensor:
    """The target's hidden states after `layer_ids` for `tokens`, from one causal forward from scratch."""
    n, device = len(tokens), target.device
    cache = KVCache(target.config, n, target.dtype, device)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    _, hidden = target(torch.tensor(tokens, device=device), torch.arange(n, device=device), TreeAttention(cache, mask),
                       hidden_layer_ids=layer_ids)
    return torch.cat(hidden, dim=-1)
