"""The paged KV cache: blocks come and go with a request's length, and `keep` compacts accepted rows in place
exactly as the contiguous cache does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_targets import tiny_config
from treeserve.errors import TreeserveError
from treeserve.models import KVCache
from treeserve.models.paged_kv import PagedKVCache

CFG = tiny_config("qwen3")  # 2 layers, 2 kv heads, head_dim 16


def fill(cache: PagedKVCache, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write per-row keys (values negated) into every layer at `slots`."""
    flat = cache.data.flatten(2, 3)
    for layer in range(CFG.num_layers):
        flat[0, layer, slots] = values + layer
        flat[1, layer, slots] = -(values + layer)


def read(cache: PagedKVCache, sequence) -> torch.Tensor:
    """Every layer's keys and values of the committed rows, (2, layers, length, kv_heads, head_dim)."""
    return cache.data.flatten(2, 3)[:, :, sequence.slots(0, sequence.length)]


def test_keep_compacts_like_the_contiguous_cache_and_frees_rejected_blocks():
    g = torch.Generator().manual_seed(0)
    paged = PagedKVCache(CFG, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    contiguous = KVCache(CFG, 64, torch.float32, "cpu")
    sequence = paged.sequence()
    for count, kept in [(7, list(range(7))), (9, [0, 2, 5, 8]), (6, [0]), (11, [0, 1, 3, 4, 10])]:
        rows = torch.randn(count, CFG.num_kv_heads, CFG.head_dim, generator=g)
        fill(paged, sequence.reserve(count), rows)
        start = contiguous.length
        for layer in range(CFG.num_layers):
            contiguous.keys[layer, :, start:start + count] = (rows + layer).transpose(0, 1)
            contiguous.values[layer, :, start:start + count] = -(rows + layer).transpose(0, 1)
        sequence.keep(kept)
        contiguous.keep(kept)
        assert sequence.length == contiguous.length
        want = torch.stack((contiguous.keys[:, :, :contiguous.length], contiguous.values[:, :, :contiguous.length]))
        assert torch.equal(read(paged, sequence), want.transpose(2, 3))
        assert len(sequence.blocks) == -(-sequence.length // 4)  # nothing held past the committed rows
        assert paged.allocator.free_count == 16 - len(sequence.blocks)
    sequence.release()
    assert paged.allocator.free_count == 16


def test_slots_follow_the_block_table_within_a_block_and_across_blocks():
    paged = PagedKVCache(CFG, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    sequence = paged.sequence()
    sequence.blocks = [9, 2, 14, 5, 0, 11]  # out of order, as a pool hands them out after some churn
    for start in range(len(sequence.blocks) * 4):
        for count in range(len(sequence.blocks) * 4 - start + 1):
            want = [sequence.blocks[p // 4] * 4 + p % 4 for p in range(start, start + count)]
            assert sequence.slots(start, count).tolist() == want, (start, count)


def test_slot_arrays_are_the_slots_as_numpy():
    paged = PagedKVCache(CFG, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    sequence = paged.sequence()
    sequence.blocks = [9, 2, 14, 5, 0, 11]
    for start in range(len(sequence.blocks) * 4):
        for count in range(len(sequence.blocks) * 4 - start + 1):
            array = sequence.slot_array(start, count)
            assert array.dtype == np.int64 and array.tolist() == sequence.slots(start, count).tolist()


def test_moves_made_together_end_as_moves_made_one_by_one():
    """A round's accepted paths, kept inside `moves_together`, leave every sequence's rows as keeping them one at a
    time does, with one copy; a sequence that finishes in the round (its blocks freed) does not disturb the rest."""
    g = torch.Generator().manual_seed(1)
    pools = [PagedKVCache(CFG, num_blocks=24, block_size=4, dtype=torch.float32, device="cpu") for _ in range(2)]
    kept_rows = [[0, 2, 5], [0, 1, 2, 3], [0, 3, 4, 6, 8], [0, 4]]
    sequences = [[pool.sequence() for _ in kept_rows] for pool in pools]
    for i in range(len(kept_rows)):
        prefix, count = torch.randn(3 + i, CFG.num_kv_heads, CFG.head_dim, generator=g), 9
        rows = torch.randn(count, CFG.num_kv_heads, CFG.head_dim, generator=g)
        for pool, own in zip(pools, sequences):
            fill(pool, own[i].reserve(len(prefix)), prefix)
            own[i].keep(list(range(len(prefix))))
            fill(pool, own[i].reserve(count), rows)
    copies = []  # the rows of each copy pools[1] makes (a move inside moves_together only defers one)
    real_move = pools[1].move
    def counted_move(source, target):
        if pools[1].deferred_moves is None:
            copies.append(len(source))
        real_move(source, target)
    pools[1].move = counted_move
    for kept, sequence in zip(kept_rows, sequences[0]):
        sequence.keep(kept)
    with pools[1].moves_together():
        for kept, sequence in zip(kept_rows, sequences[1]):
            sequence.keep(kept)
        sequences[1][3].release()  # finished this round
    sequences[0][3].release()
    assert copies == [3 + 5 + 2]  # one copy of the kept rows of all that moved (the second kept a prefix)
    with pools[1].moves_together():  # a block handed out before the copy could be written over: refused
        with pytest.raises(TreeserveError, match="moves_together"):
            sequences[1][0].reserve(20)
        with pytest.raises(TreeserveError, match="does not nest"):
            with pools[1].moves_together():
                pass
    for one_by_one, together in zip(sequences[0][:3], sequences[1][:3]):
        assert torch.equal(read(pools[0], one_by_one), read(pools[1], together))


def test_held_moves_wait_for_their_launch_and_come_before_any_reservation_or_move():
    """moves_together(hold=True), as the verifier's scheduler commits a round: the accepted paths' rows stay where
    they are until launch_held_moves, or until the next reservation or move, which launch them first (a block
    freed by the round may be handed out there, or rows reserved over their sources); then every sequence's rows
    are as moves made at once leave them."""
    g = torch.Generator().manual_seed(3)
    kept_rows = [[0, 2, 5], [0, 3, 4, 6, 8], [0, 4]]
    for launch in ("launch", "reserve", "move"):
        pools = [PagedKVCache(CFG, num_blocks=24, block_size=4, dtype=torch.float32, device="cpu") for _ in range(2)]
        sequences = [[pool.sequence() for _ in kept_rows] for pool in pools]
        for i in range(len(kept_rows)):
            prefix, rows = (torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=g) for n in (3 + i, 9))
            for pool, own in zip(pools, sequences):
                fill(pool, own[i].reserve(len(prefix)), prefix)
                own[i].keep(list(range(len(prefix))))
                fill(pool, own[i].reserve(len(rows)), rows)
        for index, pool in enumerate(pools):
            with pool.moves_together(hold=index == 1):
                for kept, sequence in zip(kept_rows, sequences[index]):
                    sequence.keep(kept)
        assert pools[1].held_moves and not pools[0].held_moves
        assert not torch.equal(pools[0].data, pools[1].data)  # nothing moved yet
        if launch == "launch":
            real_launch = pools[1]._launch
            pools[1]._launch = lambda source, target: 1 / 0  # a launch that fails leaves its move held
            with pytest.raises(ZeroDivisionError):
                pools[1].launch_held_moves()
            assert pools[1].held_moves
            pools[1]._launch = real_launch
            pools[1].launch_held_moves()
        elif launch == "reserve":
            for pool, own in zip(pools, sequences):
                own[0].reserve(12)
        else:
            for pool in pools:
                pool.move([0], [1])  # a later move: after the held ones
        assert not pools[1].held_moves
        for at_once, held in zip(sequences[0], sequences[1]):
            assert torch.equal(read(pools[0], at_once), read(pools[1], held)), launch
        assert torch.equal(pools[0].data, pools[1].data), launch


def test_moves_as_tensors_and_as_slot_lists_together_are_the_same_moves():
    """PagedSequence.keep moves slot lists; a move of tensors inside the same moves_together joins them."""
    g = torch.Generator().manual_seed(2)
    pools = [PagedKVCache(CFG, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu") for _ in range(2)]
    for pool in pools:
        pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    pools[1].data.copy_(pools[0].data)
    moves = [(torch.tensor([9, 12]), torch.tensor([1, 2])), ([20, 23, 30], [3, 4, 5]), ([17], [6])]
    for source, target in moves:
        pools[0].move(torch.as_tensor(source), torch.as_tensor(target))
    with pools[1].moves_together():
        for source, target in moves:
            pools[1].move(source, target)
    assert torch.equal(pools[0].data, pools[1].data)


def test_sequences_share_the_pool_and_a_full_pool_is_a_clear_error():
    paged = PagedKVCache(CFG, num_blocks=5, block_size=8, dtype=torch.float32, device="cpu")
    first, second = paged.sequence(), paged.sequence()
    first.reserve(20)  # 3 blocks
    second.reserve(9)  # 2 blocks
    assert set(first.blocks).isdisjoint(second.blocks) and paged.allocator.free_count == 0
    first.keep(list(range(20)))
    with pytest.raises(TreeserveError, match="KV cache full"):
        first.reserve(5)  # a fourth block, and none is free
    second.release()
    assert first.reserve(5).tolist() == first.slots(20, 5).tolist()


def test_reserving_one_row_is_reserve_of_one():
    """reserve_one, the plain step's shortcut, takes the slot reserve(1) would, and a new block at a block's end."""
    paged = PagedKVCache(CFG, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    one, other = paged.sequence(), paged.sequence()
    for _ in range(9):
        slot = one.reserve_one()
        assert slot == one.slots(one.length, 1).item()
        other.reserve(1)
        assert len(one.blocks) == len(other.blocks) == paged.blocks_for(one.length + 1)
        one.keep([0])
        other.keep([0])
    assert one.length == 9 and len(one.blocks) == 3


def test_blocks_that_fit_counts_every_layer_and_both_tensors():
    per_block = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * CFG.head_dim * 2  # bfloat16
    assert PagedKVCache.blocks_that_fit(CFG, 16, torch.bfloat16, per_block * 10, fraction=1.0) == 10
    assert PagedKVCache.blocks_that_fit(CFG, 16, torch.bfloat16, per_block * 10, fraction=0.5) == 5


# ----------------------------------------------------------------------------------- the engine on a paged pool

@pytest.mark.parametrize("case,prefill_pieces", [("llama3", 0), ("qwen3", 0), ("qwen3", 8)])
def test_engine_on_a_paged_pool_is_lossless_and_returns_every_block(case, prefill_pieces):
    """Requests batched into shared forwards over one pool (blocks of 5, so trees straddle pages) give the same
    tokens as plain decoding with contiguous caches, at budgets from 1 to 64; every block is back in the pool
    once they finish. Prompts prefilled in one packed forward, or through the verifier's runner as a GPU
    verifier with graphs prefills them."""
    import random

    from random_targets import RandomTreeDrafter, random_target, word_tokenizer
    from treeserve.params import GenerationParams
    from treeserve.verifier import Generation, generate
    from treeserve.verifier.engine import commit_round, forward_batch
    from treeserve.verifier.graphs import TreeVerifier

    model = random_target(case, seed=3, weight_scale=2.0)
    tokenizer = word_tokenizer(96)
    rng = random.Random(case)
    pool = PagedKVCache(model.config, num_blocks=200, block_size=5, dtype=torch.float32, device="cpu")
    verifier = TreeVerifier(model, pool, max_batch=4)
    verifier.prefill_pieces = prefill_pieces
    requests = []
    for i, budget in enumerate((1, 4, 16, 64)):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 23))]
        params = GenerationParams(max_new_tokens=18)
        reference = generate(model, tokenizer, prompt, params).token_ids
        drafter = RandomTreeDrafter(lambda context, p=prompt, r=reference: r[len(context) - len(p):], 96, seed=i)
        requests.append((Generation(model, tokenizer, prompt, params, drafter, budget, verifier=verifier), reference))
    running = [generation for generation, _ in requests]
    while running:
        plans = [g.plan(g.local_draft() if g.prefilled else None) for g in running]
        commit_round(running, plans, *forward_batch(model, plans, verifier=verifier))
        running = [g for g in running if not g.finished]
    for generation, reference in requests:
        assert generation.result().token_ids == reference
    assert max(g.result().mean_accepted for g, _ in requests) > 2  # multi-token rounds happened
    assert pool.allocator.free_count == 200
