"""The n-gram drafter proposes valid trees from earlier occurrences of the context's suffix."""

from treeserve.drafter import NgramDrafter
from treeserve.tree import DraftTree


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path below the root."""
    children = tree.children()
    found, stack = set(), [(0, ())]
    while stack:
        node, path = stack.pop()
        for child in children[node]:
            found.add(path + (tree.tokens[child],))
            stack.append((child, path + (tree.tokens[child],)))
    return found


def assert_valid(tree: DraftTree, context: list[int], budget: int) -> None:
    tree.validate(vocab_size=1000)
    assert tree.tokens[0] == context[-1]
    assert tree.size <= budget + 1
    siblings = [(tree.parents[i], tree.tokens[i]) for i in range(1, tree.size)]
    assert len(siblings) == len(set(siblings)), "shared prefixes must be merged"


def test_continues_the_latest_longest_match():
    context = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    tree = NgramDrafter().tree(context, budget=3)
    assert_valid(tree, context, 3)
    # suffix [1, 2, 3] occurs twice; the latest occurrence continues 4, 5, 6
    assert tree.tokens == [3, 4, 5, 6] and tree.parents == [-1, 0, 1, 2]


def test_different_continuations_become_branches():
    context = [7, 1, 2, 8, 8, 1, 2, 5, 5, 1, 2]
    tree = NgramDrafter().tree(context, budget=8)
    assert_valid(tree, context, 8)
    found = paths(tree)
    assert (5, 5, 1) in found and (8, 8, 1) in found


def test_budget_is_respected_and_tree_is_valid_on_random_contexts():
    import random

    rng = random.Random(0)
    drafter = NgramDrafter()
    for _ in range(200):
        context = [rng.randrange(6) for _ in range(rng.randint(1, 80))]
        budget = rng.randint(1, 64)
        tree = drafter.tree(context, budget)
        assert_valid(tree, context, budget)
        # Every drafted path really followed an earlier occurrence of some suffix token.
        for path in paths(tree):
            occurrences = [i for i in range(len(context) - 1) if context[i] == context[-1]]
            assert any(tuple(context[i + 1:i + 1 + len(path)]) == path for i in occurrences)


def test_no_match_gives_the_root_alone():
    assert NgramDrafter().tree([1, 2, 3, 4], budget=8).size == 1
    assert NgramDrafter().tree([5], budget=8).size == 1


def suffix_matches_in_order(context: list[int], max_ngram: int, min_ngram: int, count: int) -> list[int]:
    """The specification, plainly: for suffix lengths n from the longest down, the positions after each earlier
    occurrence of the last n tokens, most recent first, each position once, at most `count`."""
    found = []
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        for end in range(len(context) - 2, n - 2, -1):
            if context[end - n + 1:end + 1] == context[-n:] and end + 1 not in found:
                found.append(end + 1)
    return found[:count]


def test_continuations_follow_the_longest_then_most_recent_occurrences():
    import random

    rng = random.Random(1)
    for _ in range(3000):
        drafter = NgramDrafter(max_ngram=rng.randint(1, 5), min_ngram=1, max_continuations=rng.randint(1, 20))
        drafter.min_ngram = rng.randint(1, drafter.max_ngram)
        context = [rng.randrange(rng.randint(1, 8)) for _ in range(rng.randint(1, 100))]
        length = rng.randint(1, 20)
        starts = suffix_matches_in_order(context, drafter.max_ngram, drafter.min_ngram, drafter.max_continuations)
        got = drafter.continuations(context, length)
        assert got == [context[start:start + length] for start in starts], (context, drafter.__dict__)
        assert drafter.continuations(context, length, limit=1) == got[:1]  # the merged drafter's lookup


def trie_of(continuations: list[list[int]], root: int, budget: int) -> tuple[list[int], list[int]]:
    """The specification, plainly: each continuation in rank order walks down from the root, a node per token it
    does not find among the children of where it is, until `budget` nodes are drafted."""
    tokens, parents = [root], [-1]
    for continuation in continuations:
        node = 0
        for token in continuation:
            found = [child for child in range(1, len(tokens)) if parents[child] == node and tokens[child] == token]
            if found:
                node = found[0]
                continue
            if len(tokens) > budget:
                return tokens, parents
            tokens.append(token)
            parents.append(node)
            node = len(tokens) - 1
    return tokens, parents


def test_trees_merge_the_ranked_continuations_as_a_trie_on_random_and_repetitive_contexts():
    import random

    rng = random.Random(2)
    drafter = NgramDrafter()
    for _ in range(400):
        if rng.random() < 0.5:
            context = [rng.randrange(rng.randint(1, 10)) for _ in range(rng.randint(1, 150))]
        else:  # a phrase repeated, now and then broken: whole continuations repeat
            phrase = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
            context = [phrase[i % len(phrase)] if rng.random() > 0.05 else rng.randrange(50)
                       for i in range(rng.randint(1, 200))]
        budget = rng.randint(1, 64)
        tree = drafter.tree(context, budget)
        assert (tree.tokens, tree.parents) == trie_of(drafter.continuations(context, budget), context[-1], budget)
