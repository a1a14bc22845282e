"""Tree verification in the graphs' fixed layout: padding to a bucket changes nothing (CPU), and on a GPU every
captured bucket replays what eager execution computes, at every budget, with padded requests and contexts near
the maximum length."""

from __future__ import annotations

import random

import pytest
import torch

from random_targets import random_target, requests_in
from treeserve.errors import TreeserveError
from treeserve.models.paged_kv import PagedKVCache
from treeserve.models.graphs import PagedRunner, buckets_up_to, packed_size, padded_rows, stage_trees
from treeserve.tree import DraftTree
from treeserve.verifier.graphs import TREE_BUCKETS, TreeVerifier

pytestmark = pytest.mark.usefixtures("one_thread")


def test_buckets_cover_every_budget_and_end_at_the_maxima():
    assert TREE_BUCKETS == (1, 2, 3, 5, 9, 17, 33, 65, 129)
    assert buckets_up_to(40, TREE_BUCKETS) == [1, 2, 3, 5, 9, 17, 33, 40]
    verifier = TreeVerifier(random_target("llama"), PagedKVCache(random_target("llama").config, 8, 4,
                                                                 torch.float32, "cpu"), max_batch=6, max_tree=17)
    assert {b for b, _ in verifier.runner.buckets} == {1, 2, 4, 6}
    assert {t for _, t in verifier.runner.buckets} == {1, 2, 3, 5, 9, 17}


