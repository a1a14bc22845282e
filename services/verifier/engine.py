"""Speculative generation for one request: prefill, then rounds of draft -> verify the tree -> commit.

Invariant between rounds: the KV cache holds every committed token except the last one, which is the root of
the next tree. A round scores root + drafted nodes in one target forward, keeps the KV of the accepted path and
emits the accepted tokens plus the target's bonus token. With no drafter the tree is the root alone, which is
plain autoregressive decoding through the same code.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, KVCache, TreeAttention
from treeserve.sampling import GenerationParams, choose_tokens, random_seed
from treeserve.tokenizer import Tokenizer
from treeserve.tree import MAX_BUDGET, DraftTree, Drafter
from treeserve.verifier.acceptance import walk_tree


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only, a stop token included
    text: str  # detokenized, without a stop token or stop string
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_tokens: int
    rounds: int  # target forwards after prefill
    round_tokens: int  # tokens emitted by those rounds (the prefill emits the first token)
    seed: int
    prefill_s: float
    elapsed_s: float

    @property
    def mean_accepted(self) -> float:
        """Tokens per round, bonus included: 1.0 is plain decoding."""
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Generation:
    """One request's state. Call `step()` until `finished`; each call returns the tokens it committed."""

    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams,
                 drafter: Drafter | None = None, budget: int = 0):
        params.validate()
        cfg = model.config
        if not prompt_ids:
            raise TreeserveError("the prompt is empty")
        if not all(0 <= t < cfg.vocab_size for t in prompt_ids):
            raise TreeserveError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if drafter is not None and not 1 <= budget <= MAX_BUDGET:
            raise TreeserveError(f"budget must be between 1 and {MAX_BUDGET}, got {budget}")
        if len(prompt_ids) + params.max_new_tokens > cfg.max_context:
            raise TreeserveError(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                                 f"exceeds the model's context of {cfg.max_context} tokens")
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.drafter, self.budget = drafter, budget if drafter is not None else 0
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.seed = params.seed if params.seed is not None else random_seed()
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
        # Committed tokens never exceed prompt + max_new - 1 cached, plus one tree of budget + 1 nodes.
        self.cache = KVCache(cfg, len(prompt_ids) + params.max_new_tokens + self.budget, model.dtype, model.device)
        self.finish_reason: str | None = None
        self.stop_text_end: int | None = None  # where a matched stop string starts in the decoded text
        self.rounds = self.round_tokens = 0
        self.started = time.perf_counter()
        self.prefill_s = self.elapsed_s = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> list[int]:
        if self.finished:
            return []
        if not self.output_ids:
            return self._prefill()
        return self._round()

    @torch.inference_mode()
    def _prefill(self) -> list[int]:
        n = len(self.prompt_ids)
        device = self.model.device
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        logits, _ = self.model(torch.tensor(self.prompt_ids, device=device), torch.arange(n, device=device),
                               TreeAttention(self.cache, causal), logits_rows=torch.tensor([n - 1], device=device))
        self.cache.keep(list(range(n)))
        first = choose_tokens(logits, self.params, self.seed, [0])
        self.prefill_s = time.perf_counter() - self.started
        return self._commit(first)

    @torch.inference_mode()
    def _round(self) -> list[int]:
        tree = self._draft()
        depths = tree.depths()
        device = self.model.device
        positions = torch.tensor(depths, device=device) + self.cache.length
        logits, _ = self.model(torch.tensor(tree.tokens, device=device), positions,
                               TreeAttention(self.cache, tree.ancestor_mask(device)))
        done = len(self.output_ids)
        choices = choose_tokens(logits, self.params, self.seed, [done + d for d in depths])
        kept, emitted = walk_tree(tree, choices)
        self.cache.keep(kept)
        committed = self._commit(emitted)
        self.rounds += 1
        self.round_tokens += len(committed)
        return committed

    def _draft(self) -> DraftTree:
        root = self.output_ids[-1]
        if self.drafter is None:
            return DraftTree([root], [-1])
        tree = self.drafter.propose(self.prompt_ids + self.output_ids, self.budget)
        tree.validate(self.model.config.vocab_size)
        if tree.tokens[0] != root or tree.size > self.budget + 1:
            raise TreeserveError(f"drafter {self.drafter.name} returned a tree that does not fit the request "
                                 f"(root {tree.tokens[0]} vs {root}, {tree.size - 1} nodes for budget {self.budget})")
        # A round emits at most depth + 1 tokens; deeper nodes could never be used.
        return tree.truncated(self.params.max_new_tokens - len(self.output_ids) - 1)

    def _commit(self, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping at a stop token, a stop string or the length limit."""
        committed = []
        for token in tokens:
            self.output_ids.append(token)
            committed.append(token)
            if token in self.stop_ids or self._stop_string_ended():
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
            if self.finished:
                self.elapsed_s = time.perf_counter() - self.started
                break
        return committed

    def _stop_string_ended(self) -> bool:
        if not self.params.stop_strings:
            return False
        text = self.tokenizer.decode(self.output_ids)
        # Only a match that the newest token completed can be new; search a tail long enough to hold one.
        tail_start = max(0, len(self.tokenizer.decode(self.output_ids[:-1])) - max(map(len, self.params.stop_strings)))
        found = [i for s in self.params.stop_strings if (i := text.find(s, tail_start)) >= 0]
        if found:
            self.stop_text_end = min(found)
        return bool(found)

    def text(self) -> str:
        """The output text so far, without a final stop token and cut before a matched stop string."""
        ids = self.output_ids
        if self.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        return text if self.stop_text_end is None else text[:self.stop_text_end]

    def settled_text(self) -> str:
        """The part of text() that later tokens cannot change: while running, the tail that could still
        become a stop string or complete a multi-byte character is held back. For streaming."""
        text = self.text()
        if self.finished:
            return text
        if self.params.stop_strings:
            text = text[:max(0, len(text) - max(map(len, self.params.stop_strings)) + 1)]
        return text.rstrip("\ufffd")

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.output_ids), text=self.text(), finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids), rounds=self.rounds, round_tokens=self.round_tokens,
            seed=self.seed, prefill_s=self.prefill_s, elapsed_s=self.elapsed_s)


def generate(model: DecoderLM, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams,
             drafter: Drafter | None = None, budget: int = 0) -> GenerationResult:
    """Run one request to the end. For streaming, drive a `Generation` and read what each `step()` returns."""
    generation = Generation(model, tokenizer, prompt_ids, params, drafter, budget)
    while not generation.finished:
        generation.step()
    return generation.result()
