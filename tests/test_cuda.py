"""The engine on a CUDA device (run on the GPU host; skipped where there is none).

float32: greedy speculative output equals plain greedy output exactly, with each request's contiguous KV cache,
with a paged pool read by the Triton kernels, and with trees verified by CUDA-graph replay. bfloat16: a tree
forward and a one-token forward round differently, so outputs may part ways, but only where the target's top two
tokens are within bfloat16 noise of each other: every divergence is checked to be such a near-tie. And a round
from CUDA graphs makes the host wait on the device once.
"""

from __future__ import annotations

import contextlib
import os
import random
import traceback
import warnings

import pytest
import torch

from helpers import assert_equal_or_near_tie
from random_targets import ENGINE_FAMILIES, RandomTreeDrafter, random_target, word_tokenizer
from treeserve.bench.near_ties import NEAR_TIE
from treeserve.models.paged_kv import PagedKVCache
from treeserve.params import GenerationParams
from treeserve.verifier import Generation, generate
from treeserve.verifier.engine import commit_round, forward_batch
from treeserve.verifier.graphs import TreeVerifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 96


def oracle(prompt, reference):
    return lambda context: list(reference[len(context) - len(prompt):])


@pytest.mark.parametrize("case", ENGINE_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["contiguous", "paged", "graphs"])
def test_greedy_speculation_on_cuda(case, dtype, kv):
    model = random_target(case, seed=1, vocab_size=VOCAB, weight_scale=2.0).to("cuda", dtype)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=24)
    verifier = None
    if kv != "contiguous":  # one pool for every request; the graphs captured once, for every budget
        verifier = TreeVerifier(model, PagedKVCache(model.config, 64, 16, dtype, "cuda"), max_batch=1,
                                graphs=kv == "graphs")
        if kv == "graphs":
            verifier.capture()
    rng = random.Random(0)
    for p in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        reference = generate(model, tokenizer, prompt, params).token_ids
        for budget in (1, 4, 16, 32, 64, 128):
            drafter = RandomTreeDrafter(oracle(prompt, reference), VOCAB, seed=budget + p)
            output = generate(model, tokenizer, prompt, params, drafter, budget, verifier=verifier).token_ids
            if verifier is not None:
                assert verifier.pool.allocator.free_count == 64
            if dtype == torch.float32:
                assert output == reference, f"{case} budget {budget}"
            else:
                assert_equal_or_near_tie(model, prompt, reference, output, tolerance=NEAR_TIE)