def test_padding_to_a_bucket_changes_neither_logits_nor_the_cache():
    """Three requests padded to a bucket of 5 requests x 33 rows: the real rows' logits match the unpadded
    forward, padding rows write no slot, and padding requests read nothing."""
    model = random_target("qwen2", seed=2, weight_scale=2.0)
    pool = PagedKVCache(model.config, num_blocks=64, block_size=8, dtype=torch.float32, device="cpu")
    verifier = TreeVerifier(model, pool, max_batch=5, max_tree=33)
    sequences, tokens, positions, masks = requests_in(pool, [3, 40, 17], [9, 1, 30], seed=1)
    with torch.inference_mode():
        exact = stage_trees(sequences, tokens, positions, masks, 3, 30, verifier.runner.table_width)
        padded = stage_trees(sequences, tokens, positions, masks, 5, 33, verifier.runner.table_width)
        before = pool.data.clone()
        verifier.feature_layer_ids = (0, 1)
        want, want_features = verifier._forward(exact)
        after_exact = pool.data.clone()
        pool.data.copy_(before)
        got, got_features = verifier._forward(padded)
    for b, n in enumerate(len(t) for t in tokens):
        torch.testing.assert_close(got.view(5, 33, -1)[b, :n], want.view(3, 30, -1)[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_features.view(5, 33, -1)[b, :n], want_features.view(3, 30, -1)[b, :n],
                                   atol=1e-5, rtol=1e-5)
    written = torch.zeros(pool.data.shape[2] * pool.block_size, dtype=torch.bool)
    for sequence, tree_tokens in zip(sequences, tokens):  # the trees' own rows, and nothing else
        written[sequence.slots(sequence.length, len(tree_tokens))] = True
    flat = lambda data: data.flatten(2, 3)  # noqa: E731
    assert torch.equal(flat(pool.data)[:, :, ~written], flat(before)[:, :, ~written]), "padding wrote a slot"
    torch.testing.assert_close(flat(pool.data)[:, :, written], flat(after_exact)[:, :, written])


def test_staging_into_reused_buffers_equals_staging_anew():
    """A runner stages every forward in the same host buffers: what a larger forward left there must not show
    through a smaller one."""
    model = random_target("llama")
    pool = PagedKVCache(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    buffers = padded_rows(6, 17, 40)
    large = requests_in(pool, [9, 30, 5, 12, 7], [16, 3, 8, 1, 16], seed=3)
    small = requests_in(pool, [2, 22], [4, 2], seed=4)
    stage_trees(*large, 5, 17, 40, into=buffers)
    reused = stage_trees(*small, 2, 5, 40, into=buffers)
    anew = stage_trees(*small, 2, 5, 40)
    for got, want in zip([reused.tokens, reused.positions, *reused.paged.tensors()],
                         [anew.tokens, anew.positions, *anew.paged.tensors()]):
        assert got.shape == want.shape and torch.equal(got, want)
    assert reused.tokens.data_ptr() == buffers.tokens.data_ptr()  # staged in the buffers, not beside them
    with pytest.raises(TreeserveError, match="block-table width"):
        stage_trees(*small, 2, 5, 41, into=buffers)


def test_a_runner_stages_every_forward_as_staging_anew_does():
    """A runner stages forwards in its two sets of reused buffers, through views of them it keeps per set and
    size: whatever ran before in either set, each forward gets what staging in new tensors gives."""
    model = random_target("llama")
    pool = PagedKVCache(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    seen = []

    def forward(rows):
        seen.append([tensor.clone() for tensor in (rows.tokens, rows.positions, *rows.paged.tensors())])
        return (torch.zeros(rows.tokens.shape[0], 1),)

    runner = PagedRunner(pool, forward, max_batch=6, row_buckets=[1, 5, 17], max_length=100)
    large = requests_in(pool, [9, 30, 5, 12, 7], [16, 3, 8, 1, 16], seed=3)
    small = requests_in(pool, [2, 22], [4, 2], seed=4)
    plain = requests_in(pool, [3, 6, 1], [1, 1, 1], seed=5)
    for requests in (large, small, small, plain, large, small, plain, plain, large):
        batch, rows = len(requests[0]), max(map(len, requests[1]))
        runner.run(*requests)
        anew = stage_trees(*requests, batch, rows, runner.table_width)
        for got, want in zip(seen[-1], [anew.tokens, anew.positions, *anew.paged.tensors()]):
            assert got.shape == want.shape and torch.equal(got, want)


def test_a_staging_buffer_is_refilled_without_a_wait_once_its_copies_are_settled():
    """On a GPU a runner waits, before refilling a staging buffer, for the copy out of it queued two forwards back,
    unless its owner has since waited for the device past that copy (StagingEvents.settled): then it refills at
    once. (The events are stand-ins that count the waits.)"""
    model = random_target("llama")
    pool = PagedKVCache(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    runner = PagedRunner(pool, lambda rows: (torch.zeros(rows.tokens.shape[0], 1),), max_batch=2, row_buckets=[4],
                         max_length=40)

    class CountedEvent:
        def __init__(self):
            self.recorded = self.waits = 0

        def record(self, stream=None):
            self.recorded += 1

        def synchronize(self):
            self.waits += 1

    copies = runner.staging_copies
    copies.events = [CountedEvent(), CountedEvent()]

    def forward():
        runner.run(*requests_in(pool, [3, 5], [4, 2], seed=0))

    def waits():
        return sum(event.waits for event in copies.events)

    forward(), forward()
    assert waits() == 0  # each buffer's first use: nothing copied out of it yet
    forward()
    assert waits() == 1  # the first buffer again: its copy may still be under way
    copies.settled()
    forward(), forward()
    assert waits() == 1  # both buffers' copies were settled
    queued = copies.queued
    forward()
    assert waits() == 2  # the first buffer's copy was queued after the settling
    copies.settled(queued)  # up to before the last forward: the second buffer is refilled at once, the first not
    forward()
    assert waits() == 2
    forward()
    assert waits() == 3
    assert sum(event.recorded for event in copies.events) == 8


@pytest.mark.parametrize("sizes", [[33], [5, 9, 17], [1, 17, 1, 5, 33, 2], [129, 1, 40], [1, 1, 3]])
def test_trees_staged_from_their_shapes_get_their_ancestor_masks(sizes):
    """Trees staged with their TreeShapes (the masks unpacked from ancestor bits for all of them at once, rows
    padded to the largest) get the buffers that staging their ancestor-mask tensors one by one gives, beside plain
    steps and trees of more than 64 nodes, into buffers a larger forward used before."""
    model = random_target("llama")
    pool = PagedKVCache(model.config, num_blocks=800, block_size=4, dtype=torch.float32, device="cpu")
    sequences, tokens, positions, _ = requests_in(pool, [3] * len(sizes), sizes, seed=len(sizes))
    rng = random.Random(sum(sizes))
    trees = [DraftTree(t, [-1] + [rng.randrange(i) for i in range(1, len(t))]) for t in tokens]
    masks, shapes = [tree.ancestor_mask() for tree in trees], [tree.shape() for tree in trees]
    buffers = padded_rows(8, 129, 60)
    stage_trees(*requests_in(pool, [5] * 8, [129] * 8, seed=9), 8, 129, 60, into=buffers)  # dirty buffers
    rows = max(sizes)
    want = stage_trees(sequences, tokens, positions, masks, len(sizes) + 1, rows, 60)
    got = stage_trees(sequences, tokens, positions, shapes, len(sizes) + 1, rows, 60, into=buffers)
    for mine, theirs in zip([got.tokens, got.positions, *got.paged.tensors()],
                            [want.tokens, want.positions, *want.paged.tensors()]):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)


ON_A_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
def test_prompts_in_pieces_match_one_packed_prefill(device):
    """Prompts through the runner in pieces of its largest rows bucket (5 here: up to five pieces, prompts of
    unequal length, so later pieces run fewer requests) give the logits, features and cached keys and values that
    one packed causal forward gives; on a GPU, replayed from the runner's CUDA graphs."""
    from treeserve.models.paged_kv import PagedAttention

    model = random_target("qwen3", seed=4, weight_scale=2.0).to(device)
    lengths = [12, 1, 23, 5]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    pools = [PagedKVCache(model.config, num_blocks=40, block_size=4, dtype=torch.float32, device=device)
             for _ in range(2)]
    on_gpu = device == "cuda"
    in_pieces = TreeVerifier(model, pools[0], max_batch=4, max_tree=5, graphs=on_gpu)
    packed = TreeVerifier(model, pools[1], max_batch=4, max_tree=5)
    if on_gpu:
        in_pieces.capture(feature_layer_ids=(0, 1))
    tolerance = 1e-4 if on_gpu else 1e-5
    sequences = [[pool.sequence() for _ in prompts] for pool in pools]
    with torch.inference_mode():
        got_logits, got_features = in_pieces.prefill_in_pieces(sequences[0], prompts, feature_layer_ids=(0, 1))
        attention = PagedAttention.for_prompts(sequences[1], lengths)
        last_rows = torch.tensor(lengths).cumsum(0) - 1
        want_logits, features = packed.prefill(attention, torch.tensor(sum(prompts, [])),
                                               torch.cat([torch.arange(n) for n in lengths]), last_rows, (0, 1))
    want_features = features.split(lengths)
    close = lambda got, want: torch.testing.assert_close(  # noqa: E731
        got, want, atol=tolerance * want.abs().max().clamp(min=1).item(), rtol=tolerance)
    for b, n in enumerate(lengths):
        close(got_logits[b].tensor(), want_logits[b:b + 1])
        assert got_features[b].tensor().shape == (n, 2 * model.config.hidden_size)
        close(got_features[b].tensor(), want_features[b])
    assert all(sequence.length == 0 for sequence in sequences[0])  # every row still pending, for keep to commit
    for pool, pool_sequences in zip(pools, sequences):
        for sequence, n in zip(pool_sequences, lengths):
            sequence.keep(list(range(n)))
    for mine, theirs in zip(*sequences):
        close(pools[0].data.flatten(2, 3)[:, :, mine.slots(0, mine.length)],
              pools[1].data.flatten(2, 3)[:, :, theirs.slots(0, theirs.length)])


def test_replay_refuses_inputs_of_another_size():
    model = random_target("llama")
    pool = PagedKVCache(model.config, 8, 4, torch.float32, "cpu")
    sequences, tokens, positions, masks = requests_in(pool, [2], [3], seed=0)
    staged = stage_trees(sequences, tokens, positions, masks, 1, 3, 4)
    with pytest.raises(TreeserveError, match="graph input of 3 rows"):
        staged.copy_into(padded_rows(1, 4, 4))


def test_inputs_reach_their_bucket_in_one_copy():
    """A forward's inputs are views of one buffer in its (batch, rows) layout: copying its bytes copies every field,
    and a buffer sized for the maxima holds any smaller layout."""
    model = random_target("llama")
    pool = PagedKVCache(model.config, 16, 4, torch.float32, "cpu")
    sequences, tokens, positions, masks = requests_in(pool, [2, 5], [3, 2], seed=0)
    staged = stage_trees(sequences, tokens, positions, masks, 2, 4, 6, into=padded_rows(4, 8, 6))
    assert staged.packed.data_ptr() == staged.tokens.data_ptr() and staged.packed_bytes == packed_size(2, 4, 6)
    target = padded_rows(4, 8, 6).view(2, 4)
    staged.copy_into(target)
    for mine, theirs in zip([staged.tokens, staged.positions, *staged.paged.tensors()],
                            [target.tokens, target.positions, *target.paged.tensors()]):
        assert torch.equal(mine, theirs)
    assert (target.paged.slots >= 0).sum() == 5 and target.paged.new_counts.tolist() == [3, 2]
    # The next forward staged in the same buffer reaches the same target, and another target, whole.
    staged.tokens.add_(7)
    other = padded_rows(2, 4, 6)
    for into in (target, other, target):
        staged.copy_into(into)
        assert torch.equal(into.packed[:staged.packed_bytes], staged.packed[:staged.packed_bytes])
    assert torch.equal(target.tokens, staged.tokens)


def test_graphs_need_a_gpu():
    model = random_target("llama")
    with pytest.raises(TreeserveError, match="CUDA graphs need"):
        TreeVerifier(model, PagedKVCache(model.config, 8, 4, torch.float32, "cpu"), 1, graphs=True)


# ------------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama3", "qwen3"])
def test_graph_replay_equals_eager_in_every_bucket(case, dtype):
    model = random_target(case, seed=4, weight_scale=2.0).to("cuda", dtype)
    max_batch, max_context = 8, model.config.max_context
    pool = PagedKVCache(model.config, num_blocks=max_batch * (max_context + 129) // 16 + 8, block_size=16,
                        dtype=dtype, device="cuda")
    graphs = TreeVerifier(model, pool, max_batch=max_batch, graphs=True)
    graphs.capture(feature_layer_ids=(0, 1))
    eager = TreeVerifier(model, pool, max_batch=max_batch)
    rng = random.Random(0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    batch_buckets = sorted({b for b, _ in graphs.runner.buckets})
    for seed, (batch, rows) in enumerate(graphs.runner.buckets):
        smaller = [b for b in batch_buckets if b < batch]
        real_batch = rng.randint(max(smaller, default=0) + 1, batch)  # the rest of the bucket is padding requests
        sizes = [rows] + [rng.randint(1, rows) for _ in range(real_batch - 1)]  # one tree fills the bucket
        prefixes = [max_context - rows] + [rng.randint(1, max_context - rows) for _ in range(real_batch - 1)]
        requests = requests_in(pool, prefixes, sizes, seed)
        assert graphs.runner.bucket(real_batch, rows) == (batch, rows)
        want, want_features = eager.verify(*requests, feature_layer_ids=(0, 1))
        want, want_features = ([rows.tensor().clone() for rows in part] for part in (want, want_features))
        got, got_features = graphs.verify(*requests, feature_layer_ids=(0, 1))
        got, got_features = ([rows.tensor() for rows in part] for part in (got, got_features))
        for got_rows, want_rows, got_f, want_f in zip(got, want, got_features, want_features):
            # bfloat16 rounds differently in the bucket's padded shapes: tolerances scale with the values.
            scale = want_rows.abs().max().clamp(min=1).item()
            torch.testing.assert_close(got_rows, want_rows, atol=tolerance * scale, rtol=tolerance)
            feature_scale = want_f.float().abs().max().clamp(min=1).item()
            torch.testing.assert_close(got_f.float(), want_f.float(), atol=tolerance * feature_scale, rtol=tolerance)
            # The same choices, unless the top two are within the tolerance of each other (a near-tie).
            top2 = want_rows.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance * scale
            assert torch.equal(got_rows.argmax(-1)[clear], want_rows.argmax(-1)[clear])
        for sequence in requests[0]:
            sequence.release()
    assert dict(graphs.runner.forwards) == dict.fromkeys(graphs.runner.buckets, 1)  # each bucket replayed once
    assert pool.allocator.free_count == pool.allocator.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_write_each_rows_features_at_its_slot():
    """A pool that keeps features gets each row's from the graph's replay, at the row's slot; padding rows write
    only the pool's last row."""
    model = random_target("llama3", seed=4, weight_scale=2.0).to("cuda", torch.bfloat16)
    pool = PagedKVCache(model.config, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cuda")
    verifier = TreeVerifier(model, pool, max_batch=4, max_tree=17, graphs=True)
    verifier.keep_features((0, 1))
    verifier.capture(feature_layer_ids=(0, 1))
    sequences, tokens, positions, masks = requests_in(pool, [30, 7, 100], [17, 3, 9], seed=5)
    _, features = verifier.verify(sequences, tokens, positions, masks, feature_layer_ids=(0, 1))
    assert verifier.runner.last_bucket == (4, 17)
    written = torch.zeros(pool.num_slots + 1, dtype=torch.bool, device="cuda")
    for sequence, tree_tokens, rows in zip(sequences, tokens, features):
        slots = sequence.slots(sequence.length, len(tree_tokens)).cuda()
        torch.testing.assert_close(pool.features[slots], rows.tensor())
        written[slots] = True
    written[-1] = True
    assert not pool.features[~written].any(), "a padding row wrote a slot"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_block_forward_from_graphs_equals_eager(dtype):
    """The DFlash drafter's block forward replayed from its graphs gives eager's log-probabilities and, in
    float32, eager's trees, for every batch bucket (padding requests included), contexts of many lengths and
    budgets from 0 to the largest, then over rounds of short extensions; the pool ends empty."""
    from random_targets import random_dflash_drafter, target_features
    from treeserve.drafter.dflash import DFlashDrafter

    target = random_target("qwen3", seed=6, weight_scale=2.0)
    model = random_dflash_drafter(target, "ddtree", seed=1).model.to("cuda", dtype)
    target = target.to("cuda", dtype)
    eager = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, "ddtree", max_batch=8)
    graphs = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, "ddtree", max_batch=8,
                           graphs=True)
    graphs.capture()
    rng = random.Random(2)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for batch in (1, 2, 3, 5, 8):
        histories = [[rng.randrange(96) for _ in range(rng.randint(2, 300))] for _ in range(batch)]
        contexts = {eager: [], graphs: []}
        for tokens in histories:
            features = target_features(target, tokens[:-1], model.config.target_layer_ids)
            for drafter in (eager, graphs):
                contexts[drafter].append(drafter.new_context())
                drafter.extend(contexts[drafter][-1], tokens, features)
        want = eager.block_log_probs(contexts[eager])[1].clone()
        got = graphs.block_log_probs(contexts[graphs])[1]
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=tolerance)
        budgets = [rng.choice([0, 1, 5, 32, 128]) for _ in range(batch)]
        trees = graphs.propose(contexts[graphs], budgets)
        assert [tree.size - 1 for tree in trees] == budgets
        if dtype == torch.float32:  # in bfloat16 the two forwards round differently, and near-ties may swap
            assert trees == eager.propose(contexts[eager], budgets)
        for _ in range(3):  # rounds of a few accepted tokens: their context rows are written inside the graph
            for index, tokens in enumerate(histories):
                new = [rng.randrange(96) for _ in range(rng.randint(1, 16))]
                features = target_features(target, tokens[-1:] + new[:-1], model.config.target_layer_ids)
                tokens.extend(new)
                for drafter in (eager, graphs):
                    drafter.extend(contexts[drafter][index], new, features)
            want = eager.block_log_probs(contexts[eager])[1].clone()
            got = graphs.block_log_probs(contexts[graphs])[1]
            torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=tolerance)
        for drafter in (eager, graphs):
            for context in contexts[drafter]:
                drafter.release(context)
            assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks


def path_scores(tree, log_probs: torch.Tensor) -> list[float]:
    """Each drafted node's path log-probability (the sum along its path of the block's log-probabilities at each
    depth), sorted: two best trees of one budget that differ only in how tied tokens are ordered have the same."""
    depths, scores = [0], [0.0]
    for token, parent in zip(tree.tokens[1:], tree.parents[1:]):
        depths.append(depths[parent] + 1)
        scores.append(scores[parent] + float(log_probs[depths[-1], token]))
    return sorted(scores[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_search_graphs_equal_eager_at_every_width(dtype):
    """Every (batch bucket, tree width) search graph replays, bit for bit, what the eager search computes from the
    same block log-probabilities (padding requests included), and at every width that holds the budgets the
    trees are the widest's (in bfloat16, up to the order of tied tokens), budgets filled; the pool ends empty."""
    from random_targets import random_dflash_drafter, target_features
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.drafter.trees import unpack_trees

    target = random_target("qwen3", seed=6, weight_scale=2.0)
    model = random_dflash_drafter(target, "ddtree", seed=1).model.to("cuda", dtype)
    target = target.to("cuda", dtype)
    drafter = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, "ddtree", max_batch=8,
                            graphs=True)
    drafter.capture()
    widths, block = drafter.tree_widths, model.config.block_size
    assert widths == [16, 32, 64, 128]
    assert sorted(drafter.search_graphs) == sorted((batch, w) for batch, _ in drafter.runner.graphs for w in widths)
    rng = random.Random(5)
    batch_buckets = sorted({batch for batch, _ in drafter.runner.graphs})
    for bucket in batch_buckets:
        smaller = [b for b in batch_buckets if b < bucket]
        batch = rng.randint(max(smaller, default=0) + 1, bucket)  # the rest of the bucket is padding requests
        contexts = []
        for _ in range(batch):
            tokens = [rng.randrange(96) for _ in range(rng.randint(2, 200))]
            contexts.append(drafter.new_context())
            drafter.extend(contexts[-1], tokens, target_features(target, tokens[:-1], model.config.target_layer_ids))
        roots = [context.tokens[-1] for context in contexts]
        for width in widths:
            budgets = [width] + [rng.randint(0, width) for _ in range(batch - 1)]
            log_probs = drafter._run_block(contexts, budgets)
            assert drafter.runner.last_bucket == (bucket, block)
            got = drafter._trees(log_probs, width).clone()
            assert torch.equal(got, drafter._search(log_probs, width)[0])  # eager, on the same log-probabilities
            trees = unpack_trees(roots, got[:batch].tolist())
            assert [tree.size - 1 for tree in trees] == budgets
            widest = unpack_trees(roots, drafter._trees(log_probs, widths[-1])[:batch].tolist())
            if dtype == torch.float32:
                assert trees == widest, width
            else:  # bfloat16 ties log-probabilities often, and a narrower top-k may order tied tokens otherwise
                for i, (tree, wide) in enumerate(zip(trees, widest)):
                    assert path_scores(tree, log_probs[i]) == pytest.approx(path_scores(wide, log_probs[i])), width
            assert drafter.propose(contexts, budgets) == trees  # a round takes the narrowest width: this one
        for context in contexts:
            drafter.release(context)
    assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks
