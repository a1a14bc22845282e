"""Adaptive speculation: the round budget follows measured costs and acceptance (plain decoding when trees do
not pay), and a stack that adapts still streams exactly the tokens of plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import PROMPTS, SERVING, Services, expected, health, request, run_all, scrape, wait_for
from treeserve.loading import load_target
from treeserve.telemetry import round_totals
from treeserve.verifier.adaptive import BUDGET_STEPS, AdaptiveSpeculation, Calibration, RecentCost


def costs(adaptive: AdaptiveSpeculation, batch: int, verify_ms: dict[int, float], draft_ms: float = 0.0,
          samples: int = RecentCost.SETTLED):
    """Verification costs at these tree sizes (nodes -> ms), and the drafter's cost at every budget."""
    for _ in range(samples):
        for nodes, ms in verify_ms.items():
            adaptive.observe_verify(batch, nodes, ms / 1000)
        for budget in BUDGET_STEPS:
            adaptive.observe_draft(batch, budget, draft_ms / 1000)


def accept(adaptive: AdaptiveSpeculation, request_ids, budget: int, tokens: int, rounds: int = 10):
    for _ in range(rounds):
        for request_id in request_ids:
            adaptive.observe_acceptance(request_id, budget, tokens)


def test_cheap_trees_and_good_acceptance_choose_a_large_budget():
    adaptive = AdaptiveSpeculation()
    # One request, memory-bound verification: 129 nodes cost 1.3x one token (an 8B target at batch 1).
    costs(adaptive, 1, {1: 5.0, 2: 5.0, 3: 5.1, 5: 5.1, 9: 5.2, 17: 5.3, 33: 5.5, 65: 5.9, 129: 6.8})
    accept(adaptive, ["a"], 32, 5)  # 5 tokens a round at budget 32
    assert adaptive.choose({"a": 64}, batch=1) >= 32


def test_compute_bound_batches_fall_back_to_plain_decoding():
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    # 64 requests: every drafted row costs (the 8B figures of docs/benchmarks.md), and a draft costs 3 ms.
    costs(adaptive, 64, {1: 9.4, 2: 10.0, 3: 10.9, 5: 15.5, 9: 20.7, 17: 37.1, 33: 65.5, 65: 123.2, 129: 238.5},
          draft_ms=3.0)
    accept(adaptive, ids, 16, 2)  # one drafted token accepted a round
    assert [adaptive.choose({i: 16 for i in ids}, batch=64) for _ in range(31)] == [0] * 31
    # Every 32nd plain round tries the best tree once more: acceptance is only learnt from trees.
    assert adaptive.choose({i: 16 for i in ids}, batch=64) > 0
    # The same costs with acceptance high enough still speculate, with a small tree.
    accept(adaptive, ids, 4, 4, rounds=40)
    assert 1 <= adaptive.choose({i: 16 for i in ids}, batch=64) <= 4


def test_a_tree_must_promise_a_margin_over_plain_decoding():
    """The chosen tree's estimate is the best of noisy ones and so likely to read high, and a tree costs what no
    estimate holds: near break-even a round decodes plainly, and a tree is chosen where it clears the margin."""
    for gain, chosen in ((1.02, 0), (1.10, 1)):
        assert (gain > AdaptiveSpeculation.MARGIN) == (chosen > 0)
        adaptive = AdaptiveSpeculation()
        accept(adaptive, ["a"], 1, 2, rounds=200)  # the one drafted token accepted every round
        tokens = adaptive.expected_tokens("a", 1)
        costs(adaptive, 1, {1: 10.0, 2: 10.0 * tokens / gain})  # tokens a second: `gain` times plain decoding's
        assert adaptive.choose({"a": 1}, batch=1) == chosen


def test_failed_explorations_back_off():
    adaptive = AdaptiveSpeculation()
    ids = ["a", "b"]
    # Cheap trees, measured at every size (a try costs little)...
    costs(adaptive, 2, {1: 5.0, 2: 5.5, 3: 5.5, 5: 5.5, 9: 5.5, 17: 5.5}, draft_ms=0.1)
    accept(adaptive, ids, 16, 1)  # ...that accept nothing: a drafter that never pays

    def rounds_until_a_try():
        for played in range(1, 5000):
            if adaptive.choose({i: 16 for i in ids}, batch=2) > 0:
                accept(adaptive, ids, 16, 1, rounds=1)  # the try fails
                return played
        raise AssertionError("no exploring round")

    assert [rounds_until_a_try() for _ in range(7)] == [32, 64, 128, 256, 512, 1024, 1024]
    # Trees that pay again (cheap now, and accepted) win on their merits, and exploring starts over at 32.
    costs(adaptive, 2, {1: 5.0, 17: 5.5}, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 8, rounds=30)
    assert adaptive.choose({i: 16 for i in ids}, batch=2) == 16 and adaptive.explore_interval == 32


def test_unmeasured_tree_sizes_are_tried_then_tries_back_off():
    """Only plain rounds and 17-node trees measured, trees that never accept: each unmeasured size is tried (its
    estimate borrows a smaller size's cost, and a request's misses age away in plain rounds) until it has its own
    cost; then the tries back off as the explorations do."""
    adaptive = AdaptiveSpeculation()
    ids = ["a", "b"]
    costs(adaptive, 2, {1: 5.0, 17: 5.5}, draft_ms=0.1)
    accept(adaptive, ids, 16, 1)
    gaps = []
    for _ in range(12):
        played = next(n for n in range(1, 5000) if adaptive.choose({i: 16 for i in ids}, batch=2) > 0)
        chosen = adaptive.last_choice
        adaptive.observe_verify(2, chosen + 1, 0.0055)  # what the try cost: as much as a 17-node tree
        adaptive.observe_draft(2, chosen, 0.0001)
        accept(adaptive, ids, chosen, 1, rounds=1)  # and it accepted nothing
        gaps.append(played)
    assert all(gap < adaptive.explore_every for gap in gaps[:6])  # two sizes, each until settled (three samples)
    assert gaps[-5:] == [64, 128, 256, 512, 1024]


def test_a_dear_try_waits_until_it_is_a_small_share_of_the_time():
    """A DFlash try at 64 requests on the H200: the drafter catches up every request's features, 250 ms against
    11 ms plain rounds. It comes once the plain rounds since the last one have taken 1 / EXPLORE_SHARE times
    what it costs beyond a plain round, not after explore_every rounds."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    costs(adaptive, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0}, draft_ms=250.0)
    accept(adaptive, ids, 16, 1)
    for played in range(1, 5000):
        if adaptive.choose({i: 16 for i in ids}, batch=64) > 0:
            break
    extra_s = adaptive.try_extra_s
    assert 0.250 <= extra_s <= 0.260
    assert abs(played - extra_s / AdaptiveSpeculation.EXPLORE_SHARE / 0.011) <= 1
    # Drafts timed only at one request (12 ms, a catch-up of one request's context) price a try at 64 requests
    # as 64 of them: the H200 try priced at 12 ms cost 430 ms.
    fresh = AdaptiveSpeculation()
    costs(fresh, 1, {1: 1.7, 17: 2.0}, draft_ms=12.0)
    costs(fresh, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0})
    del fresh.draft_s[64]
    assert fresh.round_seconds(64, 1) == pytest.approx(0.012 + 64 * 0.012)


def test_new_requests_decode_plainly_where_drafting_has_stopped_paying():
    """After GIVE_UP_AFTER_S of rounds at a batch bucket in which drafting would not pay even were every request
    drafting, new requests joining batches of that bucket decode plainly, but for one in CANARY_EVERY; once the
    drafting ones show that it would pay for all, new requests draft again."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    costs(adaptive, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0}, draft_ms=250.0)
    accept(adaptive, ids, 16, 1)  # trees accept nothing: a DFlash drafter that does not pay at 64 requests
    assert adaptive.speculates_new_request(64)
    rounds = 0
    while adaptive.unpaid_s.get(64, 0.0) < AdaptiveSpeculation.GIVE_UP_AFTER_S:
        assert adaptive.choose({i: 16 for i in ids}, batch=64) == 0
        rounds += 1
    assert abs(rounds * 0.011 - AdaptiveSpeculation.GIVE_UP_AFTER_S) < 0.011 * (AdaptiveSpeculation.REUSE_PLAIN + 1)
    every = AdaptiveSpeculation.CANARY_EVERY
    assert [adaptive.speculates_new_request(60) for _ in range(2 * every)] == ([False] * (every - 1) + [True]) * 2
    assert adaptive.speculates_new_request(3)  # another batch bucket: nothing said against drafting there
    # Running requests of such a batch stop drafting too, but for one in CANARY_EVERY (at least one).
    assert adaptive.drafting_kept(64) == 64 // every and adaptive.drafting_kept(40) == 40 // every
    assert adaptive.drafting_kept(3) is None
    adaptive.unpaid_s[4] = AdaptiveSpeculation.GIVE_UP_AFTER_S
    assert adaptive.drafting_kept(3) == 1
    # Four requests still draft (canaries), and their trees now accept well: were everyone drafting, it would pay.
    costs(adaptive, 64, {1: 11.0, 2: 11.2, 3: 11.4, 5: 11.6, 9: 12.0, 17: 13.0}, draft_ms=1.0,
          samples=RecentCost.WINDOW)
    accept(adaptive, ids[:4], 16, 9, rounds=20)
    adaptive.choose({i: 16 for i in ids[:4]}, batch=64)
    assert adaptive.unpaid_s[64] == 0.0 and adaptive.speculates_new_request(64)
    assert adaptive.drafting_kept(64) is None


def test_a_lone_request_is_not_given_up_where_drafting_costs_nothing_in_plain_rounds():
    """Without target features to keep (n-gram lookup, a draft model), drafting is given up from two requests up but
    not for one request alone, however long drafting has not paid there."""
    adaptive = AdaptiveSpeculation()
    adaptive.unpaid_s = {1: 10 * AdaptiveSpeculation.GIVE_UP_AFTER_S, 2: AdaptiveSpeculation.GIVE_UP_AFTER_S}
    assert adaptive.gave_up(1) and adaptive.gave_up(2)
    adaptive.drafting_costs_in_plain_rounds = False
    assert not adaptive.gave_up(1) and adaptive.gave_up(2)
    assert all(adaptive.speculates_new_request(1) for _ in range(2 * AdaptiveSpeculation.CANARY_EVERY))
    assert adaptive.drafting_kept(1) is None and adaptive.drafting_kept(2) == 1


def test_a_stretch_of_misses_does_not_stop_trees_that_pay_on_average():
    # An n-gram drafter on code, one request, the H200 stack's costs: a plain round 1.9 ms, 17 nodes 2.3 ms,
    # the drafter's round trip 0.9 ms. Break-even is 1.68 tokens a round at budget 16.
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.9, 17: 2.3}, draft_ms=0.9)
    accept(adaptive, ["a"], 16, 5)  # a copied stretch: 5 tokens a round
    accept(adaptive, ["a"], 16, 1)  # then ten misses: 2.8 tokens a round over the twenty
    assert adaptive.choose({"a": 16}, batch=1) == 16
    accept(adaptive, ["a"], 16, 1, rounds=40)  # misses for long: below break-even
    assert adaptive.choose({"a": 16}, batch=1) == 0


def test_a_requests_misses_fade_in_its_plain_rounds():
    """Acceptance comes in runs (a stretch copied from the prompt, then misses): a request that has just missed a
    few times is tried again within a few plain rounds, once its own evidence has aged towards what all requests'
    trees accept (PLAIN_AGING), not only when exploring comes round."""
    def rounds_until_a_tree(aging: float) -> int:
        adaptive = AdaptiveSpeculation()
        adaptive.PLAIN_AGING = aging
        # One request, float32 SmolLM2 on the H200: a plain round 1.83 ms, trees 2.75-3.10, the drafter 0.72.
        costs(adaptive, 1, {1: 1.83, 2: 2.75, 3: 2.75, 5: 2.82, 9: 2.97, 17: 3.10}, draft_ms=0.72)
        accept(adaptive, [f"earlier-{i}" for i in range(8)], 16, 4)  # earlier requests: 4 tokens a round
        accept(adaptive, ["a"], 16, 1, rounds=6)  # this one has just missed six times
        for played in range(1, 1000):
            if adaptive.choose({"a": 16}, batch=1) > 0:
                return played
        raise AssertionError("no tree")

    assert rounds_until_a_tree(AdaptiveSpeculation.PLAIN_AGING) <= AdaptiveSpeculation.REUSE_PLAIN + 2
    assert rounds_until_a_tree(0.0) >= AdaptiveSpeculation().explore_every  # without aging: only a try


