"""DDTree and chain trees from per-position top-K lists, checked against brute-force enumeration."""

import itertools

import pytest
import torch

from treeserve.drafter.trees import ddtree_from_distributions, ddtree_select, ddtree_trees, unpack_trees
from treeserve.errors import TreeserveError
from treeserve.tree import MAX_BUDGET, DraftTree

VOCAB = 50


pytestmark = pytest.mark.usefixtures("one_thread")  # hundreds of tiny tensor ops per tree


def random_top_k(batch, depth, top_k, generator, dtype=torch.float64):
    """Sorted random log-probs (continuous, so ties have probability zero) and distinct tokens per position."""
    log_probs = torch.log(torch.rand(batch, depth, top_k, generator=generator, dtype=dtype))
    log_probs = log_probs.sort(dim=-1, descending=True).values
    token_ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:top_k]
                             for _ in range(batch * depth)]).view(batch, depth, top_k)
    roots = torch.randint(VOCAB, (batch,), generator=generator)
    return roots, log_probs, token_ids


def all_paths(depth, top_k):
    """Every node below the root as its choice path (k_1..k_d), for d = 1..depth."""
    return [path for d in range(1, depth + 1) for path in itertools.product(range(top_k), repeat=d)]


def path_score(log_probs_row, path):
    score = 0.0
    for position, k in enumerate(path):  # left to right, as the search accumulates
        score += log_probs_row[position][k]
    return score


def brute_force_top(log_probs_row, budget):
    """The top-`budget` paths by score (the row's scores must be tie-free for the set to be unique)."""
    depth, top_k = len(log_probs_row), len(log_probs_row[0])
    ranked = sorted(all_paths(depth, top_k), key=lambda path: -path_score(log_probs_row, path))
    return ranked[:budget]


def choice_paths(tree: DraftTree, token_ids_row):
    """Each drafted node's path of choice indices, read back through its tokens (distinct per position)."""
    depths, paths = tree.depths(), [()]
    for node in range(1, tree.size):
        position = depths[node] - 1
        assert tree.tokens[node] in token_ids_row[position], "a node's token must come from its position's list"
        paths.append(paths[tree.parents[node]] + (token_ids_row[position].index(tree.tokens[node]),))
    return paths[1:]


def assert_valid(tree: DraftTree, root: int, expected_nodes: int):
    tree.validate(VOCAB)
    assert tree.tokens[0] == root
    assert tree.size == expected_nodes + 1


@pytest.mark.parametrize("depth,top_k", [(1, 1), (1, 3), (3, 1), (2, 2), (3, 3), (4, 2), (4, 3)])
def test_ddtree_matches_brute_force(depth, top_k):
    generator = torch.Generator().manual_seed(depth * 10 + top_k)
    possible = len(all_paths(depth, top_k))
    for _ in range(12):
        batch = 6
        roots, log_probs, token_ids = random_top_k(batch, depth, top_k, generator)
        # Different budgets in one call, always including root-only and more than the whole tree.
        budgets = [0, possible, possible + 7] + torch.randint(1, possible + 1, (batch - 3,), generator=generator).tolist()
        trees, node_log_probs = ddtree_trees(roots, log_probs, token_ids, budgets, with_log_probs=True)
        assert len(trees) == batch
        for b, (tree, tree_log_probs, budget) in enumerate(zip(trees, node_log_probs, budgets)):
            lp_row, tok_row = log_probs[b].tolist(), token_ids[b].tolist()
            expected = brute_force_top(lp_row, budget)
            assert_valid(tree, roots[b].item(), len(expected))
            paths = choice_paths(tree, tok_row)
            assert set(paths) == set(expected)
            scores = [path_score(lp_row, path) for path in paths]
            order = [(len(path), -score) for path, score in zip(paths, scores)]
            assert order == sorted(order), "nodes come depth by depth, best first within a depth"
            assert sorted(scores) == sorted(path_score(lp_row, path) for path in expected)
            assert tree_log_probs[0] == 0.0
            assert tree_log_probs[1:] == [lp_row[len(path) - 1][path[-1]] for path in paths]


