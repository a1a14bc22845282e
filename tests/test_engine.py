"""Greedy speculative output equals the target's own greedy output, token for token, whatever the tree."""

from __future__ import annotations

import random

import pytest
import torch

from random_targets import ENGINE_FAMILIES, RandomTreeDrafter, random_target, word_tokenizer
from treeserve.detokenize import TextStream
from treeserve.drafter import NgramDrafter
from treeserve.errors import TreeserveError
from treeserve.params import GenerationParams
from treeserve.tree import MAX_BUDGET, DraftTree, TokenDrafter
from treeserve.verifier import Generation, generate

VOCAB = 96
BUDGETS = (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 48, 64)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def oracle(prompt: list[int], reference: list[int]):
    """The target's own next tokens after a context that extends the prompt along the reference output."""
    return lambda context: list(reference[len(context) - len(prompt):])


@pytest.mark.parametrize("case", ENGINE_FAMILIES)
def test_greedy_tree_speculation_equals_autoregressive(case):
    model = random_target(case, seed=1, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=24)
    accepted_per_round = []
    for p, prompt in enumerate(prompts(3, seed=hash(case) % 1000)):
        reference = generate(model, tokenizer, prompt, params).token_ids
        assert len(reference) == 24
        for budget in BUDGETS:
            drafter = RandomTreeDrafter(oracle(prompt, reference), VOCAB, seed=budget * 7 + p)
            result = generate(model, tokenizer, prompt, params, drafter, budget)
            assert result.token_ids == reference, f"{case} prompt {p} budget {budget}"
            accepted_per_round.append(result.mean_accepted)
    # The trees often hold the true continuation, so multi-token rounds must have happened.
    assert max(accepted_per_round) > 3


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_random_trees_without_the_answer_still_give_the_target_output(case):
    model = random_target(case, seed=2, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=20)
    for prompt in prompts(2, seed=5):
        reference = generate(model, tokenizer, prompt, params).token_ids
        for budget in (1, 5, 64, MAX_BUDGET):
            drafter = RandomTreeDrafter(oracle(prompt, reference), VOCAB, seed=budget, oracle_rate=0.0)
            assert generate(model, tokenizer, prompt, params, drafter, budget).token_ids == reference


def test_ngram_drafter_is_lossless_on_repetitive_prompts():
    model = random_target("llama", seed=3, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=48)
    for prompt in prompts(4, seed=9):
        prompt = prompt * 3  # repetition gives prompt lookup something to find
        reference = generate(model, tokenizer, prompt, params).token_ids
        for budget in (1, 4, 16, 64):
            assert generate(model, tokenizer, prompt, params, NgramDrafter(), budget).token_ids == reference


def test_autoregressive_mode_counts_one_token_per_round():
    model = random_target("qwen2", seed=4, vocab_size=VOCAB)
    result = generate(model, word_tokenizer(VOCAB), [1, 2, 3], GenerationParams(max_new_tokens=10))
    assert len(result.token_ids) == 10
    assert result.rounds == 9  # the prefill emits the first token
    assert result.mean_accepted == 1.0
    assert result.finish_reason == "length"