def test_a_batch_size_without_drafts_borrows_the_nearest_drafting_cost():
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(32)]
    costs(adaptive, 16, {1: 4.0, 17: 5.0}, draft_ms=20.0)  # drafts timed at 16 requests: 20 ms
    costs(adaptive, 32, {1: 5.0, 17: 6.0})  # 32 requests: verification timed, drafts never
    del adaptive.draft_s[32]
    accept(adaptive, ids, 16, 2)  # about 2 tokens a round at budget 16
    # With free drafts, 64 tokens in 6 ms would beat 32 in 5 ms; with 16 requests' 20 ms they do not.
    assert adaptive.choose({i: 16 for i in ids}, batch=32) == 0
    fresh = AdaptiveSpeculation()  # no draft ever timed: the first tree is tried
    costs(fresh, 32, {1: 5.0, 17: 6.0}, samples=RecentCost.SETTLED)
    fresh.draft_s.clear()
    accept(fresh, ids, 16, 2)
    assert fresh.choose({i: 16 for i in ids}, batch=32) > 0


def test_batch_sizes_in_one_graph_bucket_share_their_costs():
    """A batch of 50 runs in the 64-request graph, as a batch of 40 does: its costs are known from 40's rounds,
    so it is judged (plain here: trees do not pay) rather than tried as unmeasured."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 40, {1: 10.0, 17: 30.0}, draft_ms=20.0)
    assert adaptive.round_seconds(50, 0) == pytest.approx(0.010)
    assert adaptive.round_seconds(64, 16) == pytest.approx(0.050)
    assert adaptive.round_seconds(65, 0) is None  # the 128-request graph: not measured
    ids = [f"r{i}" for i in range(50)]
    accept(adaptive, ids, 16, 2)
    assert adaptive.choose({i: 16 for i in ids}, batch=50) == 0


def test_a_plain_decision_is_reused_for_a_few_rounds_of_the_same_batch():
    """Plain rounds observe no acceptance, so a plain choice stands for REUSE_PLAIN more rounds of the same batch
    (cheaper rounds); then, or at once for another batch, it is worked out again."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(4)]
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    accept(adaptive, ids, 16, 1)  # trees accept nothing: plain
    budgets = {i: 16 for i in ids}
    assert adaptive.choose(budgets, batch=4) == 0
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)  # drafts free now...
    accept(adaptive, ids, 16, 6)  # ...and trees accept a lot
    assert adaptive.choose({i: 16 for i in ids[:3]}, batch=4) > 0  # another batch: worked out at once
    assert adaptive.choose(budgets, batch=4) > 0
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    accept(adaptive, ids, 16, 1)
    assert adaptive.choose(budgets, batch=4) == 0
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 6)
    choices = [adaptive.choose(budgets, batch=4) for _ in range(AdaptiveSpeculation.REUSE_PLAIN + 1)]
    assert choices[:-1] == [0] * AdaptiveSpeculation.REUSE_PLAIN and choices[-1] > 0, choices