def test_ddtree_with_ties_selects_a_top_budget_set():
    # Log-probs drawn from three values: ties everywhere; whichever tied nodes are kept, the scores kept must
    # be the top-budget scores and the result a valid tree.
    generator = torch.Generator().manual_seed(7)
    depth, top_k, batch = 4, 3, 8
    possible = len(all_paths(depth, top_k))
    for _ in range(10):
        roots, _, token_ids = random_top_k(batch, depth, top_k, generator)
        log_probs = -torch.randint(0, 3, (batch, depth, top_k), generator=generator).double()
        log_probs = log_probs.sort(dim=-1, descending=True).values
        budgets = torch.randint(0, possible + 2, (batch,), generator=generator)
        trees = ddtree_trees(roots, log_probs, token_ids, budgets)
        for b, tree in enumerate(trees):
            lp_row = log_probs[b].tolist()
            budget = min(int(budgets[b]), possible)
            assert_valid(tree, roots[b].item(), budget)
            kept = sorted((path_score(lp_row, p) for p in choice_paths(tree, token_ids[b].tolist())), reverse=True)
            best = sorted((path_score(lp_row, p) for p in all_paths(depth, top_k)), reverse=True)[:budget]
            assert kept == best


def test_ddtree_tie_rule_prefers_shallow_nodes_then_elder_ones():
    token_ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    roots = torch.tensor([1])
    # Elder and younger sibling tie at depth 1: the elder wins.
    tree = ddtree_trees(roots, torch.tensor([[[-1.0, -1.0], [-0.5, -3.0], [-0.5, -3.0]]]), token_ids, [1])[0]
    assert tree.tokens == [1, 10]
    # The child (0,0) and the sibling (1,) both score -1.5: the shallower sibling wins.
    tree = ddtree_trees(roots, torch.tensor([[[-1.0, -1.5], [-0.5, -3.0], [-0.5, -3.0]]]), token_ids, [2])[0]
    assert (tree.tokens, tree.parents) == ([1, 10, 11], [-1, 0, 0])
    # A parent and its child tie when the child's log-prob is 0: the parent comes first, so the tree is valid.
    tree = ddtree_trees(roots, torch.tensor([[[-1.0, -2.0], [0.0, -5.0], [0.0, -5.0]]]), token_ids, [3])[0]
    assert (tree.tokens, tree.parents) == ([1, 10, 20, 30], [-1, 0, 1, 2])
    # (0,1) and (1,0) both score -1.75 for the last slot: the one under the better parent wins.
    tree = ddtree_trees(roots, torch.tensor([[[-1.0, -1.25], [-0.5, -0.75], [-9.0, -9.0]]]), token_ids, [4])[0]
    assert (tree.tokens, tree.parents) == ([1, 10, 11, 20, 21], [-1, 0, 0, 1, 1])


def test_ddtree_zero_probability_nodes_fill_the_budget_after_the_rest():
    # -inf scores must not be confused with empty frontier slots: they rank last but still count.
    token_ids = torch.tensor([[[10, 11], [20, 21]]])
    log_probs = torch.tensor([[[-0.1, float("-inf")], [float("-inf"), float("-inf")]]])
    trees, node_log_probs = ddtree_trees(torch.tensor([1]), log_probs, token_ids, [6], with_log_probs=True)
    assert_valid(trees[0], 1, 6)
    assert trees[0].tokens[1] == 10 and node_log_probs[0][1] == pytest.approx(-0.1)
    assert all(lp == float("-inf") for lp in node_log_probs[0][2:])


def test_with_one_choice_a_position_the_tree_is_the_argmax_chain_cut_to_the_budget():
    # The DFlash drafter's chain trees are DDTree trees of each position's top token.
    generator = torch.Generator().manual_seed(3)
    roots, log_probs, token_ids = random_top_k(4, 5, 3, generator)
    budgets = [0, 2, 5, 9]
    trees = ddtree_trees(roots, log_probs[:, :, :1], token_ids[:, :, :1], budgets)
    for b, (tree, budget) in enumerate(zip(trees, budgets)):
        length = min(budget, 5)
        assert_valid(tree, roots[b].item(), length)
        assert tree.tokens[1:] == token_ids[b, :length, 0].tolist()
        assert tree.parents == list(range(-1, length))


