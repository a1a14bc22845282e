"""Graph replay where other engines' graphs broke once batches grew: verification replayed from CUDA graphs
against eager execution at batches 9 to 64 and one above the largest captured batch bucket (which runs eagerly:
the scheduler never forms such a batch, and a forward handed one must still be right); requests whose trees are
cut near their length limit, at contexts near the model's, in the same forward as full-size trees; mixed tree
sizes in one batch; and SmolLM2 at contexts of several thousand tokens in bfloat16, every divergence from plain
decoding a near-tie.

Each test runs on the GPU (`-m gpu`) at full size and on the CPU, eagerly and small, so that its code runs in CI
too. On the GPU each case asserts which graph bucket replayed it (`PagedRunner.forwards`): a test that fell back
to eager execution unnoticed would compare eager against eager.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import assert_equal_or_near_tie
from random_targets import RandomTreeDrafter, random_target, requests_in, word_tokenizer
from treeserve.bench.near_ties import NEAR_TIE
from treeserve.models.paged_kv import PagedKVCache
from treeserve.params import GenerationParams
from treeserve.verifier import Generation, generate
from treeserve.verifier.engine import commit_round, forward_batch
from treeserve.verifier.graphs import TREE_BUCKETS, TreeVerifier

pytestmark = pytest.mark.usefixtures("one_thread")

ON_A_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=ON_A_GPU)]
VOCAB = 96


def on_devices(*dtypes):
    """(device, dtype) cases: float32 on the CPU; each of `dtypes` on the GPU."""
    return [pytest.param("cpu", torch.float32, id="cpu-float32")] + [
        pytest.param("cuda", dtype, marks=ON_A_GPU, id=f"cuda-{str(dtype).removeprefix('torch.')}") for dtype in dtypes]


def verifier_for(model, blocks: int, max_batch: int, max_tree: int, graphs: bool) -> TreeVerifier:
    pool = PagedKVCache(model.config, num_blocks=blocks, block_size=16, dtype=model.dtype, device=model.device)
    verifier = TreeVerifier(model, pool, max_batch=max_batch, max_tree=max_tree, graphs=graphs)
    if graphs:
        verifier.capture()
    return verifier


def oracle(prompt: list[int], reference: list[int]):
    return lambda context: list(reference[len(context) - len(prompt):])


def assert_close_choices(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Logits within a tolerance scaled to their size, and the same choice at every row whose top two are clearly
    apart (bfloat16 rounds differently in other shapes, so near-ties may swap)."""
    scale = want.float().abs().max().clamp(min=1).item()
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance * scale, rtol=tolerance)
    top2 = want.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance * scale
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


# (batch, largest tree) cases: on the GPU every batch bucket from 16 to 64, plain rounds and every rows bucket among
# them, and one request past the largest batch bucket; on the CPU the same shape of cases below a batch of 8.
SCALE = {"cpu": {"max_batch": 8, "max_tree": 17,
                 "cases": [(3, 1), (3, 17), (5, 5), (8, 9), (8, 17), (9, 17), (9, 1)]},
         "cuda": {"max_batch": 64, "max_tree": 129,
                  "cases": [(9, 1), (12, 129), (16, 2), (17, 3), (31, 5), (33, 9), (48, 17), (57, 33), (64, 65),
                            (64, 129), (65, 129), (65, 1)]}}


