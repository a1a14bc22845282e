"""The merged drafter: prompt lookup's best continuation, then the DFlash tree for the rest of the budget (its
losslessness is tested with the DFlash drafter's, in test_dflash.py)."""

import pytest

from random_targets import random_dflash_drafter, random_target, target_features
from treeserve.drafter.merged import MergedDrafter, merge
from treeserve.tree import DraftTree

VOCAB = 64  # random_dflash_drafter's mask token is VOCAB - 1

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths = [()]
    for node in range(1, tree.size):
        paths.append(paths[tree.parents[node]] + (tree.tokens[node],))
    return paths[1:]


def test_merge_puts_the_chain_first_and_shares_its_prefix_with_the_tree():
    # The tree's first branch repeats the chain's first two tokens: its nodes become the chain's, and the
    # tree's deeper node hangs from the chain.
    tree = DraftTree([9, 1, 2, 5, 7], [-1, 0, 1, 2, 0])  # 9 -> 1 -> 2 -> 5, 9 -> 7
    merged = merge(9, [1, 2, 3], tree)
    merged.validate(VOCAB)
    assert merged.tokens[:4] == [9, 1, 2, 3] and merged.parents[:4] == [-1, 0, 1, 2]
    assert set(token_paths(merged)) == {(1,), (1, 2), (1, 2, 3), (1, 2, 5), (7,)}
    assert merge(9, [], tree) == tree  # no continuation: the tree as it is


def test_merge_is_the_trie_of_the_chain_and_the_tree():
    """On random trees of few tokens (so that they often repeat the chain) and chains of every length: the
    merged tree's paths are the chain's prefixes and the tree's paths, each once, the chain first, parents
    before children, and the tree's nodes in its order after the chain."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        size = rng.randint(1, 30)
        parents = [-1] + [rng.randrange(node) for node in range(1, size)]
        tokens = [9]
        for node in range(1, size):  # distinct tokens among siblings, as DDTree's
            taken = {tokens[c] for c in range(1, node) if parents[c] == parents[node]}
            tokens.append(rng.choice([t for t in range(4) if t not in taken] or [10 + node]))
        tree = DraftTree(tokens, parents)
        chain = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        merged = merge(9, chain, tree)
        merged.validate(VOCAB + 100)
        paths = token_paths(merged)
        assert len(paths) == len(set(paths))
        expected = [tuple(chain[:d]) for d in range(1, len(chain) + 1)]
        expected += [path for path in token_paths(tree) if path not in expected]
        assert paths == expected


def test_merged_trees_hold_the_lookup_continuation_and_keep_to_the_budget():
    target = random_target("llama", seed=2, vocab_size=VOCAB, weight_scale=2.0)
    drafter = MergedDrafter(random_dflash_drafter(target, "ddtree"))
    tokens = [4, 5, 6, 7, 8, 9, 4, 5, 6]
    context = drafter.new_context()
    drafter.extend(context, tokens, target_features(target, tokens[:-1], (0, 1)))
    for budget in (1, 2, 5, 8, 16):
        (tree,) = drafter.propose([context], [budget])
        tree.validate(VOCAB)
        assert tree.tokens[0] == context.tokens[-1] and 1 <= tree.size - 1 <= budget
        chain = drafter.lookup_chain(context, budget)
        assert len(chain) <= budget // 2
        if budget >= 2:  # "4 5 6" occurred before, followed by 7 8 9 ...
            assert chain == [7, 8, 9, 4, 5, 6][:budget // 2]
            assert token_paths(tree)[:len(chain)] == [tuple(chain[:i + 1]) for i in range(len(chain))]
    drafter.release(context)
    assert drafter.dflash.pool.allocator.free_count == drafter.dflash.pool.allocator.num_blocks