def test_ddtree_accepts_low_precision_log_probs_and_tensor_budgets():
    generator = torch.Generator().manual_seed(5)
    roots, log_probs, token_ids = random_top_k(3, 4, 3, generator, dtype=torch.float32)
    budgets = torch.tensor([3, 0, 20])
    trees = ddtree_trees(roots, log_probs.bfloat16(), token_ids, budgets)
    for b, tree in enumerate(trees):
        assert_valid(tree, roots[b].item(), int(budgets[b]))


devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices)
def test_ddtree_runs_on_the_inputs_device(device):
    # The search is tensor ops on the inputs' device; every device gives the same trees as a CPU run.
    generator = torch.Generator().manual_seed(11)
    roots, log_probs, token_ids = random_top_k(5, 4, 3, generator, dtype=torch.float32)
    budgets = [0, 1, 8, 16, 200]
    expected = ddtree_trees(roots, log_probs, token_ids, budgets)
    moved = [t.to(device) for t in (roots, log_probs, token_ids)]
    assert ddtree_trees(*moved, torch.tensor(budgets, device=device)) == expected


def test_empty_batch_and_bad_inputs():
    empty = torch.zeros(0, 4, 3)
    assert ddtree_trees(torch.zeros(0, dtype=torch.long), empty, empty.long(), []) == []
    roots, log_probs, token_ids = random_top_k(2, 3, 2, torch.Generator().manual_seed(0))
    with pytest.raises(TreeserveError):
        ddtree_trees(roots, log_probs, token_ids, [1])
    with pytest.raises(TreeserveError):
        ddtree_trees(roots, log_probs, token_ids, [1, -1])
    with pytest.raises(TreeserveError):
        ddtree_trees(roots, log_probs, token_ids[:, :2], [1, 1])


def test_ancestor_masks_follow_the_parents_and_are_shared_by_trees_of_one_shape():
    import random

    rng = random.Random(0)
    for size in (1, 2, 5, 17, 129):
        parents = [-1] + [rng.randrange(i) for i in range(1, size)]
        mask = DraftTree(list(range(size)), parents).ancestor_mask()
        for i in range(size):
            ancestors, node = {i}, i
            while parents[node] >= 0:
                node = parents[node]
                ancestors.add(node)
            assert mask[i].tolist() == [j in ancestors for j in range(size)], (size, i)
        same_shape = DraftTree([7] * size, list(parents)).ancestor_mask()
        assert same_shape is mask  # worked out once per shape
    assert DraftTree([1, 2, 3], [-1, 0, 0]).ancestor_mask()[2].tolist() == [True, False, True]
    assert DraftTree([1, 2, 3], [-1, 0, 1]).ancestor_mask()[2].tolist() == [True, True, True]


def best_first_tree(log_probs_row, budget):
    """DDTree as defined: best-first search over each position's whole sorted distribution. The best node not
    yet taken is always the first child of a taken node or the next younger sibling of one, so a heap of those
    frontier nodes yields the top `budget` paths one by one. Returns each taken node as its token path."""
    import heapq

    order = [sorted(range(len(row)), key=lambda t: -row[t]) for row in log_probs_row]  # tokens by log-prob
    depth, taken = len(order), []
    frontier = [(-log_probs_row[0][order[0][0]], (0,))]  # (-score, choice path)
    while frontier and len(taken) < budget:
        minus_score, path = heapq.heappop(frontier)
        taken.append(tuple(order[position][k] for position, k in enumerate(path)))
        parent_score = -minus_score - log_probs_row[len(path) - 1][order[len(path) - 1][path[-1]]]
        if path[-1] + 1 < len(order[0]):  # the next younger sibling
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(frontier, (-(parent_score + log_probs_row[len(path) - 1][order[len(path) - 1][sibling[-1]]]),
                                      sibling))
        if len(path) < depth:  # the first child
            heapq.heappush(frontier, (minus_score - log_probs_row[len(path)][order[len(path)][0]], path + (0,)))
    return taken