@pytest.mark.parametrize("device, dtype", on_devices(torch.float32, torch.bfloat16))
def test_large_batches_verify_as_each_request_alone(device, dtype):
    """Batches of mixed tree sizes (one filling the largest tree's rows bucket) at contexts up to the model's
    limit, verified in one forward (on the GPU replayed from the graph of their bucket; past the largest batch
    bucket eagerly), give each request the logits it gets verified alone, eagerly."""
    scale = SCALE[device]
    model = random_target("llama3", seed=4, weight_scale=2.0).to(device, dtype)
    max_batch, max_tree, max_context = scale["max_batch"], scale["max_tree"], model.config.max_context
    largest = max(batch for batch, _ in scale["cases"])
    blocks = largest * (-(-(max_context + max_tree) // 16)) + 8
    graphs = verifier_for(model, blocks, max_batch, max_tree, graphs=device == "cuda")
    alone = TreeVerifier(model, graphs.pool, max_batch=1, max_tree=max_tree)  # eager, over the same pool
    rng = random.Random(0)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    for seed, (batch, rows) in enumerate(scale["cases"]):
        sizes = [rows] + [rng.randint(1, rows) for _ in range(batch - 1)]
        prefixes = [max_context - rows] + [rng.randint(1, max_context - rows) for _ in range(batch - 1)]
        requests = requests_in(graphs.pool, prefixes, sizes, seed)
        bucket = graphs.runner.bucket(batch, rows) if graphs.use_graphs else None
        if graphs.use_graphs:  # past the largest batch bucket no graph holds the batch: eager, on purpose
            assert (bucket is None) == (batch > max_batch), (batch, bucket)
        before = graphs.runner.forwards.copy()
        got, _ = graphs.verify(*requests)
        got = [part.tensor().clone() for part in got]
        assert dict(graphs.runner.forwards - before) == {bucket: 1}, f"batch {batch} did not run as bucket {bucket}"
        for i, request in enumerate(zip(*requests)):
            want, _ = alone.verify(*([part] for part in request))
            assert_close_choices(got[i], want[0].tensor(), tolerance)
        for sequence in requests[0]:
            sequence.release()
    assert graphs.pool.allocator.free_count == graphs.pool.allocator.num_blocks
    if graphs.use_graphs:  # the batch buckets above 8 all replayed, the largest graph among them
        assert {key[0] for key in graphs.runner.forwards if key is not None} >= {16, 32, 64}
        assert graphs.runner.forwards[(64, 129)] == 1
        assert graphs.runner.forwards[None] == sum(batch > max_batch for batch, _ in scale["cases"])


def decode_together(model, verifier, generations) -> list[list[tuple[int, int, int]]]:
    """Every unfinished generation's prefill or round in one forward, until all have finished. Returns, per
    forward, (budget, nodes drafted, nodes verified) of each tree in it: fewer verified than drafted where the
    tree was cut to what the request may still emit."""
    forwards = []
    while live := [generation for generation in generations if not generation.finished]:
        plans, trees = [], []
        for generation in live:
            drafted = generation.local_draft() if generation.prefilled else None
            plans.append(generation.plan(drafted))
            if drafted is not None:
                trees.append((generation.budget, drafted.size, plans[-1].tree.size))
        logits, features = forward_batch(model, plans, (), verifier)
        commit_round(live, plans, logits, features)
        forwards.append(trees)
    return forwards


BATCHED = {"cpu": {"max_batch": 8, "requests": 7, "budgets": (1, 2, 4, 8, 16)},
           "cuda": {"max_batch": 64, "requests": 40, "budgets": (1, 2, 4, 8, 16, 32, 64, 128)}}


@pytest.mark.parametrize("device, dtype", on_devices(torch.float32, torch.bfloat16))
def test_trees_cut_near_the_limits_beside_full_ones(device, dtype):
    """One batch of requests with every budget, half drafting full-size trees and half trees of random size; a
    third of them with a prompt that leaves room for only their few new tokens, at the model's context limit, so
    that their trees are cut (to what they may still emit) while the others' are not, and they finish at
    different rounds. Their prompts prefill in pieces through the same graphs. Each output is the target's own
    greedy output (in bfloat16 up to near-ties), and every forward replayed a graph."""
    setup = BATCHED[device]
    model = random_target("qwen3", seed=1, vocab_size=VOCAB, weight_scale=2.0).to(device, dtype)
    tokenizer = word_tokenizer(VOCAB)
    max_context = model.config.max_context
    rng = random.Random(3)
    requests = []
    for i in range(setup["requests"]):
        budget = setup["budgets"][i % len(setup["budgets"])]
        if i % 3 == 0:  # near the context limit: a prompt that leaves room for a few tokens only
            max_new = 3 + i % 7
            prompt = [rng.randrange(VOCAB) for _ in range(max_context - max_new)]
        else:
            max_new = 16 + i % 9
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 120))]
        requests.append((prompt, GenerationParams(max_new_tokens=max_new, ignore_eos=True), budget, i % 2 == 0))
    blocks = sum(-(-(len(prompt) + params.max_new_tokens + budget) // 16) + 1
                 for prompt, params, budget, _ in requests) + 8
    verifier = verifier_for(model, blocks, setup["max_batch"], max(setup["budgets"]) + 1, graphs=device == "cuda")
    references = [generate(model, tokenizer, prompt, params).token_ids for prompt, params, _, _ in requests]
    generations = [Generation(model, tokenizer, prompt, params,
                              RandomTreeDrafter(oracle(prompt, reference), VOCAB, seed=i, full=full), budget,
                              verifier=verifier)
                   for i, ((prompt, params, budget, full), reference) in enumerate(zip(requests, references))]
    forwards = decode_together(model, verifier, generations)
    for (prompt, _, budget, _), reference, generation in zip(requests, references, generations):
        if dtype == torch.float32:
            assert generation.output_ids == reference, f"budget {budget}"
        else:
            assert_equal_or_near_tie(model, prompt, reference, generation.output_ids, tolerance=NEAR_TIE)
    # The cases the test is for happened: a cut tree in the same forward as an uncut full-size one, and forwards
    # with trees in several rows buckets.
    cut_beside_full = [trees for trees in forwards
                       if any(verified < drafted for _, drafted, verified in trees)
                       and any(verified == drafted == budget + 1 >= 9 for budget, drafted, verified in trees)]
    assert cut_beside_full, "no forward verified a cut tree beside a full-size one"
    buckets_in_one = max(len({min(b for b in TREE_BUCKETS if b >= verified) for _, _, verified in trees})
                         for trees in forwards)
    assert buckets_in_one >= 4, "no forward mixed trees of several sizes"
    assert max(generation.result().mean_accepted for generation in generations if generation.rounds) > 2
    if verifier.use_graphs:  # prompts in pieces and every round, replayed; the batch in its bucket of 64
        assert verifier.runner.forwards[None] == 0, "a forward ran eagerly"
        assert verifier.runner.forwards[(64, 129)] > 0
    assert verifier.pool.allocator.free_count == verifier.pool.allocator.num_blocks


def long_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of these many tokens, cut from the shipped code prompts run together (each a different stretch)."""
    from treeserve.prompt_sets import WORKLOADS, read_prompts

    text = "\n\n".join(record["prompt"] for record in read_prompts(WORKLOADS["code-wide"]))
    ids = tokenizer.encode(text)
    assert len(ids) >= sum(lengths), "the shipped prompts are too short for these contexts"
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ids[start:start + length] for start, length in zip(starts, lengths)]


# On the GPU: one prompt prefilled in pieces through the graphs (under 8 x 129 tokens) and three of several
# thousand tokens, in one prefill and in every round together; on the CPU (float32, eager) short contexts.
LONG = {"cpu": {"lengths": [300, 700], "max_new": 16, "dtype": "float32"},
        "cuda": {"lengths": [1000, 2500, 4500, 7000], "max_new": 64, "dtype": "bfloat16"}}


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_at_long_contexts_diverges_only_at_near_ties(device, request):
    """SmolLM2 decoding requests of long contexts together (bfloat16 on the GPU, its trees verified from CUDA
    graphs), each with trees of another budget that often hold its plain output: every output is plain greedy
    decoding's, or parts from it only where the target's top two tokens are a near-tie; the trees were used."""
    from treeserve.loading import load_target
    from treeserve.verifier.graphs import build_verifier

    setup = LONG[device]
    # On the CPU the session's float32 SmolLM2 (loaded once for every test that uses it).
    target = (request.getfixturevalue("smollm2") if device == "cpu"
              else load_target("smollm2-135m", device=device, dtype=setup["dtype"]))
    model, tokenizer = target.model, target.tokenizer
    prompts = long_prompts(tokenizer, setup["lengths"])
    params = GenerationParams(max_new_tokens=setup["max_new"], ignore_eos=True)
    budgets = [16, 128, 32, 64][:len(prompts)]
    kv_tokens = sum(len(prompt) + params.max_new_tokens + budget + 16 for prompt, budget in zip(prompts, budgets))
    verifier = build_verifier(model, max_batch=len(prompts), graphs=device == "cuda", kv_cache_tokens=kv_tokens)
    if verifier.use_graphs:
        verifier.capture()
    references = [generate(model, tokenizer, prompt, params).token_ids for prompt in prompts]
    generations = [Generation(model, tokenizer, prompt, params,
                              RandomTreeDrafter(oracle(prompt, reference), model.config.vocab_size, seed=i), budget,
                              verifier=verifier)
                   for i, (prompt, reference, budget) in enumerate(zip(prompts, references, budgets))]
    decode_together(model, verifier, generations)
    for prompt, reference, generation in zip(prompts, references, generations):
        assert len(generation.output_ids) == params.max_new_tokens
        assert_equal_or_near_tie(model, prompt, reference, generation.output_ids, tolerance=NEAR_TIE)
        assert generation.drafted_tokens > 0, f"no tree was verified at a context of {len(prompt)} tokens"
    # Trees hold the plain output, which a request that parted from it (at a near-tie) no longer follows: those
    # that did not part must have accepted many of their trees' tokens.
    followed = [generation.result().mean_accepted for generation, reference in zip(generations, references)
                if generation.output_ids == reference]
    assert followed and min(followed) > 1.5, followed
    if verifier.use_graphs:  # every round replayed a graph; only the prompts of thousands of tokens ran eagerly
        rounds = sum(count for key, count in verifier.runner.forwards.items() if key is not None)
        assert rounds >= max(generation.rounds for generation in generations)
        assert verifier.runner.forwards[None] == 0
    assert verifier.pool.allocator.free_count == verifier.pool.allocator.num_blocks
