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
    assert merged.lookup_nodes == 3
    # No continuation: the tree as it is, with a lookup chain of no nodes.
    assert merge(9, [], tree) == DraftTree(tree.tokens, tree.parents, lookup_nodes=0)


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
        assert merged.lookup_nodes == len(chain)
        # Cut at a depth, the chain keeps its first nodes and their places.
        for depth in range(1, 4):
            cut = merged.truncated(depth)
            assert cut.lookup_nodes == min(len(chain), depth) and token_paths(cut)[:cut.lookup_nodes] == [
                tuple(chain[:d]) for d in range(1, cut.lookup_nodes + 1)]


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


def test_lookup_rounds_draft_prompt_lookups_trees_and_keep_the_dflash_context_whole():
    """A round of prompt lookup's trees alone gives the n-gram drafter's tree of the whole budget and needs no
    features: the DFlash context takes the tokens, their rows come later, and the next own tree, once they have
    all come, is the one a drafter fed everything at once proposes. Until they have, it proposes nothing."""
    from treeserve.drafter.ngram import NgramDrafter
    from treeserve.errors import TreeserveError

    target = random_target("llama", seed=2, vocab_size=VOCAB, weight_scale=2.0)
    tokens = [4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 3, 4, 5]
    features = target_features(target, tokens[:-1], (0, 1))
    with_lookup, plain = (MergedDrafter(random_dflash_drafter(target, "ddtree")) for _ in range(2))
    contexts = [drafter.new_context() for drafter in (with_lookup, plain)]
    for drafter, context in zip((with_lookup, plain), contexts):
        drafter.extend(context, tokens[:6], features[:5])
    for end in (9, 12, 14):  # lookup rounds for one of them, tokens alone
        (tree,) = with_lookup.propose_lookup([contexts[0]], [8])
        assert tree == NgramDrafter().tree(contexts[0].tokens, 8) and tree.lookup_nodes is None
        with_lookup.extend(contexts[0], tokens[len(contexts[0].tokens):end])
    assert with_lookup.rows_wanted(contexts[0]) == 8
    with pytest.raises(TreeserveError, match="lacks the feature rows of 8 tokens"):
        with_lookup.propose(contexts[:1], [8])
    with pytest.raises(TreeserveError, match="at most 8"):
        with_lookup.extend(contexts[0], [], features[4:])  # one row too many
    with_lookup.extend(contexts[0], [], features[5:9])  # the rows, in two parts
    with_lookup.extend(contexts[0], [], features[9:])
    plain.extend(contexts[1], tokens[6:], features[5:])
    assert with_lookup.propose(contexts[:1], [8]) == plain.propose(contexts[1:], [8])


def test_the_accepted_path_tells_how_far_the_lookup_chain_alone_would_have_gone():
    """chain_accepted counts the chain's nodes at the head of the accepted path: where the target's choices follow
    the chain for j tokens and then leave it (into a DFlash branch or nowhere), lookup alone would have accepted j."""
    from treeserve.verifier.acceptance import chain_accepted, walk_tree

    tree = DraftTree([9, 1, 2, 5, 7], [-1, 0, 1, 2, 0])  # 9 -> 1 -> 2 -> 5, 9 -> 7
    merged = merge(9, [1, 2, 3], tree)  # 9 -> 1 -> 2 -> 3 (the chain: nodes 1..3), 2 -> 5, 9 -> 7
    cases = {(1, 2, 3, 8): 3, (1, 2, 5, 8): 2, (1, 6): 1, (7, 8): 0, (6,): 0}
    for path, want in cases.items():
        choices = [0] * merged.size
        node = 0
        for token in path:  # the choice at each node on the way is the path's next token
            choices[node] = token
            node = next((c for c in merged.children()[node] if merged.tokens[c] == token), None)
            if node is None:
                break
        kept, emitted = walk_tree(merged, choices)
        assert emitted == list(path[:len(emitted)]) and chain_accepted(kept, merged.lookup_nodes) == want
    assert chain_accepted([0, 1], None) is None
    assert chain_accepted([0, 1, 2], 1) == 1  # a chain of one node
