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


def run_rounds_keeping_features(pieces: int, on_round, seed: int = 0, hold_moves: bool = False,
                                copies=None) -> int:
    """Requests that keep features (drafted in another process) in rounds of random plain steps and drafted trees
    over a pool that keeps them, requests joining a batch already decoding and leaving it; `on_round(running,
    truth)` after each commit, `truth`: each generation's rows the forwards gave for its KV cache's tokens, in
    order, copied as they were made. With `hold_moves` the accepted paths' KV moves wait for the next forward, as
    the scheduler's do. Returns the rounds run."""
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
    rng = random.Random(seed)
    running, truth, round_number = [], {}, 0
    while running or round_number == 0:
        if round_number in (0, 3, 6):  # requests join a batch already decoding
            running += [Generation(model, tokenizer, prompt, GenerationParams(max_new_tokens=12), budget=8,
                                   feature_layer_ids=layers, verifier=verifier)
                        for prompt in prompts(2, seed=seed + round_number)]
        plans = []
        for generation in running:
            tree = None
            if generation.prefilled and rng.random() < 0.6:  # else a plain step
                tree = random_tree(rng.randint(2, 9), rng, VOCAB)
                tree = DraftTree([generation.output_ids[-1]] + tree.tokens[1:], tree.parents)
            plans.append(generation.plan(tree))
        pool.launch_held_moves()  # (a forward's caller launches the last commit's first)
        logits, features = forward_batch(model, plans, layers, verifier)
        if copies is not None:
            features = copies.prepare(features, plans, [generation.features.keep for generation in running])
        commit_round(running, plans, logits, features, copies, hold_moves=hold_moves)
        for generation in running:
            truth.setdefault(id(generation), []).append(generation.features.last.tensor().clone())
        live = [generation for generation in running if not generation.finished]  # (the rest gave their blocks back)
        on_round(live, {id(generation): torch.cat(truth[id(generation)]) for generation in live})
        running = live
        round_number += 1
    pool.launch_held_moves()
    assert pool.allocator.free_count == pool.allocator.num_blocks
    return round_number


@pytest.mark.parametrize("pieces", [0, 8])
def test_the_pool_keeps_every_tokens_features_at_its_slot(pieces):
    """With features kept in the KV pool, each committed token's row of them is at its slot after every round:
    prompts (packed, or in pieces), plain steps and trees whose accepted paths were moved down, requests joining and
    leaving."""
    def check(running, truth):
        for generation in running:
            kept = truth[id(generation)]  # every token but the newest: those in the KV cache
            assert len(kept) == generation.cache.length == generation.committed_count - 1
            pool = generation.cache.cache
            torch.testing.assert_close(pool.features[generation.cache.slots(0, len(kept))], kept)

    assert run_rounds_keeping_features(pieces, check) > 6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_feature_rows_hand_a_drafter_each_row_once_in_order(seed):
    """kept_feature_rows, as a drafter link asks for them (from the row after the last it was sent), in rounds
    that draft at random while the last commit's KV moves still wait: every request's rows arrive in order, none
    twice, none missing, the same rows the forwards gave; after a round that drafted every request's tree, the next
    takes them all from the host copies, with no gather from the pool."""
    from treeserve.verifier.engine import FeatureCopies, kept_feature_rows

    rng = random.Random(seed)
    copies = FeatureCopies()
    received, sent = {}, {}

    def draft(running, truth):
        if not running or rng.random() < 0.4:
            return  # no drafts this round: the rows wait in the pool
        gathers = []
        pool = running[0].cache.cache
        gather_from_pool = pool.feature_rows
        pool.feature_rows = lambda slots: gathers.append(len(slots)) or gather_from_pool(slots)
        try:
            found = kept_feature_rows(running, [sent.get(id(generation), 0) for generation in running])
        finally:
            del pool.feature_rows
        all_recent = all(generation.features.recent is not None
                         and sent.get(id(generation)) == generation.features.recent_start for generation in running)
        if all_recent:
            assert gathers == []
        for generation, parts in zip(running, found):
            received.setdefault(id(generation), []).extend(parts)
            sent[id(generation)] = generation.cache.length
            torch.testing.assert_close(torch.cat(received[id(generation)]), truth[id(generation)])

    assert run_rounds_keeping_features(0, draft, seed=seed, hold_moves=True, copies=copies) > 6
    assert received


def test_a_request_that_keeps_features_needs_a_pool_that_keeps_them():
    """A request drafted in another process gets its features from the pool: without a pool that keeps them, it
    is refused with a clear error rather than failing at its first draft."""
    from treeserve.models.paged_kv import PagedKVCache
    from treeserve.verifier.graphs import TreeVerifier

    model = random_target("llama", seed=7, vocab_size=VOCAB)
    pool = PagedKVCache(model.config, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    verifier = TreeVerifier(model, pool, max_batch=1, max_tree=9)
    with pytest.raises(TreeserveError, match="kept in the verifier's pool"):
        Generation(model, word_tokenizer(VOCAB), [1, 2], GenerationParams(max_new_tokens=4), budget=8,
                   feature_layer_ids=(0,), verifier=verifier)
    verifier.keep_features((0,))
    Generation(model, word_tokenizer(VOCAB), [1, 2], GenerationParams(max_new_tokens=4), budget=8,
               feature_layer_ids=(0,), verifier=verifier).release()


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