def test_each_choice_says_what_it_expects_of_its_round():
    """What a choice expects of its round, which the verifier checks against the round: plain decoding one token a
    request in a plain round's time (a reused plain decision too), a tree its expected drafted tokens on top in the
    tree's round time; nothing before plain rounds are measured."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(4)]
    budgets = {i: 16 for i in ids}
    assert adaptive.choose(budgets, batch=4) == 0 and adaptive.expected is None  # plain rounds are measured first
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    accept(adaptive, ids, 16, 1)
    assert adaptive.choose(budgets, batch=4) == 0 and adaptive.expected == (4.0, pytest.approx(0.002))
    assert adaptive.choose(budgets, batch=4) == 0 and adaptive.expected == (4.0, pytest.approx(0.002))  # reused
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.5, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 6)
    drafting = ids[:3]
    chosen = adaptive.choose({i: 16 for i in drafting}, batch=4)  # another batch signature: worked out anew
    assert chosen > 0
    tokens, seconds = adaptive.expected
    assert tokens == pytest.approx(4 + sum(adaptive.expected_tokens(i, chosen) - 1 for i in drafting))
    assert seconds == pytest.approx(adaptive.round_seconds(4, chosen))


def test_graph_timings_price_unsettled_trees_on_top_of_measured_rounds():
    # Say a graph's replay alone is a fraction of a round (0.5 ms of a 2 ms plain round: the rest is host work). An
    # unsettled 17-node bucket costs the plain round plus the graphs' difference, not its bare replay.
    adaptive = AdaptiveSpeculation()
    for nodes, ms in {1: 0.5, 17: 0.7, 129: 2.0}.items():
        adaptive.observe_graph(1, nodes, ms / 1000)
    costs(adaptive, 1, {1: 2.0}, draft_ms=1.0)
    assert adaptive.round_seconds(1, 16) == pytest.approx((2.0 + 0.2 + 1.0) / 1000)
    assert adaptive.round_seconds(1, 128) == pytest.approx((2.0 + 1.5 + 1.0) / 1000)
    # Trees that break even against that price are not taken on the bare replay's promise.
    accept(adaptive, ["a"], 16, 1, rounds=40)  # nothing accepted: trees never pay
    assert adaptive.choose({"a": 16}, batch=1) == 0
    # Once the bucket's own rounds settle, they are its cost.
    costs(adaptive, 1, {17: 2.6}, draft_ms=1.0)
    assert adaptive.round_seconds(1, 16) == pytest.approx((2.6 + 1.0) / 1000)


def test_a_round_emits_at_most_its_budget_plus_one():
    adaptive = AdaptiveSpeculation()
    accept(adaptive, ["a"], 4, 5)  # every drafted token accepted: a slope above 1
    assert adaptive.slope("a") > 1.5
    assert adaptive.expected_tokens("a", 1) == 2.0 and 4.5 < adaptive.expected_tokens("a", 4) <= 5.0


def test_bounds_and_own_budgets_cap_the_choice():
    adaptive = AdaptiveSpeculation(min_budget=2, max_budget=8)
    costs(adaptive, 1, {1: 5.0, 3: 5.0, 5: 5.0, 9: 5.0})  # trees cost nothing extra: the largest allowed wins
    accept(adaptive, ["a"], 8, 4)
    assert adaptive.choose({"a": 64}, batch=1) == 8
    assert adaptive.choose({"a": 4}, batch=1) == 4  # the request's own budget
    costs(adaptive, 1, {3: 50.0, 5: 100.0, 9: 200.0})  # trees now cost 10x and more: the minimum, not plain
    assert adaptive.choose({"a": 64}, batch=1) == 2
    with pytest.raises(ValueError, match="0 <= min <= max"):
        AdaptiveSpeculation(min_budget=9, max_budget=8)


def test_unmeasured_sizes_are_tried_before_judged():
    adaptive = AdaptiveSpeculation(min_budget=1)
    assert adaptive.choose({"a": 16}, batch=1) == 16  # nothing measured, plain not allowed: as asked, and learn
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 5.0, 17: 6.0})
    accept(adaptive, ["a"], 16, 3)
    # Budget 32 (33 nodes) is unmeasured: it costs what 17 nodes cost until tried, so it is tried.
    assert adaptive.choose({"a": 32}, batch=1) == 32


def test_one_slow_round_does_not_condemn_a_tree_size():
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 5.0, 17: 6.0})
    accept(adaptive, ["a"], 16, 4)
    adaptive.observe_verify(1, 17, 1.5)  # a 1.5 s hiccup among 6 ms rounds
    assert adaptive.choose({"a": 16}, batch=1) == 16
    fresh = AdaptiveSpeculation()  # a first sample that was slow is retried before it is believed
    costs(fresh, 1, {1: 5.0})
    fresh.observe_verify(1, 17, 1.5)
    accept(fresh, ["a"], 16, 4)
    assert fresh.choose({"a": 16}, batch=1) == 16


def test_a_request_with_poor_acceptance_does_not_drag_the_rest():
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 2, {1: 5.0, 2: 5.2, 3: 5.3, 5: 5.4, 9: 5.6, 17: 6.0})
    accept(adaptive, ["good"], 16, 5)
    accept(adaptive, ["poor"], 16, 1)
    assert adaptive.choose({"good": 16, "poor": 16}, batch=2) > 0
    adaptive.forget("good")
    assert "good" not in adaptive.slopes


def test_plain_rounds_are_measured_before_trees_are_judged_against_them():
    """Priced like the nearest measured bucket, a larger tree's, plain decoding could never win: a server whose
    requests all speculate from the start would never stop speculating."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(8)]
    costs(adaptive, 8, {17: 20.0}, draft_ms=5.0)  # only trees measured so far
    accept(adaptive, ids, 16, 2)  # 2 tokens a round: more than plain rounds at a tree's price would give
    assert adaptive.choose({i: 16 for i in ids}, batch=8) == 0
    costs(adaptive, 8, {1: 5.0}, draft_ms=5.0)
    assert [adaptive.choose({i: 16 for i in ids}, batch=8) for _ in range(20)] == [0] * 20
    assert adaptive.choose({i: 16 for i in ids}, batch=16) == 0  # another batch bucket: its plain rounds first


