"""Speculative sampling draws from exactly the target's distribution: a chi-square test that passes for the
real verifier and fails for a deliberately biased one."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from random_targets import RandomTreeDrafter, random_target, word_tokenizer
from treeserve.params import GenerationParams
from treeserve.sampling import counter_uniforms, pick_tokens, target_probs
from treeserve.verifier import engine, generate
from treeserve.verifier.acceptance import walk_tree
from treeserve.bench.near_ties import next_token_logits
from treeserve.verifier.rows import Rows

VOCAB = 6
PROMPT = [1, 2, 3]
SAMPLES = 3000


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test; bins expected below 5 are pooled. p from the Wilson-Hilferty normal approximation."""
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def naive_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, top-k and top-p written out token by token, independent of treeserve.sampling."""
    p = torch.softmax(logits.double() / temperature, dim=-1).numpy()
    order = sorted(range(len(p)), key=lambda t: -p[t])
    allowed = set(order[:top_k] if top_k else order)
    allowed_mass = sum(p[t] for t in allowed)  # top-p works on the distribution that top-k left
    mass, nucleus = 0.0, set()
    for t in order:
        if t in allowed and mass < top_p:
            nucleus.add(t)
            mass += p[t] / allowed_mass
    q = np.array([p[t] if t in nucleus else 0.0 for t in range(len(p))])
    return q / q.sum()


def exact_joint(model, params: GenerationParams, length: int) -> np.ndarray:
    """P(first `length` generated tokens) under the target alone, over all VOCAB**length sequences."""
    joint = np.ones([VOCAB] * length)
    for prefix_len in range(length):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            q = naive_probs(next_token_logits(model, PROMPT + list(prefix)), params.temperature, params.top_k,
                            params.top_p)
            joint[prefix] = joint[prefix] * q.reshape([VOCAB] + [1] * (length - prefix_len - 1))
    return joint


def sampled_joint(model, params: GenerationParams, length: int, budget: int) -> np.ndarray:
    """Counts of the first `length` tokens over SAMPLES speculative generations with random trees."""
    counts = np.zeros([VOCAB] * length)
    tokenizer = word_tokenizer(VOCAB)
    # No oracle: the random trees hold the sampled token sometimes, so rounds accept 0, 1 or 2 tokens.
    drafter = RandomTreeDrafter(lambda context: [], VOCAB, seed=0, oracle_rate=0.0)
    for seed in range(SAMPLES):
        result = generate(model, tokenizer, PROMPT, GenerationParams(
            max_new_tokens=length, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=seed), drafter, budget)
        counts[tuple(result.token_ids)] += 1
    return counts


def biased_walk(tree, choices):
    """A classic bug: when the target's draw matches no child of the root, trust the drafter's first child."""
    kept, emitted = walk_tree(tree, choices)
    root_children = tree.children()[0]
    if len(kept) == 1 and root_children:
        child = root_children[0]
        return [0, child], [tree.tokens[child], choices[child]]
    return kept, emitted


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: thread hand-offs would dominate
    yield random_target("llama", seed=11, vocab_size=VOCAB, weight_scale=1.5)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("params", [
    GenerationParams(temperature=1.0),
    GenerationParams(temperature=0.7, top_k=4, top_p=0.9),
], ids=["t1", "t0.7-topk4-topp0.9"])
def test_speculative_sampling_matches_the_target_distribution(model, params):
    expected = exact_joint(model, params, length=3).ravel() * SAMPLES
    observed = sampled_joint(model, params, length=3, budget=3).ravel()
    assert chi_square_p_value(observed, expected) > 1e-3


def test_the_same_check_fails_on_a_biased_verifier(model, monkeypatch):
    params = GenerationParams(temperature=1.0)
    expected = exact_joint(model, params, length=3).ravel() * SAMPLES
    monkeypatch.setattr(engine, "walk_tree", biased_walk)
    biased = sampled_joint(model, params, length=3, budget=3).ravel()
    assert chi_square_p_value(biased, expected) < 1e-6


def test_the_chi_square_helper_rejects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    observed = np.bincount(rng.choice(3, size=5000, p=p), minlength=3)
    assert chi_square_p_value(observed, p * 5000) > 1e-3
    assert chi_square_p_value(observed, np.array([0.45, 0.35, 0.2]) * 5000) < 1e-6


def test_a_seed_gives_the_same_sample_with_or_without_speculation(model):
    tokenizer = word_tokenizer(VOCAB)
    drafter = RandomTreeDrafter(lambda context: [], VOCAB, seed=3, oracle_rate=0.0)
    for seed in range(20):
        params = GenerationParams(max_new_tokens=12, temperature=0.8, seed=seed)
        plain = generate(model, tokenizer, PROMPT, params)
        speculative = generate(model, tokenizer, PROMPT, params, drafter, 8)
        assert speculative.token_ids == plain.token_ids
        assert speculative.seed == seed


def test_counter_uniforms_are_uniform_and_depend_on_the_seed():
    u = counter_uniforms(7, np.arange(100_000))
    assert 0.0 <= u.min() and u.max() < 1.0
    observed = np.bincount((u * 20).astype(int), minlength=20)
    assert chi_square_p_value(observed, np.full(20, 5000.0)) > 1e-3
    assert not np.array_equal(u[:100], counter_uniforms(8, np.arange(100)))
    assert np.array_equal(u[50:60], counter_uniforms(7, np.arange(50, 60)))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.3, 0, 0.6), (0.9, 5, 0.8)])
def test_target_probs_match_a_naive_implementation(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = GenerationParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = target_probs(logits, params).numpy()
    for row in range(4):
        np.testing.assert_allclose(probs[row], naive_probs(logits[row], temperature, top_k, top_p), atol=1e-12)


def test_a_round_picks_each_request_as_it_would_alone():
    # One round, requests of three sampling settings interleaved (greedy, 0.7, 1.2 with top-k and top-p):
    # picked together by setting, each request's tokens are the ones it gets picked on its own.
    class Request:
        def __init__(self, params, seed, counters):
            self.params, self.seed, self.counters = params, seed, counters

        def pick_counters(self, plan):
            return self.counters

    settings = [GenerationParams(), GenerationParams(temperature=0.7),
                GenerationParams(temperature=1.2, top_k=20, top_p=0.9)]
    generator = torch.Generator().manual_seed(0)
    requests = [Request(settings[i % 3], seed=1000 + i, counters=list(range(i, i + 1 + i % 4))) for i in range(9)]
    logits = [torch.randn(len(r.counters), 50, generator=generator) * 3 for r in requests]
    together = engine.pick_round(requests, [None] * len(requests), [Rows(rows) for rows in logits])
    for request, rows, picked in zip(requests, logits, together):
        alone = pick_tokens(rows, request.params, request.seed, np.asarray(request.counters))
        assert picked.tolist() == alone.tolist()
    assert len({tuple(p.tolist()) for p in together}) > 3  # the draws differ by request