def token_paths(tree: DraftTree):
    paths = [()]
    for node in range(1, tree.size):
        paths.append(paths[tree.parents[node]] + (tree.tokens[node],))
    return paths[1:]


@pytest.mark.parametrize("sharpness", [0.3, 1.0, 3.0])
def test_ddtree_from_whole_distributions_is_the_best_tree_at_every_budget(sharpness):
    # Flat distributions (low sharpness) put more than 8 of one position's tokens into the best tree at budgets
    # above 8: a top-8 cut per position fails here.
    generator = torch.Generator().manual_seed(int(sharpness * 10))
    batch, depth, vocab = 4, 5, 160
    logits = torch.randn(batch, depth, vocab, generator=generator, dtype=torch.float64) * sharpness
    log_probs = torch.log_softmax(logits, dim=-1)
    roots = torch.randint(vocab, (batch,), generator=generator)
    widest = 0
    for budget in range(1, MAX_BUDGET + 1):
        budgets = [budget, max(budget - 5, 0), budget, min(budget + 3, MAX_BUDGET)]
        trees = ddtree_from_distributions(roots, log_probs, budgets)
        for b, (tree, tree_budget) in enumerate(zip(trees, budgets)):
            tree.validate(vocab)
            assert tree.tokens[0] == roots[b].item() and tree.size == tree_budget + 1
            expected = best_first_tree(log_probs[b].tolist(), tree_budget)
            assert set(token_paths(tree)) == set(expected), (budget, b)
            widest = max(widest, sum(1 for parent in tree.parents if parent == 0))
    if sharpness < 3:
        assert widest > 8, "the distributions must be flat enough to need more than 8 tokens at one position"