@contextlib.contextmanager
def synchronising_calls():
    """The Python stacks of the calls that made the host wait on the device while inside (CUDA's sync debug mode
    warns at each; explicit waits on an event are not counted)."""
    stacks: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            stacks.append("".join(traceback.format_stack(limit=7)[:-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield stacks
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_graph_round_waits_on_the_device_once(temperature):
    """Issue 5's rule: no host synchronisation inside a round but the one that brings the picked tokens back.
    Two requests verified together from CUDA graphs (trees staged, replayed, picked, accepted paths' KV moved),
    every round after the first two (buffers made at first use) waits at most once."""
    model = random_target("llama", seed=1, vocab_size=VOCAB, weight_scale=2.0).to("cuda", torch.float32)
    tokenizer = word_tokenizer(VOCAB)
    verifier = TreeVerifier(model, PagedKVCache(model.config, 64, 16, torch.float32, "cuda"), max_batch=2,
                            graphs=True)
    verifier.capture()
    rng = random.Random(0)
    generations = []
    for i in range(2):
        prompt = [rng.randrange(VOCAB) for _ in range(12 + 9 * i)]
        reference = generate(model, tokenizer, prompt, GenerationParams(max_new_tokens=40)).token_ids
        params = GenerationParams(max_new_tokens=40, temperature=temperature, seed=i)
        drafter = RandomTreeDrafter(oracle(prompt, reference), VOCAB, seed=i)
        generations.append(Generation(model, tokenizer, prompt, params, drafter, 16, verifier=verifier))
    waits = []
    for round_number in range(8):
        live = [generation for generation in generations if not generation.finished]
        if not live:
            break
        with synchronising_calls() as stacks:
            plans = [generation.plan(generation.local_draft() if generation.prefilled else None)
                     for generation in live]
            logits, features = forward_batch(model, plans, (), verifier)
            commit_round(live, plans, logits, features)
        if round_number >= 2:
            waits.append(stacks)
    assert len(waits) >= 3, "too few rounds to judge"
    for stacks in waits:  # (the picks' own wait is an event's, which the debug mode does not report)
        assert len(stacks) <= 1, "a round waited on the device at:\n" + "\n".join(stacks)


REAL_GGUF = os.environ.get("TREESERVE_SMOLLM2_GGUF")


@pytest.mark.skipif(not REAL_GGUF, reason="set TREESERVE_SMOLLM2_GGUF to the staged SmolLM2 GGUF")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("drafter_kind", ["ngram", "dflash"])
def test_real_model_with_graphs_on_cuda(dtype, drafter_kind):
    """SmolLM2 with n-gram trees, or the shipped DFlash drafter's DDTree trees, verified from CUDA graphs."""
    from treeserve.drafter import load_drafter, shipped_dflash
    from treeserve.loading import load_target
    from treeserve.verifier.graphs import build_verifier

    target = load_target(REAL_GGUF, device="cuda", dtype=dtype)
    drafter = load_drafter(drafter_kind, str(shipped_dflash("smollm2-135m")), "ddtree", target=target,
                           device="cuda", dtype=dtype)
    verifier = build_verifier(target.model, 1, graphs=True, kv_cache_tokens=4096)
    verifier.capture(drafter.feature_layer_ids)
    params = GenerationParams(max_new_tokens=64)
    for text in ("def fibonacci(n):", "The three primary colors are"):
        prompt = target.tokenizer.encode(text)
        reference = generate(target.model, target.tokenizer, prompt, params).token_ids
        result = generate(target.model, target.tokenizer, prompt, params, drafter, 32, verifier=verifier)
        assert result.mean_accepted > 1.2
        if dtype == "float32":
            assert result.token_ids == reference
        else:
            assert_equal_or_near_tie(target.model, prompt, reference, result.token_ids, tolerance=NEAR_TIE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regeneration_from_a_graph_equals_eager_decoding(dtype):
    # The lockstep decoder that regenerates training data replays one graph a step: the same kernels as eager
    # steps, so the same tokens; in float32 they are also the engine's own greedy output.
    from treeserve.drafter.training.train import LockstepDecoder, VARYING_LENGTH_SDPA
    from torch.nn.attention import sdpa_kernel

    model = random_target("llama", seed=3, vocab_size=VOCAB, weight_scale=2.0).to("cuda", dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(37)]
    tokenizer = word_tokenizer(VOCAB)
    stops = set(tokenizer.eos_ids) | {5}
    with sdpa_kernel(VARYING_LENGTH_SDPA):
        graphed = LockstepDecoder(model, prompts, 40, stops).run()
        eager = LockstepDecoder(model, prompts, 40, stops, graphs=False).run()
    assert graphed == eager
    assert any(len(row) < 40 for row in graphed), "some rows must stop early"
    if dtype == torch.float32:
        for prompt, row in zip(prompts[:5], graphed[:5]):
            alone = generate(model, tokenizer, prompt, GenerationParams(max_new_tokens=40, stop_token_ids=(5,)))
            assert row == alone.token_ids


@pytest.mark.parametrize("tree", ["ddtree", "chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_trees_from_graphs_equal_the_pytorch_search(dtype, tree):
    """On a GPU the DFlash drafter searches its trees in one Triton launch, replayed from a graph per (batch bucket,
    width): from the same block log-probabilities, the packed trees of the PyTorch search, at every width (a
    chain's: each position's top token, one width)."""
    from random_targets import random_dflash_drafter, target_features
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.drafter.trees import ddtree_select

    cpu_target = random_target("qwen3", seed=3, vocab_size=VOCAB, weight_scale=2.0)
    model = random_dflash_drafter(cpu_target, tree, block_size=16).model.to("cuda", dtype)
    target = cpu_target.to("cuda", dtype)
    drafter = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, tree, max_batch=4,
                            graphs=True)
    drafter.capture()
    rng = random.Random(5)
    contexts = []
    for length in (7, 30, 61):
        tokens = [rng.randrange(VOCAB - 1) for _ in range(length)]
        context = drafter.new_context()
        drafter.extend(context, tokens, target_features(target, tokens[:-1], drafter.feature_layer_ids))
        contexts.append(context)
    for budgets in ([16, 3, 1], [32, 32, 0], [64, 5, 64], [128, 100, 7]):
        log_probs = drafter._run_block(contexts, budgets)
        width = drafter.width_for(max(budgets))
        packed = drafter._trees(log_probs, width)[:len(contexts)]
        assert drafter.search_graphs and drafter.runner.last_bucket is not None  # replayed from graphs
        top = log_probs[:len(contexts), 1:].topk(min(width, drafter.top_k), dim=-1)
        want, _ = ddtree_select(top.values, top.indices, torch.tensor(budgets, device="cuda"), width)
        assert torch.equal(packed, want), width


def test_kv_moves_of_any_count_compile_nothing_after_warm_up():
    """The pool stages a move's targets right after its sources, so an odd count leaves the targets off 16 bytes:
    after `warm_up_moves`, moves of every such count reuse the kernels it compiled (a compilation while serving
    stops every request), and move what the reference moves."""
    from treeserve.kernels import kv_move as kv_move_module
    from treeserve.kernels.references import kv_move_reference

    cfg = random_target("qwen3", seed=1, vocab_size=VOCAB).config
    cache = PagedKVCache(cfg, num_blocks=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    cache.data.copy_(torch.randn(cache.data.shape))
    def compiled() -> int:  # the kernel's compiled variants (Triton's cache per device)
        return sum(len(caches[0]) for caches in kv_move_module._kv_move_kernel.device_caches.values())

    cache.warm_up_moves()
    warmed = compiled()
    assert warmed >= len(kv_move_module.PADDED_MOVES)
    rng = random.Random(2)
    for count in (1, 3, 5, 17, 33, 101, 515):
        slots = rng.sample(range(128 * 16), 2 * count)
        want = cache.slabs.cpu()
        kv_move_reference(want, torch.tensor(slots[:count]), torch.tensor(slots[count:]))
        cache.move(slots[:count], slots[count:])
        assert torch.equal(cache.slabs.cpu(), want), count
    assert compiled() == warmed, f"{compiled() - warmed} variants compiled after warm-up"


def test_context_rows_reach_the_gpu_through_page_locked_memory_as_they_were():
    """A prompt's context rows, written eagerly by a DFlash drafter, reach the GPU in one copy from page-locked
    memory (slots, positions, features in parts, cast to the drafter's dtype), equal to copying each as it is."""
    import numpy as np

    from treeserve.drafter.dflash import rows_to_gpu

    slots, positions = np.arange(300, 340), np.arange(40) + 5
    parts = [torch.randn(25, 24), torch.randn(15, 24)]
    for dtype in (torch.float32, torch.bfloat16):
        got = rows_to_gpu(slots, positions, parts, dtype, torch.device("cuda"))
        torch.cuda.synchronize()
        assert all(tensor.is_cuda for tensor in got)
        assert got[0].tolist() == slots.tolist() and got[1].tolist() == positions.tolist()
        assert torch.equal(got[2].cpu(), torch.cat(parts).to(dtype))