class TestStopsInsideAnAcceptedPath:
    """Stops must cut a round's accepted path at the exact token, as plain decoding would."""

    model = random_target("llama", seed=5, vocab_size=VOCAB, weight_scale=2.0)
    prompt = [5, 6, 7, 8]
    reference = generate(model, word_tokenizer(VOCAB), prompt, GenerationParams(max_new_tokens=40)).token_ids

    def speculative(self, tokenizer, params, budget=32):
        drafter = RandomTreeDrafter(oracle(self.prompt, self.reference), VOCAB, seed=1, oracle_rate=1.0)
        return generate(self.model, tokenizer, self.prompt, params, drafter, budget)

    def first_new_token_after(self, index: int) -> tuple[int, int]:
        """A token of the reference output at or after `index` that does not occur earlier in it."""
        for i in range(index, len(self.reference)):
            if self.reference[i] not in self.reference[:i]:
                return i, self.reference[i]
        pytest.skip("reference output repeats itself too much")

    def test_eos(self):
        i, token = self.first_new_token_after(5)
        result = self.speculative(word_tokenizer(VOCAB, eos_id=token), GenerationParams(max_new_tokens=40))
        assert result.token_ids == self.reference[:i + 1]
        assert result.finish_reason == "stop"
        assert result.text == " ".join(f"w{t}" for t in self.reference[:i])
        ignored = self.speculative(word_tokenizer(VOCAB, eos_id=token),
                                   GenerationParams(max_new_tokens=40, ignore_eos=True))
        assert ignored.token_ids == self.reference

    def test_stop_token_id(self):
        i, token = self.first_new_token_after(9)
        result = self.speculative(word_tokenizer(VOCAB), GenerationParams(max_new_tokens=40, stop_token_ids=(token,)))
        assert result.token_ids == self.reference[:i + 1]
        assert result.finish_reason == "stop"

    def test_stop_string(self):
        i, token = self.first_new_token_after(7)
        words = [f"w{t}" for t in self.reference]
        stop = f"{words[i - 1]} {words[i]}"  # spans two tokens
        result = self.speculative(word_tokenizer(VOCAB), GenerationParams(max_new_tokens=40, stop_strings=(stop,)))
        full_text = " ".join(words)
        first = full_text.find(stop)
        assert result.text == full_text[:first]
        assert result.finish_reason == "stop"
        # The output ends with the token that completed the stop string.
        assert result.token_ids == self.reference[:len(result.token_ids)]
        assert stop in " ".join(words[:len(result.token_ids)])
        assert stop not in " ".join(words[:len(result.token_ids) - 1])

    def test_streamed_text_never_shows_a_stop_string_and_ends_as_the_result(self):
        i, token = self.first_new_token_after(7)
        stop = f"w{self.reference[i - 1]} w{token}"
        drafter = RandomTreeDrafter(oracle(self.prompt, self.reference), VOCAB, seed=2, oracle_rate=1.0)
        generation = Generation(self.model, word_tokenizer(VOCAB), self.prompt,
                                GenerationParams(max_new_tokens=40, stop_strings=(stop,)), drafter, 8)
        stream = TextStream(generation.tokenizer, generation.stops.ids, (stop,))
        streamed = []
        while not generation.finished:
            streamed.append(stream.push(generation.step(), final=generation.finished))
        final = generation.result().text
        assert "".join(streamed) == final and stop not in final

    @pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 17])
    def test_max_new_tokens(self, max_new_tokens):
        result = self.speculative(word_tokenizer(VOCAB), GenerationParams(max_new_tokens=max_new_tokens))
        assert result.token_ids == self.reference[:max_new_tokens]
        assert result.finish_reason == "length"


def test_tree_deeper_than_the_remaining_tokens_is_cut():
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, 0, 3])
    cut = tree.truncated(1)
    assert cut.tokens == [1, 2, 4] and cut.parents == [-1, 0, 0]


@pytest.mark.parametrize("make_tree, message", [
    (lambda root: DraftTree([(root + 1) % VOCAB, 1], [-1, 0]), "root"),
    (lambda root: DraftTree([root, 1], [-1, 1]), "parents must precede"),
    (lambda root: DraftTree([root, VOCAB], [-1, 0]), "outside the vocabulary"),
    (lambda root: DraftTree([root] + [1] * 5, [-1] + [0] * 5), "budget"),
])
def test_a_malformed_tree_from_a_drafter_is_rejected(make_tree, message):
    class BadDrafter(TokenDrafter):
        name = "bad"

        def tree(self, context, budget):
            return make_tree(context.tokens[-1])

    model = random_target("llama", vocab_size=VOCAB)
    generation = Generation(model, word_tokenizer(VOCAB), [3, 4, 0], GenerationParams(), BadDrafter(), 4)
    generation.step()  # prefill
    with pytest.raises(TreeserveError, match=message):
        generation.step()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[VOCAB]), "outside the vocabulary"),
    (dict(budget=0), "budget"),
    (dict(budget=MAX_BUDGET + 1), "budget"),
    (dict(params=GenerationParams(temperature=-0.5)), "temperature"),
    (dict(params=GenerationParams(top_p=1.5)), "top_p"),
    (dict(params=GenerationParams(top_k=-1)), "top_k"),
    (dict(params=GenerationParams(max_new_tokens=0)), "max_new_tokens"),
    (dict(params=GenerationParams(max_new_tokens=600)), "context"),
])
def test_bad_requests_get_clear_errors(kwargs, message):
    model = random_target("llama", vocab_size=VOCAB)
    args = dict(prompt=[1, 2], params=GenerationParams(), budget=4) | kwargs
    with pytest.raises(TreeserveError, match=message):
        Generation(model, word_tokenizer(VOCAB), args["prompt"], args["params"], NgramDrafter(), args["budget"])