def test_rounds_that_realize_less_than_expected_scale_the_model_down():
    """Requests whose slopes promise more than their rounds emit (new requests on the all-request slope, say):
    once a few rounds have shown it, the model's drafted tokens are scaled by what rounds realized, and plain
    decoding wins; where rounds realize what was expected, speculation goes on."""
    tree_costs = {1: 5.0, 2: 5.3, 3: 5.6, 5: 6.0, 9: 6.7, 17: 7.5}

    def played(realized_per_request: float) -> list[int]:
        adaptive = AdaptiveSpeculation()
        ids = [f"r{i}" for i in range(8)]
        costs(adaptive, 8, tree_costs, draft_ms=0.5)  # at 16: break-even at 1.6 tokens a request and round
        accept(adaptive, ids, 16, 5)  # the slopes say 5 tokens a round
        choices = []
        for _ in range(2 * Calibration.SETTLED):
            choices.append(adaptive.choose({i: 16 for i in ids}, batch=8))
            adaptive.observe_round(8, round(8 * (realized_per_request if choices[-1] else 1)))
        return choices

    assert played(1.25) == [16] * Calibration.SETTLED + [0] * Calibration.SETTLED
    assert played(4.0) == [16] * (2 * Calibration.SETTLED)
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 8, tree_costs)
    accept(adaptive, ["a"], 16, 5)
    assert adaptive.choose({"a": 16}, batch=8) > 0
    assert adaptive.observe_round(8, 8, drafted=False) is None  # no tree reached the round: nothing learnt
    assert not adaptive.calibration
    for _ in range(Calibration.SETTLED):
        assert adaptive.calibration_factor(8) == 1.0  # not settled yet: the model as it is
        chosen = adaptive.choose({"a": 16}, batch=8)  # one request speculates, seven decode plainly
        assert chosen > 0
        batch, factor = adaptive.observe_round(8, 8 + 1)  # 1 drafted token realized
    assert batch == 8 and factor == pytest.approx(1 / (adaptive.expected_tokens("a", chosen) - 1))
    assert adaptive.calibration_factor(5) == factor and adaptive.calibration_factor(16) == 1.0
    assert adaptive.observe_round(8, 8) is None  # no speculative round was chosen since


@pytest.mark.slow
def test_an_adaptive_stack_streams_the_tokens_of_plain_decoding(tmp_path):
    import tiny_models

    model = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    (tmp_path / "run").mkdir()
    services = Services(tmp_path / "run", model)
    try:
        services.start_drafter()
        services.start_verifier("--speculation", "adaptive")
        wait_for(lambda: health(services.verifier) == SERVING, what="the verifier")
        services.start_gateway(services.verifier)
        wait_for(lambda: health(services.gateway) == SERVING, what="the gateway")
        target = load_target(model)
        results = run_all(services.gateway, [request(p, 30) for p in PROMPTS])
        for prompt, (tokens, _) in zip(PROMPTS, results):
            assert tokens == expected(target, prompt, 30)
        metrics = scrape(services.verifier_metrics)
        assert ("treeserve_verifier_round_budget", ()) in metrics
        chosen = round_totals(f"127.0.0.1:{services.verifier_metrics}").budgets
        assert sum(chosen.values()) > 0 and set(chosen) <= {0, *BUDGET_STEPS}
        # treeserve bench reports what the adaptive verifier chose in each speculative run.
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        out = tmp_path / "bench.json"
        done = subprocess.run([sys.executable, "-m", "treeserve", "bench", "--address", services.gateway, "--prompts",
                               str(prompts), "--concurrency", "2", "--requests", "4", "--max-new-tokens", "8",
                               "--verifier-metrics", f"127.0.0.1:{services.verifier_metrics}", "--out", str(out),
                               "--quiet"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        plain, speculative = json.loads(out.read_text())["runs"]
        assert "adaptive_rounds_by_budget" not in plain and sum(speculative["adaptive_rounds_by_budget"].values()) > 0
        # ... and, for its rounds without a prompt, what it expected of them beside what they did.
        checked = speculative["adaptive_checked"]
        assert sum(figures["rounds"] for figures in checked.values()) > 0
        assert all(figures["realized_ms"] > 0 and figures["expected_tokens"] >= 1 for figures in checked.values())
        assert speculative["identical_to_plain"] == "4/4"
    finally:
        services.stack.stop(grace_s=1)
