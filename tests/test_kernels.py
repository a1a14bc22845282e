"""Triton kernels against their PyTorch references on odd shapes (under Triton's interpreter without CUDA),
and the references against plain dense attention."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on the CPU

triton = pytest.importorskip("triton")
from treeserve.kernels.references import (  # noqa: E402
    add_rms_norm_reference, kv_move_reference, kv_write_reference, rms_norm_reference, rope_reference,
    silu_mul_reference, tree_attention_reference)
from treeserve.kernels.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from treeserve.kernels.rope import rope  # noqa: E402
from treeserve.kernels.silu_mul import silu_mul  # noqa: E402
from treeserve.kernels.tree_attention import tree_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_tree_mask(size: int, generator: torch.Generator) -> torch.Tensor:
    """A random tree's ancestor-or-self mask (node 0 the root; parents before children)."""
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = int(torch.randint(node, (1,), generator=generator))
        mask[node] |= mask[parent]
    return mask


def make_case(prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size, seed, dtype=torch.float32):
    """Sequences laid out in shuffled pages of a shared cache, plus their queries and tree masks."""
    g = torch.Generator().manual_seed(seed)
    batch, rows = len(prefix_lens), max(tree_sizes)
    lengths = [p + t for p, t in zip(prefix_lens, tree_sizes)]
    pages = [-(-n // block_size) for n in lengths]
    num_blocks = sum(pages) + 3  # spare pages that belong to nobody
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, max(pages), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages):
        tables[b, :count] = order[used:used + count]
        used += count
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, rows, heads, head_dim, generator=g).to(dtype)
    mask = torch.zeros(batch, rows, rows, dtype=torch.bool)
    for b, size in enumerate(tree_sizes):
        mask[b, :size, :size] = random_tree_mask(size, g)
    args = (q, keys, values, tables, torch.tensor(prefix_lens), torch.tensor(tree_sizes), mask)
    return tuple(a.to(DEVICE) for a in args)