def test_requests_batched_into_one_forward_each_get_their_own_output():
    """Continuous batching: requests join between rounds, share each target forward, and leave when done."""
    from treeserve.verifier.engine import commit_round, forward_batch

    model = random_target("qwen3", seed=6, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    requests = [(prompt, GenerationParams(max_new_tokens=8 + 5 * i)) for i, prompt in enumerate(prompts(5, seed=3))]
    references = [generate(model, tokenizer, prompt, params).token_ids for prompt, params in requests]

    def start(i):
        prompt, params = requests[i]
        return Generation(model, tokenizer, prompt, params,
                          RandomTreeDrafter(oracle(prompt, references[i]), VOCAB, seed=i), budget=6)

    running = {0: start(0), 1: start(1)}
    finished, round_number = {}, 0
    while running or len(finished) < len(requests):
        if round_number in (2, 4, 5):  # later arrivals join a batch already decoding
            index = len(running) + len(finished)
            running[index] = start(index)
        plans = {i: g.plan(g.local_draft() if g.prefilled else None) for i, g in running.items()}
        commit_round([running[i] for i in plans], list(plans.values()), *forward_batch(model, list(plans.values())))
        for i in [i for i, g in running.items() if g.finished]:
            finished[i] = running.pop(i).result().token_ids
        round_number += 1
    assert [finished[i] for i in range(len(requests))] == references


@pytest.mark.parametrize("pieces", [0, 8])
def test_the_pool_keeps_every_tokens_features_at_its_slot(pieces):
    """With features kept in the KV pool, each committed token's row of them is at its slot after every round:
    prompts (packed, or in pieces), plain steps and trees whose accepted paths were moved down, requests joining and
    leaving; the same rows the kept features hand out."""
    from random_targets import random_tree
    from treeserve.models.paged_kv import PagedKVCache
    from treeserve.verifier.engine import commit_round, forward_batch
    from treeserve.verifier.graphs import TreeVerifier

    model = random_target("llama", seed=7, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    pool = PagedKVCache(model.config, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    verifier = TreeVerifier(model, pool, max_batch=4, max_tree=9)
    verifier.prefill_pieces = pieces
    layers = (0, 1)
    verifier.keep_features(layers)
    rng = random.Random(0)
    running, round_number = [], 0
    while running or round_number == 0:
        if round_number in (0, 3, 6):  # requests join a batch already decoding
            running += [Generation(model, tokenizer, prompt, GenerationParams(max_new_tokens=12), budget=8,
                                   feature_layer_ids=layers, verifier=verifier)
                        for prompt in prompts(2, seed=round_number)]
        plans = []
        for generation in running:
            tree = None
            if generation.prefilled and rng.random() < 0.7:  # else a plain step
                tree = random_tree(rng.randint(2, 9), rng, VOCAB)
                tree = DraftTree([generation.output_ids[-1]] + tree.tokens[1:], tree.parents)
            plans.append(generation.plan(tree))
        commit_round(running, plans, *forward_batch(model, plans, layers, verifier))
        for generation in [g for g in running if not g.finished]:  # (a finished one gave its blocks back)
            kept = torch.cat(generation.features.chunks)  # every token but the newest: those in the KV cache
            assert len(kept) == generation.cache.length == generation.committed_count - 1
            torch.testing.assert_close(pool.features[generation.cache.slots(0, len(kept))], kept)
        for generation in [g for g in running if g.finished]:
            running.remove(generation)
        round_number += 1
    assert round_number > 6 and pool.allocator.free_count == pool.allocator.num_blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_kept_features_reach_the_host_in_order_when_flushed(device):
    """FeatureBacklog: rows gathered over rounds land on each request's feature chunks in round order, one
    chunk per request and hand-out, only when flushed (before a draft) or, without `prepare`, once BACKSTOP times
    FLUSH_ROUNDS rounds piled up; on the host from a GPU too. A long request's views of shared copies get joined
    into its own."""
    from treeserve.verifier.engine import FeatureBacklog, TargetFeatures
    from treeserve.verifier.rows import Rows

    a, b = (TargetFeatures((0,), keep=True) for _ in range(2))
    sent = {id(a): [], id(b): []}
    backlog = FeatureBacklog()
    rows = iter(range(10000))

    def round_of(*requests_and_counts):
        for request, count in requests_and_counts:
            values = [float(next(rows)) for _ in range(count)]
            sent[id(request)].extend(values)
            request.last = Rows(torch.tensor([[value] for value in values], device=device))
        backlog.add([request for request, _ in requests_and_counts])

    def received(request):
        return torch.cat(request.chunks).flatten().tolist()

    round_of((a, 3), (b, 1))  # a's prompt of three rows, b's plain step
    round_of((b, 2))
    round_of((a, 1), (b, 1))
    assert a.chunks == [] and b.chunks == []  # nothing moved yet
    backlog.flush()
    assert [chunk.flatten().tolist() for chunk in a.chunks] == [[0, 1, 2, 6]]
    assert [chunk.flatten().tolist() for chunk in b.chunks] == [[3, 4, 5, 7]]
    backlog.flush()  # nothing left: nothing added
    assert len(a.chunks) == 1 and len(b.chunks) == 1
    for _ in range(FeatureBacklog.BACKSTOP * FeatureBacklog.FLUSH_ROUNDS - 1):
        round_of((a, 1))
    assert len(a.chunks) == 1 and backlog.rounds
    round_of((a, 1))
    assert len(a.chunks) == 2 and not backlog.rounds  # moved without a flush
    backlog.flush()  # (from a GPU, that copy may still be running until a flush)
    assert received(a) == sent[id(a)] and received(b) == sent[id(b)]
    assert all(chunk.device.type == "cpu" for chunk in a.chunks)
    for _ in range(3 * FeatureBacklog.JOIN_CHUNKS):
        round_of((b, 2), (a, 1))
        backlog.flush()
    assert received(a) == sent[id(a)] and received(b) == sent[id(b)]
    views = [chunk for chunk in a.chunks if chunk._base is not None]
    assert len(a.chunks) <= 3 + FeatureBacklog.JOIN_CHUNKS and len(views) <= FeatureBacklog.JOIN_CHUNKS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_kept_features_of_a_few_requests_among_a_forwards_rows(device):
    """FeatureBacklog, as a round leaves it: the requests that keep features hold scattered rows of one output they
    share with the rest (a plain step's row, a tree's accepted nodes, a prompt's rows), and each gets exactly its
    own rows, in round order, whatever the next round writes into that output."""
    from treeserve.verifier.engine import FeatureBacklog, TargetFeatures
    from treeserve.verifier.rows import Rows

    a, b, c = (TargetFeatures((0,), keep=True) for _ in range(3))
    backlog = FeatureBacklog()
    output = torch.empty(12, 2, device=device)  # a forward's outputs, overwritten every round
    expected = {id(a): [], id(b): [], id(c): []}
    rounds = [
        [(a, range(2, 3)), (b, [4, 6, 7]), (c, range(8, 12))],  # a plain step, accepted tree nodes, a prompt
        [(b, range(0, 1)), (c, range(11, 12))],
        [(a, [5, 9]), (c, range(3, 4))],
    ]
    for number, kept in enumerate(rounds):
        output.copy_(torch.arange(24, dtype=torch.float32).view(12, 2) + 100 * number)
        for request, index in kept:
            request.last = Rows(output, index)
            expected[id(request)] += output[list(index)].tolist()
        backlog.add([request for request, _ in kept])
    output.fill_(-1)  # the next replay: copied rows must not see it
    backlog.flush()
    for request in (a, b, c):
        assert torch.cat(request.chunks).tolist() == expected[id(request)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_prepared_features_are_copied_at_launch_and_moved_when_due(device):
    """FeatureBacklog.prepare, at a forward's launch: the rows of the plans that keep features are copied then
    (what overwrites the output before the commit does not reach them), the others' left as they are; the commit's
    `add` piles the copies without copying again; and once FLUSH_ROUNDS rounds have piled up, the next launch moves
    them to the host."""
    from treeserve.verifier.engine import FeatureBacklog, TargetFeatures
    from treeserve.verifier.rows import Rows

    keeping, plain = TargetFeatures((0,), keep=True), TargetFeatures((0,), keep=False)
    backlog = FeatureBacklog()
    output = torch.empty(6, 2, device=device)  # a forward's outputs: a plain step's row, a tree's five
    expected = []
    for number in range(FeatureBacklog.FLUSH_ROUNDS + 1):
        output.copy_(torch.arange(12, dtype=torch.float32, device=device).view(6, 2) + 100 * number)
        moved_before = len(keeping.chunks)
        features = backlog.prepare([Rows(output, range(0, 1)), Rows(output, range(1, 6))], [False, True])
        assert features[0].source is output and features[1].source is not output
        assert len(keeping.chunks) == moved_before + (number == FeatureBacklog.FLUSH_ROUNDS)
        accepted = [0, 2, 3]  # the tree's root and an accepted path
        expected += output[[1 + node for node in accepted]].tolist()
        output.fill_(-1)  # the next replay, before this round's commit
        keeping.take(features[1], accepted)
        plain.take(features[0], [0])
        copies = len(backlog.copies)
        backlog.add([keeping])
        assert backlog.copies[copies].data_ptr() == features[1].source.data_ptr()  # piled as prepared: no copy
    backlog.flush()
    assert torch.cat(keeping.chunks).tolist() == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_plain_rounds_of_requests_that_keep_features_are_piled_whole(device):
    """Plain rounds whose requests all keep features (adaptive speculation between trees): each request's root is
    row i of the output, piled as one round; rounds of the same requests are grouped in one stack for all of them,
    and a stretch that changes its requests or meets a tree round still gives each request its own rows in order."""
    from treeserve.verifier.engine import FeatureBacklog, TargetFeatures
    from treeserve.verifier.rows import Rows

    a, b, c = (TargetFeatures((0,), keep=True) for _ in range(3))
    backlog = FeatureBacklog()
    output = torch.empty(8, 2, device=device)  # a forward's outputs, overwritten every round
    expected = {id(a): [], id(b): [], id(c): []}
    number = 0

    def plain_round(*requests):
        nonlocal number
        number += 1
        output.copy_(torch.arange(16, dtype=torch.float32, device=device).view(8, 2) + 100 * number)
        features = backlog.prepare([Rows(output, range(i, i + 1)) for i in range(len(requests))],
                                   [True] * len(requests))
        for request, rows in zip(requests, features):
            expected[id(request)] += output[rows.index].tolist()
        output.fill_(-1)  # the next replay, before this round's commit
        for request, rows in zip(requests, features):
            request.take(rows, [0])
        backlog.add(list(requests))

    for _ in range(3):
        plain_round(a, b, c)
    assert len(backlog.kept) == 3  # one entry a round, not one a request
    backlog.flush()
    assert [chunk.shape[0] for chunk in a.chunks] == [3]
    assert a.chunks[0]._base is not None and a.chunks[0]._base is c.chunks[0]._base  # one grouping for all
    plain_round(a, b, c)
    plain_round(c, a)  # b left, the rest reordered
    number += 1
    output.copy_(torch.arange(16, dtype=torch.float32, device=device).view(8, 2) + 100 * number)
    for request, index in ((a, [1, 3]), (c, range(5, 7))):  # a tree round: accepted nodes, a run
        request.last = Rows(output, index)
        expected[id(request)] += output[list(index)].tolist()
    backlog.add([a, c])
    plain_round(a, c)
    number += 1  # a plain round through `add` alone (no `prepare`): copied as it is piled
    output.copy_(torch.arange(16, dtype=torch.float32, device=device).view(8, 2) + 100 * number)
    for i, request in enumerate((a, c)):
        request.last = Rows(output, range(i, i + 1))
        expected[id(request)] += output[[i]].tolist()
    backlog.add([a, c])
    output.fill_(-1)
    backlog.flush()
    for request in (a, b, c):
        assert all(chunk.device.type == "cpu" for chunk in request.chunks)
        assert torch.cat(request.chunks).tolist() == expected[id(request)]


def test_kept_features_flushed_every_round_are_each_requests_own_rows():
    """FeatureBacklog flushed after every round, as drafting rounds flush it: each request's rows of that round
    (one run, or scattered accepted nodes; in order together, or not), whatever the next round writes."""
    import random

    from treeserve.verifier.engine import FeatureBacklog, TargetFeatures
    from treeserve.verifier.rows import Rows

    rng = random.Random(0)
    requests = [TargetFeatures((0,), keep=True) for _ in range(4)]
    expected = {id(request): [] for request in requests}
    backlog = FeatureBacklog()
    output = torch.empty(4 * 9, 2)
    for number in range(40):
        output.copy_(torch.arange(72, dtype=torch.float32).view(36, 2) + 100 * number)
        kept = []
        for b, request in enumerate(rng.sample(requests, rng.randrange(1, 5))):
            if rng.random() < 0.5:
                index = range(9 * b, 9 * b + rng.randrange(1, 10))
            else:
                index = sorted(rng.sample(range(9 * b, 9 * b + 9), rng.randrange(1, 10)))
            request.last = Rows(output, index)
            expected[id(request)] += output[list(index)].tolist()
            kept.append(request)
        backlog.add(kept)
        backlog.flush()
        output.fill_(-1)
    for request in requests:
        assert torch.cat(request.chunks).tolist() == expected[id(request)]


def test_committing_a_round_stops_where_checking_every_token_stops():
    """Generation._commit against its definition (each token appended, then the stop checks on the output so
    far, until one ends it), on random rounds with stop tokens, EOS, stop strings and length limits."""
    model = random_target("llama", vocab_size=VOCAB)
    tokenizer = word_tokenizer(VOCAB, eos_id=3)
    rng = random.Random(0)
    for _ in range(300):
        params = GenerationParams(max_new_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
                                  stop_token_ids=tuple(rng.sample(range(VOCAB), rng.randrange(3))),
                                  stop_strings=("w5 w6",) if rng.random() < 0.2 else ())
        mine, reference = (Generation(model, tokenizer, [1, 2], params) for _ in range(2))
        while not mine.finished:
            tokens = [rng.randrange(8) for _ in range(rng.randint(1, 5))]
            committed = []
            for token in tokens:  # the definition
                reference.output_ids.append(token)
                committed.append(token)
                reference.finish_reason = reference.stops.reason(reference.output_ids)
                if reference.finished:
                    break
            assert mine._commit(tokens) == committed
            assert (mine.output_ids, mine.finish_reason) == (reference.output_ids, reference.finish_reason)
            assert mine.stops.text_end == reference.stops.text_end


def test_a_stop_string_is_found_from_the_outputs_tail_as_from_its_whole_text():
    """Stops decodes only the output's last tokens to look for a stop string the newest token completed: on
    SmolLM2's byte-level tokenizer, with characters split between tokens and stop strings cut from the text at
    random, every token's verdict and the cut text equal those of decoding the whole output each time."""
    from gateway_fakes import smollm2_tokenizer
    from treeserve.verifier.engine import Stops

    tokenizer = smollm2_tokenizer()
    rng = random.Random(11)
    words = ["Hello", " 日本語", " 🙂", " world", "\n\n", " é", "ü", " stop", "STOP", " x", "  ", "\t"]

    def whole_text_verdicts(output, stop_strings):
        """The check as defined: the whole output decoded at every token."""
        verdicts = []
        for n in range(1, len(output) + 1):
            text = tokenizer.decode(output[:n])
            tail_start = max(0, len(tokenizer.decode(output[:n - 1])) - max(map(len, stop_strings)))
            found = [i for s in stop_strings if (i := text.find(s, tail_start)) >= 0]
            verdicts.append(min(found) if found else None)
            if found:
                break
        return verdicts

    matched = 0
    for _ in range(60):
        output = tokenizer.encode("".join(rng.choice(words) for _ in range(rng.randint(5, 40))),
                                  add_special_tokens=False)
        text = tokenizer.decode(output)
        start = rng.randrange(len(text))
        stop_strings = (text[start:start + rng.randint(1, 6)], rng.choice(["never there", "\n\n", "日本"]))
        expected = whole_text_verdicts(output, stop_strings)
        stops = Stops(tokenizer, GenerationParams(max_new_tokens=1000, stop_strings=stop_strings))
        verdicts = []
        for n in range(1, len(output) + 1):
            stops.text_end = None
            ended = stops.reason(output[:n]) == "stop"
            verdicts.append(stops.text_end if ended else None)
            if ended:
                break
        assert verdicts == expected, (output, stop_strings)
        matched += expected[-1] is not None
    assert matched >= 40  # most outputs met one of their stop strings