def test_ddtree_over_wide_top_k_lists_is_the_best_tree():
    # 40 choices a position and budgets up to 128: the search expands only the (parent, choice) pairs that can
    # rank among the best, and must still find the best tree. Rows are sorted, so a token path is a choice path.
    generator = torch.Generator().manual_seed(13)
    roots, log_probs, token_ids = random_top_k(3, 6, 40, generator)
    for budget in (9, 33, 64, 128):
        budgets = [budget, budget // 2, budget - 1]
        for b, tree in enumerate(ddtree_trees(roots, log_probs, token_ids, budgets)):
            expected = best_first_tree(log_probs[b].tolist(), budgets[b])
            assert set(choice_paths(tree, token_ids[b].tolist())) == set(expected), (budget, b)


@pytest.mark.parametrize("values", ["continuous", "ties", "float32 ties and -inf"])
def test_a_search_at_any_width_from_the_largest_budget_gives_the_widest_searchs_trees(values):
    """The DFlash drafter searches each round at the narrowest of its widths that holds the round's largest
    budget, from each position's top w tokens: every width w >= the budgets gives the widest's trees and node
    log-probs exactly, ties included (few distinct values make them everywhere, and -inf scores tie too)."""
    generator = torch.Generator().manual_seed(len(values))
    batch, depth, top_k, widest = 6, 5, 24, 48
    for _ in range(4):
        roots, log_probs, token_ids = random_top_k(batch, depth, top_k, generator)
        if values != "continuous":
            log_probs = -torch.randint(0, 4, log_probs.shape, generator=generator).double() / 4
        if values == "float32 ties and -inf":
            log_probs[:, :, top_k // 2:] = float("-inf")
            log_probs = log_probs.float()
        log_probs = log_probs.sort(dim=-1, descending=True).values
        for width in (1, 2, 7, 16, 31, 32, widest):
            budgets = torch.randint(0, width + 1, (batch,), generator=generator)
            budgets[0] = width
            want_packed, want_log_probs = ddtree_select(log_probs, token_ids, budgets, widest)
            packed, node_log_probs = ddtree_select(log_probs, token_ids, budgets, width)
            assert unpack_trees(roots.tolist(), packed.tolist()) == unpack_trees(roots.tolist(), want_packed.tolist())
            assert torch.equal(node_log_probs, want_log_probs[:, :width])
            # ... also from each position's top `width` tokens alone, as the drafter keeps them for that width.
            short = min(width, top_k)
            cut_packed, cut_log_probs = ddtree_select(log_probs[..., :short], token_ids[..., :short], budgets, width)
            assert torch.equal(cut_packed, packed) and torch.equal(cut_log_probs, node_log_probs)


def old_depths(parents):
    """DraftTree.depths as it was defined: node by node from the parent's."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def old_ancestor_mask(parents):
    """DraftTree.ancestor_mask as it was defined: each row the parent's row, plus the node itself."""
    import numpy as np

    mask = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        mask[i] |= mask[parents[i]]
    return mask


def outcome(function):
    """What a call returns, or the type of what it raises."""
    try:
        return "returns", function()
    except Exception as error:  # noqa: BLE001 (any exception: both definitions must raise the same)
        return "raises", type(error)


@pytest.mark.parametrize("size", [0, 1, 2, 5, 33, 64, 65, 129])
def test_depths_and_masks_match_the_node_by_node_definitions(size):
    """On random trees (parents before children) and on parent lists no drafter may send (a parent after its
    child, itself, negative, out of range), depths (as a list and as an array) and ancestor masks are what the
    node-by-node definitions give, or raise as they raise; masks of more than 64 nodes unpack from more than one
    word."""
    import random

    import numpy as np

    rng = random.Random(size)
    for trial in range(300):
        if trial % 2:
            parents = [-1] + [rng.randrange(i) for i in range(1, size)]
        else:
            parents = [rng.randrange(-size - 2, size + 2) for _ in range(size)]
        tree = DraftTree(list(range(size)), list(parents))
        want = outcome(lambda: old_depths(parents))
        assert outcome(tree.depths) == want, parents
        if want[0] == "returns":
            depths = tree.shape().depth_array()
            assert depths.dtype == np.int64 and depths.tolist() == want[1]
            assert tree.shape().height == max(want[1], default=0)
        want = outcome(lambda: old_ancestor_mask(parents))
        got = outcome(lambda: tree.ancestor_mask().numpy())
        assert got[0] == want[0], parents
        if want[0] == "returns":
            assert got[1].shape == want[1].shape and (got[1] == want[1]).all(), parents
        else:
            assert got[1] is want[1] is IndexError, parents


def test_truncated_trees_keep_depths_and_masks_of_their_own():
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 0, 4])
    assert tree.truncated(5) is tree
    cut = tree.truncated(1)
    assert cut.parents == [-1, 0, 0] and cut.depths() == [0, 1, 1]
    assert cut.ancestor_mask().tolist() == old_ancestor_mask(cut.parents).tolist()


def test_walking_a_tree_follows_the_first_child_that_holds_each_choice():
    """walk_tree against its definition (each node's children listed, the first whose token is the target's
    choice taken), on random trees whose siblings may repeat a token."""
    import random

    from treeserve.verifier.acceptance import walk_tree

    def by_children(tree, choices):
        children = tree.children()
        node, kept, emitted = 0, [0], []
        while True:
            emitted.append(choices[node])
            node = next((child for child in children[node] if tree.tokens[child] == choices[node]), -1)
            if node < 0:
                return kept, emitted
            kept.append(node)

    rng = random.Random(0)
    for _ in range(2000):
        size = rng.randrange(1, 40)
        tree = DraftTree([rng.randrange(4) for _ in range(size)], [-1] + [rng.randrange(i) for i in range(1, size)])
        choices = [rng.randrange(4) for _ in range(size)]
        assert walk_tree(tree, choices) == by_children(tree, choices), (tree, choices)