def dense_attention(q, keys, values, tables, prefix_lens, tree_sizes, mask):
    """Gather each sequence's keys/values into one contiguous tensor and run SDPA with a full boolean mask."""
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        prefix, size = int(prefix_lens[b]), int(tree_sizes[b])
        positions = torch.arange(prefix + size, device=q.device)
        k = keys[tables[b, positions // block_size].long(), positions % block_size]
        v = values[tables[b, positions // block_size].long(), positions % block_size]
        full = torch.cat((torch.ones(size, prefix, dtype=torch.bool, device=q.device), mask[b, :size, :size]), 1)
        result = torch.nn.functional.scaled_dot_product_attention(
            q[b, :size].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=full,
            enable_gqa=kv_heads != q.shape[2])
        out[b, :size] = result.transpose(0, 1)
    return out


CASES = [  # prefix lengths, tree sizes, heads, kv heads, head dim, page size
    ([0], [1], 2, 1, 16, 16),
    ([5], [3], 4, 2, 16, 4),
    ([37, 0, 64], [17, 1, 9], 6, 2, 24, 16),  # head_dim 24 pads to 32; one prefix ends on a page boundary
    ([100, 3], [33, 2], 3, 3, 64, 32),  # no grouping; a tree larger than one query block
    ([1], [65], 8, 1, 8, 8),
    ([300, 6], [5, 40], 9, 3, 64, 16),  # SmolLM2's grouping (3 query heads per key/value head) over many tiles
]


@pytest.mark.parametrize("prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size", CASES)
def test_reference_equals_dense_attention(prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size):
    case = make_case(prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size, seed=1)
    torch.testing.assert_close(tree_attention_reference(*case), dense_attention(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split keys"])
@pytest.mark.parametrize("prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size", CASES)
def test_kernel_equals_reference(prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size, splits):
    case = make_case(prefix_lens, tree_sizes, heads, kv_heads, head_dim, block_size, seed=2)
    got, want = tree_attention(*case, splits=splits), tree_attention_reference(*case)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for b, size in enumerate(case[5].tolist()):
        assert not got[b, size:].any(), "padding rows write nothing but zeros"


@pytest.mark.parametrize("multiprocessors", [8, 132])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (32, 8), (4, 4), (16, 1), (64, 2)])
def test_warm_up_launches_every_variant_a_prefill_can_meet(monkeypatch, multiprocessors, heads, kv_heads):
    """Whatever the prompts packed into a prefill (1 to 64 of them, up to 8k rows), its launch compiles to a
    variant that `warm_up` launched, so no request waits on the compiler."""
    from treeserve.kernels import tree_attention as module

    monkeypatch.setattr(module, "multiprocessors", lambda device: multiprocessors)
    device = torch.device(DEVICE)
    warmed = set()
    for rows, splits in module.warm_up_variants(heads, kv_heads, device):
        block_t, _, splits = module.launch_shape(1, rows, heads, kv_heads, device, splits)
        warmed.add((block_t, module.padded_splits(splits) if splits > 1 else 0))
    met = {module.compiled_variant(batch, rows, heads, kv_heads, device)
           for batch in (1, 2, 3, 5, 8, 13, 21, 34, 64) for rows in [*range(1, 130), *range(130, 8192, 37)]}
    assert met <= warmed, f"never warmed up: {sorted(met - warmed)}"


def test_the_combine_kernel_takes_warps_by_its_work():
    """About TUNING["combine_values_per_thread"] split partials a thread: on the 8B shape (32 query heads over 8,
    head_dim 128, an H200's 132 multiprocessors) one row's 32 splits take 4 warps, a 65-row tree's 6 splits one;
    and the warps follow the split tile alone, so the variants warm-up compiles cover them."""
    from treeserve.kernels import tree_attention as module

    device = torch.device(DEVICE)
    for rows, want in ((1, 4), (65, 1)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "multiprocessors", lambda device: 132)
            _, _, splits = module.launch_shape(1, rows, 32, 8, device)
        assert module.combine_warps(splits, 4, 128) == want
    for splits in range(2, 33):
        assert module.combine_warps(splits, 4, 128) == module.combine_warps(module.padded_splits(splits), 4, 128)


@pytest.mark.parametrize("attend", [tree_attention, tree_attention_reference], ids=["kernel", "reference"])
def test_causal_mode_equals_an_explicit_lower_triangular_mask(attend):
    """A prefill passes no mask: each new row sees the prefix and the new rows up to itself."""
    case = make_case([0, 21, 3], [40, 9, 1], 4, 2, 16, 8, seed=5)
    tril = torch.ones(40, 40, dtype=torch.bool, device=DEVICE).tril().expand(3, 40, 40).contiguous()
    torch.testing.assert_close(attend(*case[:6], None), dense_attention(*case[:6], tril), atol=1e-4, rtol=1e-4)


def test_kernel_in_bfloat16_stays_within_bfloat16_tolerance():
    case = make_case([40, 7], [16, 5], 4, 2, 32, 16, seed=3, dtype=torch.bfloat16)
    got = tree_attention(*case).float()
    want = tree_attention_reference(*(a.float() if a.is_floating_point() else a for a in case)).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_a_node_sees_only_its_ancestors():
    """Changing a key outside a node's ancestry leaves that node's output unchanged."""
    q, keys, values, tables, prefix_lens, tree_sizes, _ = make_case([6], [3], 2, 1, 16, 4, seed=4)
    chain_of_two = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool, device=DEVICE)  # 2 under 0
    before = tree_attention(q, keys, values, tables, prefix_lens, tree_sizes, chain_of_two)
    position = 6 + 1  # tree node 1, not an ancestor of node 2
    keys[tables[0, position // 4].long(), position % 4] += 5.0
    after = tree_attention(q, keys, values, tables, prefix_lens, tree_sizes, chain_of_two)
    torch.testing.assert_close(after[0, 2], before[0, 2])
    assert not torch.allclose(after[0, 1], before[0, 1])


from treeserve.kernels.kv_write import kv_write  # noqa: E402


@pytest.mark.parametrize("num_blocks, block_size, kv_heads, head_dim, rows", [
    (3, 16, 2, 16, 5), (7, 5, 3, 24, 13), (2, 32, 1, 128, 1), (4, 8, 8, 64, 20),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_equals_reference_and_padding_rows_write_nowhere(num_blocks, block_size, kv_heads, head_dim, rows,
                                                                   dtype):
    g = torch.Generator().manual_seed(rows)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys, values = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    new_keys = torch.randn(rows, kv_heads, head_dim, generator=g).to(dtype)
    new_values = torch.randn(rows, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:rows]
    slots[::3] = -1  # padding rows
    want_keys, want_values = keys.clone(), values.clone()
    kv_write_reference(want_keys, want_values, new_keys, new_values, slots)
    got_keys, got_values = keys.clone().to(DEVICE), values.clone().to(DEVICE)
    kv_write(got_keys, got_values, new_keys.to(DEVICE), new_values.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got_keys.cpu(), want_keys) and torch.equal(got_values.cpu(), want_values)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(want_keys.view(-1, kv_heads, head_dim)[untouched], keys.view(-1, kv_heads, head_dim)[untouched])


from treeserve.kernels import kv_move as kv_move_module  # noqa: E402
from treeserve.kernels.kv_move import kv_move  # noqa: E402


@pytest.mark.parametrize("slabs, slots, row, paths", [
    (4, 32, 48, [[0, 2, 3]]),  # the path's second node moves onto the slot its third is read from
    (6, 64, 192, [[0, 1, 5, 9, 10], [0, 3], [0, 7, 8, 15]]),  # several requests' paths, as moves_together joins them
    (2, 16, 1000, [[0, 4]]),  # a row wider than one block of columns
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_move_equals_reference(slabs, slots, row, paths, dtype):
    """Each request's accepted path (pending rows, ascending) goes to the first slots after its prefix, in one
    launch, as the reference's gather-then-scatter does."""
    g = torch.Generator().manual_seed(row)
    cache = torch.randn(slabs, slots, row, generator=g).to(dtype)
    sources, targets, start = [], [], 0
    for path in paths:  # each request's pending rows begin at its own slot `start`
        sources += [start + p for p in path]
        targets += [start + i for i in range(len(path))]
        start += max(path) + 1
    sources, targets = torch.tensor(sources), torch.tensor(targets)
    want = cache.clone()
    kv_move_reference(want, sources, targets)
    got = cache.clone().to(DEVICE)
    kv_move(got, sources.to(DEVICE), targets.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, cache)  # the case moves something


def test_every_move_count_launches_a_size_compiled_at_warm_up():
    """A round's moves, however many, launch at one of the padded counts `warm_up` compiles (so no compilation
    happens while serving), and the warm-up leaves the cache as it was."""
    sizes = set(kv_move_module.PADDED_MOVES)
    assert all(kv_move_module.padded_moves(moves) in sizes for moves in range(1, kv_move_module.MOVES_PER_LAUNCH + 1))
    cache = torch.randn(2, 16, 48)
    warmed = cache.clone().to(DEVICE)
    kv_move_module.warm_up(warmed)
    assert torch.equal(warmed.cpu(), cache)


# ---------------------------------------------------------------------------- RMSNorm, RoPE and the activation

@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (3, 5, 576), (2, 3, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    weight = torch.rand(shape[-1], generator=g).add(0.5).to(dtype).to(DEVICE)
    want = rms_norm_reference(x, weight, 1e-5)
    got = rms_norm(x, weight, 1e-5)
    assert got.shape == want.shape and got.dtype == want.dtype
    # float32 exactly up to summation order; bfloat16 within two rounding steps (2 ** -7 relative each).
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (3, 5, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x, delta = ((torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE) for _ in range(2))
    weight = torch.rand(shape[-1], generator=g).add(0.5).to(dtype).to(DEVICE)
    want_sum, want = add_rms_norm_reference(x, delta, weight, 1e-5)
    got_sum, got = add_rms_norm(x, delta, weight, 1e-5)
    assert got_sum.shape == got.shape == want.shape and got.dtype == got_sum.dtype == dtype
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got_sum, want_sum)  # one rounding of an exact float32 sum: the same bits
    else:  # the interpreter's bfloat16 rounding breaks ties away from even: at most one unit in the last place
        torch.testing.assert_close(got_sum.float(), want_sum.float(), atol=0, rtol=2 ** -7)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("shape", [(1, 2 * 16), (7, 2 * 48), (3, 5, 2 * 1536), (2, 2 * 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_reference(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)
    want, got = silu_mul_reference(gate_up), silu_mul(gate_up)
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("n, heads, head_dim", [(1, 1, 16), (5, 9, 64), (17, 3, 24), (2, 32, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_reference(n, heads, head_dim, dtype):
    from treeserve.models.config import ModelConfig
    from treeserve.models.transformer import rope_cos_sin

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    cfg = ModelConfig("llama", 8, 8, 8, 1, heads, heads, head_dim, 1e-5, 10000.0, 64, False)
    cos, sin = rope_cos_sin(cfg.rope_inv_freq().to(DEVICE), torch.randint(64, (n,), generator=g).to(DEVICE), dtype)
    want, got = rope_reference(x, cos, sin), rope(x, cos, sin)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    strided = torch.randn(n, heads, 2 * head_dim, generator=g).to(dtype).to(DEVICE)[:, :, :head_dim]
    torch.testing.assert_close(rope(strided, cos, sin).float(), rope_reference(strided, cos, sin).float(),
                               atol=tolerance, rtol=tolerance)


# ------------------------------------------------------------------------------------------ the DDTree search

# (depth, top_k, keep, batch): lists shorter than the width, one choice a position (the chain kind's), a width of
# 1, the whole tree (keep = every possible node); each with two kinds of values, in float32 and a 16-bit dtype.
DDTREE_SHAPES = [(1, 3, 2, 2), (1, 4, 4, 1), (2, 2, 5, 3), (2, 4, 1, 2), (3, 1, 2, 5), (3, 5, 13, 4), (3, 2, 14, 3),
                 (7, 8, 16, 2), (7, 1, 7, 1)]
DDTREE_VALUES = ("continuous", "ties", "ties and -inf", "repeated rows", "signed zeros")
DDTREE_CASES = [pytest.param(shape, DDTREE_VALUES[(i + j) % len(DDTREE_VALUES)], dtype,
                             id=f"{shape}-{DDTREE_VALUES[(i + j) % len(DDTREE_VALUES)]}-{str(dtype)[6:]}")
                for i, shape in enumerate(DDTREE_SHAPES)
                for j, dtype in enumerate([torch.float32, torch.float16 if i == 2 else torch.bfloat16])]
# The drafter's shapes (block size 16) at two widths and the chain's: seconds under the interpreter.
DDTREE_CASES += [pytest.param((15, 16, 16, 2), "ties and -inf", torch.bfloat16, marks=pytest.mark.slow,
                              id="drafter-ddtree-16"),
                 pytest.param((15, 1, 15, 2), "ties", torch.float32, marks=pytest.mark.slow, id="drafter-chain"),
                 # The width a budget of 64 searches at: each position's top 64 tokens, 960 candidate nodes. One
                 # request: a program sorts every depth whatever its budget, and the cases above cover batches.
                 pytest.param((15, 64, 64, 1), "continuous", torch.bfloat16, marks=pytest.mark.slow,
                              id="drafter-ddtree-64")]


def ddtree_inputs(shape, values, dtype, seed):
    """(log_probs, token_ids, budgets) of a search of `shape` (depth, top_k, keep, batch): the lists sorted
    descending; few distinct values make ties everywhere (-inf scores tie too; so do -0.0 and +0.0); budgets from
    the width down to 0."""
    depth, top_k, keep, batch = shape
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(batch, depth, top_k, generator=g) * 2 - 3
    if values != "continuous":
        log_probs = -torch.randint(0, 3, log_probs.shape, generator=g).float() / 2
    if values == "ties and -inf":
        log_probs[:, :, top_k // 2:] = float("-inf")
    elif values == "repeated rows":  # every request's lists, and every position's, the same
        log_probs[:] = log_probs[:1, :1]
    elif values == "signed zeros":
        log_probs = torch.where(log_probs == 0, torch.where(torch.rand(log_probs.shape, generator=g) < 0.5, 0.0, -0.0),
                                log_probs)
    log_probs = log_probs.sort(dim=-1, descending=True).values.to(dtype)
    token_ids = torch.randint(0, 50_000, log_probs.shape, generator=g)
    budgets = torch.tensor([keep, 0, *torch.randint(0, keep + 1, (batch,), generator=g).tolist()][:batch])
    return log_probs.to(DEVICE), token_ids.to(DEVICE), budgets.to(DEVICE)


@pytest.mark.parametrize("shape, values, dtype", DDTREE_CASES)
def test_ddtree_search_equals_reference(shape, values, dtype):
    """The DDTree search as one launch, a program per request, gives ddtree_select's packed trees and node
    log-probs exactly, ties included, for budgets from 0 to the width."""
    from treeserve.drafter.trees import ddtree_select, ddtree_select_kernel

    log_probs, token_ids, budgets = ddtree_inputs(shape, values, dtype, seed=sum(shape))
    keep = shape[2]
    want = ddtree_select(log_probs, token_ids, budgets, keep)
    got = ddtree_select_kernel(log_probs, token_ids, budgets, keep)
    assert got[1].dtype == want[1].dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_ddtree_search_reaches_each_positions_last_kept_token():
    """A flat first position and unlikely later ones: the best tree of `keep` nodes is the root's first `keep`
    children, the last of them position 1's keep-th token, so a search from lists cut shorter gives another tree."""
    from treeserve.drafter.trees import ddtree_select, ddtree_select_kernel, unpack_trees

    depth, keep = 3, 5
    log_probs = torch.full((1, depth, keep + 2), -8.0)
    log_probs[:, 0] = -1.0
    token_ids = torch.arange(depth * (keep + 2)).view(log_probs.shape)
    log_probs, token_ids, budgets = log_probs.to(DEVICE), token_ids.to(DEVICE), torch.tensor([keep], device=DEVICE)
    packed, _ = ddtree_select_kernel(log_probs, token_ids, budgets, keep)
    assert torch.equal(packed, ddtree_select(log_probs, token_ids, budgets, keep)[0])
    tree, = unpack_trees([99], packed.tolist())
    assert tree.tokens == [99, 0, 1, 2, 3, 4] and tree.parents == [-1, 0, 0, 0, 0, 0]
    cut, _ = ddtree_select_kernel(log_probs[..., :keep - 1], token_ids[..., :keep - 1], budgets, keep)
    assert not torch.equal(cut, packed)


@pytest.mark.parametrize("tree, width, budgets", [
    ("ddtree", 16, [16, 0, 9]), ("ddtree", 32, [32, 17, 1]),
    ("chain", 3, [3, 0, 100])], ids=["ddtree-16", "ddtree-32", "chain"])  # a chain's budget may pass its length
def test_the_dflash_drafters_search_in_one_launch_gives_the_pytorch_searchs_trees(tree, width, budgets):
    """The DFlash drafter's search with kernels (as on a GPU, here under the interpreter) takes each position's top
    `width` tokens into the kernel: the trees of the PyTorch search over the top max_budget tokens, as before (and
    not from fewer: the first request's tree holds its first position's `width`-th token)."""
    from random_targets import random_dflash_drafter, random_target
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.drafter.trees import ddtree_select

    cpu_target = random_target("qwen3", seed=3, vocab_size=96)
    model = random_dflash_drafter(cpu_target, tree, block_size=4).model.to(DEVICE)
    target = cpu_target.to(DEVICE)
    drafter = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, tree, max_batch=4)
    g = torch.Generator().manual_seed(7)
    batch, block = 3, model.config.block_size
    logits = torch.randn(batch, block, 96, generator=g) * 3
    logits[:, 1] /= 300  # a near-flat first position: a tree of `width` nodes there takes its `width`-th token
    log_probs = torch.log_softmax(logits, dim=-1).to(DEVICE)
    drafter.inputs.budgets[:batch] = torch.tensor(budgets)
    top = log_probs[:, 1:].topk(drafter.top_k, dim=-1)  # the lists the search read before it took `width`
    want, _ = ddtree_select(top.values, top.indices, torch.tensor(budgets, device=DEVICE), width)
    drafter.kernels = False
    assert torch.equal(drafter._search(log_probs, width)[0], want)
    drafter.kernels = True
    assert torch.equal(drafter._search(log_probs, width)[0], want)
    assert top.indices[0, 0, min(width, drafter.top_k) - 1] in want[0, 1:1 + budgets[0]]


# ------------------------------------------------------------------------------- a model over the paged cache

@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_model_over_the_paged_cache_equals_the_contiguous_cache(kernels):
    """Three requests of different lengths: a batched causal prefill (packed rows), then two rounds of trees
    (padded rows) with part of each tree kept, give the same logits over the paged cache (blocks of 4, pages
    shared) as through each request's contiguous KVCache, and rejected rows leave no blocks behind."""
    from random_targets import random_target
    from treeserve.models.kv_cache import BatchAttention, KVCache, TreeAttention
    from treeserve.models.paged_kv import PagedAttention, PagedKVCache
    from treeserve.verifier.graphs import TreeVerifier

    model = random_target("qwen2", seed=5, weight_scale=2.0).to(DEVICE)  # GQA, biases
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    paged = PagedKVCache(cfg, num_blocks=24, block_size=4, dtype=torch.float32, device=DEVICE)
    sequences = [paged.sequence() for _ in range(3)]
    caches = [KVCache(cfg, 64, torch.float32, DEVICE) for _ in range(3)]

    def contiguous(tokens, masks, depths):
        positions = [c.length + d for c, d in zip(caches, depths)]
        attention = BatchAttention([TreeAttention(c, m.to(DEVICE)) for c, m in zip(caches, masks)])
        logits, _ = model(torch.cat(tokens).to(DEVICE), torch.cat(positions).to(DEVICE), attention)
        return logits.split([len(t) for t in tokens]), positions

    prompts = [torch.randint(cfg.vocab_size, (n,), generator=g) for n in (5, 11, 1)]
    want, _ = contiguous(prompts, [torch.ones(n, n, dtype=torch.bool).tril() for n in (5, 11, 1)],
                         [torch.arange(len(p)) for p in prompts])
    got, _ = model(torch.cat(prompts).to(DEVICE), torch.cat([torch.arange(len(p)) for p in prompts]).to(DEVICE),
                   PagedAttention.for_prompts(sequences, [len(p) for p in prompts], kernels=kernels))
    torch.testing.assert_close(got, torch.cat(want), atol=1e-4, rtol=1e-4)
    for cache, sequence, prompt in zip(caches, sequences, prompts):
        cache.keep(list(range(len(prompt))))
        sequence.keep(list(range(len(prompt))))
    verifier = TreeVerifier(model, paged, max_batch=3, kernels=kernels)
    for round_ in range(2):
        sizes = [(7, 1, 3), (2, 9, 4)][round_]
        masks = [random_tree_mask(n, g) for n in sizes]
        trees = [torch.randint(cfg.vocab_size, (n,), generator=g) for n in sizes]
        want, positions = contiguous(trees, masks, [m.sum(dim=1) - 1 for m in masks])  # depth = ancestors - 1
        got, _ = verifier.verify(sequences, [t.tolist() for t in trees], positions, masks)
        for got_rows, want_rows in zip(got, want):
            torch.testing.assert_close(got_rows.tensor(), want_rows, atol=1e-4, rtol=1e-4)
        for cache, sequence, mask in zip(caches, sequences, masks):
            path = mask[-1].nonzero().flatten().tolist()  # keep the last node's root-to-node path
            cache.keep(path)
            sequence.keep(path)
    held = sum(len(s.blocks) for s in sequences)
    assert held == sum(-(-s.length // 4) for s in sequences)
    assert paged.allocator.free_count == 24 - held


def test_prefill_warm_up_leaves_the_pool_as_it_was(monkeypatch):
    """The verifier's start-up prefills (which compile the prefill kernels) run through the kernels, and leave
    every block free that was free, and a committed request's keys and values untouched. (Shorter prompts than
    the verifier's own, for the interpreter's sake.)"""
    from random_targets import random_target
    from treeserve.models.paged_kv import PagedAttention, PagedKVCache
    from treeserve.verifier.graphs import TreeVerifier

    model = random_target("llama", seed=3).to(DEVICE)
    paged = PagedKVCache(model.config, num_blocks=80, block_size=4, dtype=torch.float32, device=DEVICE)
    committed = paged.sequence()
    model(torch.arange(6).to(DEVICE), torch.arange(6).to(DEVICE),
          PagedAttention.for_prompts([committed], [6], kernels=True))
    committed.keep(list(range(6)))
    before, free = paged.data.clone(), paged.allocator.free_count
    verifier = TreeVerifier(model, paged, max_batch=2, kernels=True)
    monkeypatch.setattr(TreeVerifier, "WARM_UP_PROMPTS", ((1,), (5,), (17, 3), (400,)))  # 400: beyond the pool
    from treeserve.kernels import tree_attention as module

    # Two of the attention's variants (with and without the combine), not all of them: the interpreter is slow.
    monkeypatch.setattr(module, "warm_up_variants", lambda heads, kv_heads, device: [(3, 1), (9, 3)])
    assert verifier.warm_up_prefill((0,)) > 0
    assert paged.allocator.free_count == free
    slots = committed.slots(0, 6)
    slots = slots.to(DEVICE)  # the pool as (keys/values, layer, slot, head, dim)
    torch.testing.assert_close(paged.data.flatten(2, 3)[:, :, slots], before.flatten(2, 3)[:, :, slots],
                               atol=0, rtol=0)
    assert not torch.equal(paged.data, before)  # it did write (into blocks it freed again)
