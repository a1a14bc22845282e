"""Adaptive speculation: the round budget follows measured costs and acceptance (plain decoding when trees do
not pay), and a stack that adapts still streams exactly the tokens of plain decoding. The policy is driven here
through its interface: its choice, the round reports it observes, and the public models it learns in."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import PROMPTS, SERVING, Services, expected, health, request, run_all, scrape, wait_for
from treeserve.loading import load_target
from treeserve.telemetry import round_totals
from treeserve.tree import DraftTree
from treeserve.verifier.adaptive import (BUDGET_STEPS, AcceptanceModel, AdaptiveSpeculation, Calibration,
                                         DecayingRatio, ExpectedDrafts, Exploration, GiveUp, RecentCost,
                                         tokens_per_round)
from treeserve.verifier.drafter_link import DraftRound, catches_up
from treeserve.verifier.round import Choice, RequestReport, RoundReport

CANARY_EVERY = GiveUp.CANARY_EVERY


def costs(adaptive: AdaptiveSpeculation, batch: int, verify_ms: dict[int, float], draft_ms: float | None = 0.0,
          samples: int = RecentCost.SETTLED):
    """Verification costs at these tree sizes (nodes -> ms), and the drafter's cost at every budget (None: no
    draft timed at this batch)."""
    for _ in range(samples):
        for nodes, ms in verify_ms.items():
            adaptive.costs.observe_verify(batch, nodes, ms / 1000)
        if draft_ms is not None:
            for budget in BUDGET_STEPS:
                adaptive.costs.observe_draft(batch, budget, draft_ms / 1000)


def accept(adaptive: AdaptiveSpeculation, request_ids, budget: int, tokens: int, rounds: int = 10):
    for _ in range(rounds):
        for request_id in request_ids:
            adaptive.acceptance.observe(request_id, budget, tokens)


def budget(adaptive: AdaptiveSpeculation, asked: dict[str, int], batch: int) -> int:
    return adaptive.choose(asked, batch).budget


def report(choice: Choice | None, batch: int, requests: dict[str, tuple[int, int]], verify_ms: float,
           drafts: list[DraftRound] = (), prompts: bool = False) -> RoundReport:
    """A round of `batch` requests after `choice`: request id -> (tree nodes drafted, tokens committed), which took
    `verify_ms` besides its drafts."""
    reports = [RequestReport(request_id, committed, tree_nodes=nodes, accepted=committed - 1)
               for request_id, (nodes, committed) in requests.items()]
    budgets = {request_id: choice.budget for request_id, (nodes, _) in requests.items() if nodes} if choice else {}
    return RoundReport(batch, choice, budgets, list(drafts), forward_batch=batch,
                       largest_tree=1 + max(nodes for nodes, _ in requests.values()), with_prompts=prompts,
                       requests=reports, draft_s=max((found.round_trip_s for found in drafts), default=0.0),
                       verify_s=verify_ms / 1000)


def test_cheap_trees_and_good_acceptance_choose_a_large_budget():
    adaptive = AdaptiveSpeculation()
    # One request, memory-bound verification: 129 nodes cost 1.3x one token (a large target at batch 1).
    costs(adaptive, 1, {1: 5.0, 2: 5.0, 3: 5.1, 5: 5.1, 9: 5.2, 17: 5.3, 33: 5.5, 65: 5.9, 129: 6.8})
    accept(adaptive, ["a"], 32, 5)  # 5 tokens a round at budget 32
    assert budget(adaptive, {"a": 64}, batch=1) >= 32


def test_compute_bound_batches_fall_back_to_plain_decoding():
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    # 64 requests: every drafted row costs, and a draft costs 3 ms.
    costs(adaptive, 64, {1: 9.4, 2: 10.0, 3: 10.9, 5: 15.5, 9: 20.7, 17: 37.1, 33: 65.5, 65: 123.2, 129: 238.5},
          draft_ms=3.0)
    accept(adaptive, ids, 16, 2)  # one drafted token accepted a round
    assert [budget(adaptive, {i: 16 for i in ids}, batch=64) for _ in range(31)] == [0] * 31
    # Every 32nd plain round tries the best tree once more: acceptance is only learnt from trees.
    assert budget(adaptive, {i: 16 for i in ids}, batch=64) > 0
    # The same costs with acceptance high enough still speculate, with a small tree.
    accept(adaptive, ids, 4, 4, rounds=40)
    assert 1 <= budget(adaptive, {i: 16 for i in ids}, batch=64) <= 4


def test_in_a_batch_a_tree_must_promise_a_margin_over_plain_decoding_but_alone_it_need_not():
    """In a batch the chosen tree's estimate is the best of noisy ones and so likely to read high, and a tree costs
    what no estimate holds: near break-even a round decodes plainly, and a tree is chosen where it clears the margin.
    A lone request's trees are priced by its own steady rounds: one that promises a little more than plain decoding
    is played."""
    assert AdaptiveSpeculation.LONE_MARGIN < 1.02 < AdaptiveSpeculation.MARGIN < 1.10
    for batch, gain, chosen in ((2, 1.02, 0), (2, 1.10, 1), (1, 1.02, 1), (1, 0.98, 0)):
        adaptive = AdaptiveSpeculation()
        ids = [f"r{i}" for i in range(batch)]
        accept(adaptive, ids, 1, 2, rounds=200)  # the one drafted token accepted every round
        tokens = adaptive.acceptance.expected_tokens("r0", 1)  # each request's, tokens/s `gain` times plain's
        costs(adaptive, batch, {1: 10.0, 2: 10.0 * tokens / gain})
        assert budget(adaptive, dict.fromkeys(ids, 1), batch=batch) == chosen, (batch, gain)


def test_a_lone_requests_run_of_misses_does_not_stop_trees_that_pay_on_average():
    """At one request the next round's acceptance is hard to tell from the last few: trees that emit three tokens a
    round for about twice a plain round's cost go on through a run of misses that a twenty-round memory (decay
    0.05) would follow down to plain decoding; a drafter that has stopped paying is still dropped, a little later."""
    def choice_after(misses: int, decay: float) -> int:
        adaptive = AdaptiveSpeculation(decay=decay)
        costs(adaptive, 1, {1: 1.05, 2: 1.3, 3: 1.35, 5: 1.4, 9: 1.42, 17: 1.45, 33: 1.5}, draft_ms=0.76)
        accept(adaptive, ["a"], 32, 3, rounds=60)  # two drafted tokens accepted a round
        accept(adaptive, ["a"], 32, 1, rounds=misses)  # then misses in a row
        return budget(adaptive, {"a": 32}, batch=1)

    assert choice_after(12, decay=0.05) == 0
    assert choice_after(12, decay=AdaptiveSpeculation().acceptance.decay) == 32
    assert choice_after(30, decay=AdaptiveSpeculation().acceptance.decay) == 0


def test_failed_explorations_back_off():
    adaptive = AdaptiveSpeculation(explore_every=32, decay=0.05)  # (acceptance forgets within the scenes below)
    ids = ["a", "b"]
    # Cheap trees, measured at every size (a try costs little)...
    costs(adaptive, 2, {1: 5.0, 2: 5.5, 3: 5.5, 5: 5.5, 9: 5.5, 17: 5.5}, draft_ms=0.1)
    accept(adaptive, ids, 16, 1)  # ...that accept nothing: a drafter that never pays

    def rounds_until_a_try():
        for played in range(1, 5000):
            if budget(adaptive, {i: 16 for i in ids}, batch=2) > 0:
                accept(adaptive, ids, 16, 1, rounds=1)  # the try fails
                return played
        raise AssertionError("no exploring round")

    assert [rounds_until_a_try() for _ in range(7)] == [32, 64, 128, 256, 512, 1024, 1024]
    # Trees that pay again (cheap now, and accepted) win on their merits...
    costs(adaptive, 2, {1: 5.0, 17: 5.5}, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 8, rounds=30)
    assert budget(adaptive, {i: 16 for i in ids}, batch=2) == 16
    # ... and once they fail again, exploring starts over at 32 plain rounds.
    accept(adaptive, ids, 16, 1, rounds=100)
    assert rounds_until_a_try() == 32


def test_unmeasured_tree_sizes_are_tried_then_tries_back_off():
    """Only plain rounds and 17-node trees measured, trees that never accept: each unmeasured size is tried (its
    estimate borrows a smaller size's cost, and a request's misses age away in plain rounds) until it has its own
    cost; then the tries back off as the explorations do."""
    adaptive = AdaptiveSpeculation(explore_every=32, decay=0.05)  # (the misses leave each size's gain just over MARGIN)
    ids = ["a", "b"]
    costs(adaptive, 2, {1: 5.0, 17: 5.5}, draft_ms=0.1)
    accept(adaptive, ids, 16, 1)
    gaps = []
    for _ in range(12):
        for played in range(1, 5000):
            chosen = budget(adaptive, {i: 16 for i in ids}, batch=2)
            if chosen > 0:
                break
        adaptive.costs.observe_verify(2, chosen + 1, 0.0055)  # what the try cost: as much as a 17-node tree
        adaptive.costs.observe_draft(2, chosen, 0.0001)
        accept(adaptive, ids, chosen, 1, rounds=1)  # and it accepted nothing
        gaps.append(played)
    assert all(gap < 32 for gap in gaps[:6])  # two sizes, each until settled (three samples)
    assert gaps[-5:] == [64, 128, 256, 512, 1024]


def test_a_dear_try_waits_until_it_is_a_small_share_of_the_time():
    """A try that costs many plain rounds (a DFlash drafter catching up every request's features at 64 requests:
    250 ms against 11 ms plain rounds) comes once the plain rounds since the last one have taken 1 / SHARE times
    what it costs beyond a plain round, not after explore_every rounds."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    costs(adaptive, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0}, draft_ms=250.0)
    accept(adaptive, ids, 16, 1)
    for played in range(1, 5000):
        choice = adaptive.choose({i: 16 for i in ids}, batch=64)
        if choice.budget > 0:
            break
        plain_s = choice.expected[1]
    extra_s = choice.expected[1] - plain_s  # what the try was expected to cost beyond a plain round
    assert 0.250 <= extra_s <= 0.260
    assert abs(played - extra_s / adaptive.exploration.SHARE / plain_s) <= 1
    # Drafts timed only at one request (a catch-up of one request's context) price a try at 64 requests as 64 of
    # them.
    fresh = AdaptiveSpeculation()
    costs(fresh, 1, {1: 1.7, 17: 2.0}, draft_ms=12.0)
    costs(fresh, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0}, draft_ms=None)
    assert fresh.costs.round_seconds(64, 1) == pytest.approx(0.012 + 64 * 0.012)


def test_catch_up_round_trips_price_tries_not_rounds():
    """A drafter round trip that caught a request's context up (its prompt, or the rounds it decoded plainly) is
    dearer than a steady one: it does not price steady rounds, so trees that accept well are played once tried,
    and their steady round trips then price them; it does make the next try wait longer."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.6, 17: 2.2}, draft_ms=None)
    caught_up = DraftRound({"a": DraftTree([1, 2], [-1, 0])}, round_trip_s=0.0095, catch_up=True)
    for _ in range(RecentCost.SETTLED):  # tries, each after plain rounds: 4 tokens at budget 16
        adaptive.observe(report(Choice(16), 1, {"a": (16, 4)}, verify_ms=2.2, drafts=[caught_up]))
    assert adaptive.costs.round_seconds(1, 16) == pytest.approx(0.0022)  # no steady round trip timed yet
    assert adaptive.costs.catch_up_extra(1, 16) == pytest.approx(0.0095)
    assert budget(adaptive, {"a": 16}, batch=1) > 0
    steady = DraftRound({"a": DraftTree([1, 2], [-1, 0])}, round_trip_s=0.0025)
    for _ in range(RecentCost.SETTLED):
        adaptive.observe(report(Choice(16), 1, {"a": (16, 4)}, verify_ms=2.2, drafts=[steady]))
    assert adaptive.costs.round_seconds(1, 16) == pytest.approx(0.0047)
    assert adaptive.costs.catch_up_extra(1, 16) == pytest.approx(0.0070)

    def plain_rounds_before_a_try(catch_up_ms: float | None) -> int:
        policy = AdaptiveSpeculation()
        ids = [f"r{i}" for i in range(64)]
        costs(policy, 64, {1: 11.0, 17: 20.0}, draft_ms=3.0)
        if catch_up_ms is not None:
            for _ in range(RecentCost.SETTLED):
                policy.costs.observe_draft(64, 16, catch_up_ms / 1000, catch_up=True)
        accept(policy, ids, 16, 1)  # trees that never pay: plain rounds, and now and then a try
        return next(played for played in range(1, 50_000) if budget(policy, {i: 16 for i in ids}, batch=64) > 0)

    # The cheapest try (budget 8) costs 3 ms beyond a plain round, or 250 ms where its round trip catches up: it
    # comes after explore_every plain rounds, or once they have taken 1 / SHARE times those 250 ms.
    assert plain_rounds_before_a_try(None) == 32
    assert plain_rounds_before_a_try(250.0) == pytest.approx(0.250 / Exploration.SHARE / 0.011, abs=2)


def test_a_catch_ups_draft_messages_price_the_next_try_with_its_round_trip():
    """At a batch of many requests a catch-up's Draft messages carry every request's rows since its last tree, and
    cost about what the drafter's answer does: the time from the round's start to its trees, not the round trip
    alone, is what a try costs beyond a steady round trip."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(16)]
    costs(adaptive, 16, {1: 1.5, 17: 2.5}, draft_ms=1.0)
    caught_up = DraftRound({i: DraftTree([1, 2], [-1, 0]) for i in ids}, round_trip_s=0.010, catch_up=True)
    for _ in range(RecentCost.SETTLED):
        round_ = report(Choice(16), 16, {i: (16, 2) for i in ids}, verify_ms=2.5, drafts=[caught_up])
        round_.draft_s = 0.018  # 8 ms of messages before the drafter's 10 ms answer
        adaptive.observe(round_)
    assert adaptive.costs.catch_up_extra(16, 16) == pytest.approx(0.018 - 0.001)


def test_a_lone_requests_first_tree_prices_nothing_but_in_a_batch_it_is_a_catch_up():
    """A lone request's first tree brings its prompt and is played whatever the choice: its round trip prices neither
    steady rounds nor the tries after plain rounds, which bring a few rows. In a batch, new requests join the trees
    of the others, and their prompts are a cost of playing trees there: such a round trip prices catch-ups."""
    first = DraftRound({"a": DraftTree([1, 2], [-1, 0])}, round_trip_s=0.0095, catch_up=True, prompt=True)
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.6, 17: 2.2}, draft_ms=None)
    for _ in range(RecentCost.SETTLED):
        adaptive.observe(report(Choice(16), 1, {"a": (16, 4)}, verify_ms=2.2, drafts=[first]))
    assert adaptive.costs.catch_up_extra(1, 16) == 0.0 and not adaptive.costs.draft_s[False]
    tried = DraftRound({"a": DraftTree([1, 2], [-1, 0])}, round_trip_s=0.003, catch_up=True)
    for _ in range(RecentCost.SETTLED):
        adaptive.observe(report(Choice(16), 1, {"a": (16, 4)}, verify_ms=2.2, drafts=[tried]))
    assert adaptive.costs.catch_up_extra(1, 16) == pytest.approx(0.003)
    in_a_batch = AdaptiveSpeculation()
    costs(in_a_batch, 4, {1: 1.6, 17: 2.2}, draft_ms=None)
    for _ in range(RecentCost.SETTLED):
        in_a_batch.observe(report(Choice(16), 4, {i: (16, 4) for i in "abcd"}, verify_ms=2.2, drafts=[first]))
    assert in_a_batch.costs.catch_up_extra(4, 16) == pytest.approx(0.0095)


def lookup_costs(adaptive: AdaptiveSpeculation, batch: int, draft_ms: float):
    """Round trips for prompt lookup's trees alone, at every budget."""
    for _ in range(RecentCost.SETTLED):
        for budget_step in BUDGET_STEPS:
            adaptive.costs.observe_draft(batch, budget_step, draft_ms / 1000, lookup=True)


def test_where_the_drafters_own_trees_cost_too_much_lookups_may_pay():
    """Four requests on text that copies its prompt: the drafter's own trees (a model forward: 10 ms) do not pay,
    prompt lookup's (0.2 ms) do, so rounds ask for lookup's; where the drafter offers none, rounds decode plainly."""
    ids = ["a", "b", "c", "d"]

    def policy() -> AdaptiveSpeculation:
        adaptive = AdaptiveSpeculation()
        costs(adaptive, 4, {1: 2.0, 2: 2.4, 3: 2.4, 5: 2.4, 9: 2.4, 17: 2.4}, draft_ms=10.0)
        lookup_costs(adaptive, 4, 0.2)
        accept(adaptive, ids, 16, 5)  # the drafter's own trees: 5 tokens a round at budget 16
        for _ in range(10):  # lookup's: 3
            for request_id in ids:
                adaptive.lookup_acceptance.observe(request_id, 16, 3)
        return adaptive

    choice = policy().choose({i: 16 for i in ids}, batch=4, lookup=True)
    assert choice.lookup and choice.budget == 16 and choice.label == "lookup-16"
    assert choice.expected[1] == pytest.approx(0.0026)
    assert policy().choose({i: 16 for i in ids}, batch=4).budget == 0
    # At one request the drafter's own tree pays (its draft costs 1 ms there) and wins.
    adaptive = policy()
    costs(adaptive, 1, {1: 1.5, 2: 1.9, 3: 1.9, 5: 1.9, 9: 1.9, 17: 1.9}, draft_ms=1.0)
    lookup_costs(adaptive, 1, 0.2)
    alone = adaptive.choose({"a": 16}, batch=1, lookup=True)
    assert alone.budget == 16 and not alone.lookup


def test_the_drafters_own_trees_teach_what_lookup_alone_would_accept():
    """A merged drafter's tree starts with prompt lookup's chain: how far the accepted path followed it is what
    lookup's tree would have accepted, learnt without playing one; a round of lookup's trees teaches it directly
    and leaves the drafter's own model unobserved."""
    adaptive = AdaptiveSpeculation()
    before = adaptive.lookup_acceptance.slope("a")
    for _ in range(10):  # budget 16: a chain of at most 8, all accepted; the tree's other nodes added 2 more
        adaptive.observe(RoundReport(1, Choice(16), {"a": 16}, [], forward_batch=1, largest_tree=17, requests=[
            RequestReport("a", committed=11, tree_nodes=16, accepted=10, lookup_accepted=8)], verify_s=0.002))
    learnt = adaptive.lookup_acceptance.slope("a")
    assert learnt > before and learnt == pytest.approx(8 / math.log2(9), rel=0.1)
    own = adaptive.acceptance.slope("a")
    assert own == pytest.approx(10 / math.log2(17), rel=0.1)
    for _ in range(10):  # lookup's own trees now accept nothing
        adaptive.observe(RoundReport(1, Choice(16, lookup=True), {"a": 16}, [], forward_batch=1, largest_tree=17,
                                     requests=[RequestReport("a", committed=1, tree_nodes=16, accepted=0)],
                                     verify_s=0.002))
    assert adaptive.lookup_acceptance.slope("a") < learnt / 2 and adaptive.acceptance.slope("a") == own


def test_a_lone_requests_first_tree_is_the_drafters_own():
    """It teaches both models (its lookup chain included), however well lookup's trees have done before."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.5, 17: 1.9}, draft_ms=3.0)
    lookup_costs(adaptive, 1, 0.1)
    accept(adaptive, ["old"], 16, 1)  # the drafter's own trees missed before
    for _ in range(10):
        adaptive.lookup_acceptance.observe("old", 16, 6)
    adaptive.forget("old")
    first = adaptive.choose({"new": 16}, batch=1, lookup=True)
    assert first.budget > 0 and not first.lookup


def test_a_request_catches_up_when_new_on_the_stream_or_after_plain_rounds():
    drafting = SimpleNamespace(committed_count=40, last_accepted=3)  # its last round committed 4 tokens
    assert not catches_up(36, drafting)
    assert catches_up(30, drafting)  # it also decoded plainly since it was sent
    assert catches_up(None, drafting)  # new on this stream: the item carries its prompt


def play_until_given_up(adaptive: AdaptiveSpeculation, ids: list[str], batch: int) -> int:
    """Plain rounds of `batch` requests until drafting is given up at their bucket; how many it took."""
    for rounds in range(1, 10_000):
        assert budget(adaptive, {i: 16 for i in ids}, batch=batch) == 0
        if adaptive.drafting_kept(batch) is not None:
            return rounds
    raise AssertionError("never given up")


def test_new_requests_decode_plainly_where_drafting_has_stopped_paying():
    """After give_up_after_s of rounds at a batch bucket in which drafting would not pay even were every request
    drafting, new requests joining batches of that bucket decode plainly, but for one in CANARY_EVERY; once the
    drafting ones show that it would pay for all, new requests draft again."""
    after_s = 1.0
    adaptive = AdaptiveSpeculation(give_up_after_s=after_s)
    ids = [f"r{i}" for i in range(64)]
    costs(adaptive, 64, {1: 11.0, 2: 12.0, 3: 13.0, 5: 14.0, 9: 16.0, 17: 20.0}, draft_ms=250.0)
    accept(adaptive, ids, 16, 1)  # trees accept nothing: a DFlash drafter that does not pay at 64 requests
    assert adaptive.admits_drafting(64) and adaptive.drafting_kept(64) is None
    rounds = play_until_given_up(adaptive, ids, 64)
    assert abs(rounds * 0.011 - after_s) < 0.011 * (AdaptiveSpeculation.REUSE_PLAIN + 1)
    every = CANARY_EVERY
    assert [adaptive.admits_drafting(60) for _ in range(2 * every)] == ([False] * (every - 1) + [True]) * 2
    assert adaptive.admits_drafting(3)  # another batch bucket: nothing said against drafting there
    # Running requests of such a batch stop drafting too, but for one in CANARY_EVERY (at least one).
    assert adaptive.drafting_kept(64) == 64 // every and adaptive.drafting_kept(40) == 40 // every
    assert adaptive.drafting_kept(3) is None
    costs(adaptive, 4, {1: 11.0, 17: 20.0}, draft_ms=250.0)
    play_until_given_up(adaptive, ids[:4], 4)
    assert adaptive.drafting_kept(3) == 1
    # Four requests still draft (canaries), and their trees now accept well: were everyone drafting, it would pay.
    costs(adaptive, 64, {1: 11.0, 2: 11.2, 3: 11.4, 5: 11.6, 9: 12.0, 17: 13.0}, draft_ms=1.0,
          samples=RecentCost.WINDOW)
    accept(adaptive, ids[:4], 16, 9, rounds=20)
    adaptive.choose({i: 16 for i in ids[:4]}, batch=64)
    assert adaptive.admits_drafting(64) and adaptive.drafting_kept(64) is None


def test_a_lone_request_is_never_given_up():
    """Drafting is given up from two requests up but not for one request alone, however long drafting has not paid
    there: a lone request's drafting costs no one else."""
    adaptive = AdaptiveSpeculation(give_up_after_s=0.0)  # given up everywhere from the start
    assert adaptive.drafting_kept(1) is None and adaptive.drafting_kept(2) == 1
    assert all(adaptive.admits_drafting(1) for _ in range(2 * CANARY_EVERY))
    assert not adaptive.admits_drafting(2)


def test_a_lone_request_drafts_its_first_tree_whatever_the_requests_before_it_did():
    """At one request, a request that has drafted no tree yet tries one even where the requests before it say trees
    do not pay: one that accepts well goes on drafting on its merits, one that misses decodes plainly. With two
    requests running, a new one gets no such try (it would cost the other request's time)."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.5, **{step + 1: 3.0 for step in BUDGET_STEPS}}, draft_ms=2.0)
    accept(adaptive, ["before"], 32, 1, rounds=30)  # the requests before missed every time
    adaptive.forget("before")
    assert budget(adaptive, {"before-too": 32}, batch=1) > 0  # a new id: its own try

    def rounds_of(request_id: str, tokens: int, count: int = 8) -> list[int]:
        played = []
        for _ in range(count):
            choice = adaptive.choose({request_id: 32}, batch=1)
            nodes = min(choice.budget, 32)
            adaptive.observe(report(choice, 1, {request_id: (nodes, tokens if nodes else 1)}, verify_ms=3.0))
            played.append(choice.budget)
        adaptive.forget(request_id)
        return played

    copies = rounds_of("copies", tokens=12)
    assert copies[0] > 0 and all(copies[1:]), copies  # tried, then drafted on its merits
    accept(adaptive, ["before"], 32, 1, rounds=60)  # misses again since
    adaptive.forget("before")
    misses = rounds_of("misses", tokens=1)
    assert misses[0] > 0 and not any(misses[1:]), misses  # tried once, then plain
    accept(adaptive, ["running"], 32, 1, rounds=30)
    assert budget(adaptive, {"running": 32, "new": 32}, batch=2) == 0


def test_a_stretch_of_misses_does_not_stop_trees_that_pay_on_average():
    # An n-gram drafter on code, one request: a plain round 1.9 ms, 17 nodes 2.3 ms, the drafter's round trip
    # 0.9 ms. Break-even is 1.68 tokens a round at budget 16.
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 1.9, 17: 2.3}, draft_ms=0.9)
    accept(adaptive, ["a"], 16, 5)  # a copied stretch: 5 tokens a round
    accept(adaptive, ["a"], 16, 1)  # then ten misses: 2.8 tokens a round over the twenty
    assert budget(adaptive, {"a": 16}, batch=1) == 16
    accept(adaptive, ["a"], 16, 1, rounds=40)  # misses for long: below break-even, once the tree's run is over
    runs = AdaptiveSpeculation.REUSE_LONE_TREE
    assert [budget(adaptive, {"a": 16}, batch=1) for _ in range(runs + 1)] == [16] * runs + [0]


def test_a_lone_requests_tree_decision_stands_for_a_run_of_rounds():
    """A lone request's tree chosen on its merits is played for REUSE_LONE_TREE more rounds, whatever they accept,
    as a fixed budget plays it (a tree after plain rounds costs more than a steady one, and the choice's own work is
    a visible part of a round), then worked out again; a new request's first try, or a second request, ends the run
    at once, and in a batch each tree is worked out anew."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {**{step + 1: 1.5 for step in BUDGET_STEPS}, 1: 1.1}, draft_ms=0.9)
    accept(adaptive, ["a"], 32, 4, rounds=30)
    first = adaptive.choose({"a": 32}, batch=1)
    assert first.budget == 32 and adaptive.worked_out == 1
    played = []
    for _ in range(AdaptiveSpeculation.REUSE_LONE_TREE + 1):
        choice = adaptive.choose({"a": 32}, batch=1)
        adaptive.observe(report(choice, 1, {"a": (choice.budget, 1)}, verify_ms=1.5,
                                drafts=[DraftRound({"a": None}, round_trip_s=0.0009)] if choice.budget else []))
        played.append(choice.budget)
    # misses throughout: the run plays on, and the choice worked out after it decodes plainly
    assert played == [32] * AdaptiveSpeculation.REUSE_LONE_TREE + [0], played
    assert adaptive.worked_out == 2
    assert adaptive.choose({"a": 32}, batch=1).estimated_s is None
    # a new request's first try is its own choice, not the run's
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {**{step + 1: 1.5 for step in BUDGET_STEPS}, 1: 1.1}, draft_ms=0.9)
    accept(adaptive, ["a"], 32, 4, rounds=30)
    adaptive.choose({"a": 32}, batch=1)
    adaptive.forget("a")
    adaptive.choose({"b": 32}, batch=1)
    assert adaptive.worked_out == 2
    # in a batch, every tree decision is worked out
    costs(adaptive, 2, {**{step + 1: 1.5 for step in BUDGET_STEPS}, 1: 1.1}, draft_ms=0.9)
    accept(adaptive, ["b", "c"], 32, 4, rounds=30)
    for _ in range(3):
        assert adaptive.choose({"b": 32, "c": 32}, batch=2).budget > 0
    assert adaptive.worked_out == 5


def test_a_lone_requests_tree_tried_after_plain_rounds_runs_and_prices_its_steady_rounds_anew():
    """A tree tried after plain rounds (Exploration) stands for a run at one request, as one chosen on its merits
    does: the try is a catch-up, which prices no steady round, so a stale steady cost (here the drafter's round
    trips last measured slow) would keep trees out for good. The run's steady rounds price them anew, and trees that
    pay are then chosen on their merits."""
    adaptive = AdaptiveSpeculation(explore_every=32)
    # Plain rounds 1.1 ms, a verification of any tree 1.4, the drafter's steady round trips last read 2.0 ms: three
    # tokens a round for 3.4 ms is below plain decoding's tokens a second, for 2.2 ms well above.
    costs(adaptive, 1, {**{step + 1: 1.4 for step in BUDGET_STEPS}, 1: 1.1}, draft_ms=2.0, samples=RecentCost.WINDOW)
    accept(adaptive, ["a"], 32, 3, rounds=60)
    played = []
    for _ in range(400):
        choice = adaptive.choose({"a": 32}, batch=1)
        if choice.budget:
            catch_up = played[-1:] == [0]
            drafts = [DraftRound({"a": None}, round_trip_s=0.0016 if catch_up else 0.0008, catch_up=catch_up)]
            adaptive.observe(report(choice, 1, {"a": (choice.budget, 3)}, verify_ms=1.4, drafts=drafts))
        else:
            adaptive.observe(report(choice, 1, {"a": (0, 1)}, verify_ms=1.1))
        played.append(choice.budget)
    tried = played.index(32)
    assert tried >= 32 and set(played[:tried]) == {0}  # plain, until a try is due
    runs = AdaptiveSpeculation.REUSE_LONE_TREE
    assert played[tried:tried + 1 + runs] == [32] * (1 + runs)  # the try and its run
    assert set(played[tried + 1 + runs:]) == {32}  # then trees on their merits, priced by the run's rounds


def test_a_lone_request_on_trees_weighs_the_catch_up_that_leaving_them_costs():
    """A lone request's trees that read a little below plain decoding's tokens a second are left for plain rounds,
    unless the catch-up that trees cost when they return (here measured at 2 ms beyond a steady round trip, spread
    over the rounds a plain decision stands for) takes more than the plain stretch saves: then their size stays."""
    def after_a_run_of_trees(catch_up_ms: float | None) -> list[int]:
        adaptive = AdaptiveSpeculation()
        # Plain rounds 1.0 ms; trees 1.2 ms to verify plus 1.0 ms of drafting.
        costs(adaptive, 1, {**{step + 1: 1.2 for step in BUDGET_STEPS}, 1: 1.0}, draft_ms=1.0)
        if catch_up_ms is not None:
            for _ in range(RecentCost.SETTLED):
                adaptive.costs.observe_draft(1, 32, catch_up_ms / 1000, catch_up=True)
        accept(adaptive, ["a"], 32, 4)
        played = [budget(adaptive, {"a": 32}, batch=1)]
        # Now about 2 tokens a round: 0.91 tokens a ms from trees against 1.0 from plain rounds, 0.82 with the
        # catch-up spread over them.
        accept(adaptive, ["a"], 32, 2, rounds=200)
        played += [budget(adaptive, {"a": 32}, batch=1) for _ in range(AdaptiveSpeculation.REUSE_LONE_TREE + 1)]
        return played

    runs = AdaptiveSpeculation.REUSE_LONE_TREE
    assert after_a_run_of_trees(None) == [32] * (1 + runs) + [0]  # no catch-up measured: plain
    assert after_a_run_of_trees(1.5) == [32] * (1 + runs) + [0]  # 0.5 ms beyond a steady trip: still plain
    assert after_a_run_of_trees(3.0) == [32] * (2 + runs)  # 2 ms beyond: trees stay


def test_a_requests_misses_fade_in_its_plain_rounds():
    """Acceptance comes in runs (a stretch copied from the prompt, then misses): a request that has just missed a
    few times is tried again within a few plain rounds, once its own evidence has aged towards what all requests'
    trees accept (PLAIN_AGING), not only when exploring comes round."""
    def rounds_until_a_tree(aging: float) -> int:
        adaptive = type("Aging", (AdaptiveSpeculation,), {"PLAIN_AGING": aging})(explore_every=32)
        # One request, a small target: a plain round 1.83 ms, trees 2.75-3.10, the drafter 0.72.
        costs(adaptive, 1, {1: 1.83, 2: 2.75, 3: 2.75, 5: 2.82, 9: 2.97, 17: 3.10}, draft_ms=0.72)
        accept(adaptive, [f"earlier-{i}" for i in range(8)], 16, 4)  # earlier requests: 4 tokens a round
        accept(adaptive, ["a"], 16, 1, rounds=6)  # this one has just missed six times
        for played in range(1, 1000):
            if budget(adaptive, {"a": 16}, batch=1) > 0:
                return played
        raise AssertionError("no tree")

    assert rounds_until_a_tree(AdaptiveSpeculation.PLAIN_AGING) <= AdaptiveSpeculation.REUSE_PLAIN + 2
    assert rounds_until_a_tree(0.0) >= 32  # without aging: only a try


def test_a_batch_size_without_drafts_borrows_the_nearest_drafting_cost():
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(32)]
    costs(adaptive, 16, {1: 4.0, 17: 5.0}, draft_ms=20.0)  # drafts timed at 16 requests: 20 ms
    costs(adaptive, 32, {1: 5.0, 17: 6.0}, draft_ms=None)  # 32 requests: verification timed, drafts never
    accept(adaptive, ids, 16, 2)  # about 2 tokens a round at budget 16
    # With free drafts, 64 tokens in 6 ms would beat 32 in 5 ms; with 16 requests' 20 ms they do not.
    assert budget(adaptive, {i: 16 for i in ids}, batch=32) == 0
    fresh = AdaptiveSpeculation()  # no draft ever timed: the first tree is tried
    costs(fresh, 32, {1: 5.0, 17: 6.0}, draft_ms=None)
    accept(fresh, ids, 16, 2)
    assert budget(fresh, {i: 16 for i in ids}, batch=32) > 0


def test_batch_sizes_in_one_graph_bucket_share_their_costs():
    """A batch of 50 runs in the 64-request graph, as a batch of 40 does: its costs are known from 40's rounds,
    so it is judged (plain here: trees do not pay) rather than tried as unmeasured."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 40, {1: 10.0, 17: 30.0}, draft_ms=20.0)
    assert adaptive.costs.round_seconds(50, 0) == pytest.approx(0.010)
    assert adaptive.costs.round_seconds(64, 16) == pytest.approx(0.050)
    assert adaptive.costs.round_seconds(65, 0) is None  # the 128-request graph: not measured
    ids = [f"r{i}" for i in range(50)]
    accept(adaptive, ids, 16, 2)
    assert budget(adaptive, {i: 16 for i in ids}, batch=50) == 0


def test_a_plain_decision_is_reused_for_a_few_rounds_of_the_same_batch_bucket():
    """Plain rounds observe no acceptance, so a plain choice stands for REUSE_PLAIN more rounds of the same batch
    bucket (cheaper rounds, though requests join or leave, speculating or not); then, or at once for another batch
    bucket, it is worked out again."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(4)]
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    costs(adaptive, 8, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 1)  # trees accept nothing: plain
    asked = {i: 16 for i in ids}
    assert budget(adaptive, asked, batch=4) == 0
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)  # drafts free now...
    accept(adaptive, ids, 16, 6)  # ...and trees accept a lot
    assert budget(adaptive, asked, batch=3) == 0  # a request left, one that decodes plainly: the same bucket
    assert budget(adaptive, {i: 16 for i in ids[:3]}, batch=4) == 0  # a speculating one left: the same bucket too
    assert [budget(adaptive, asked, batch=4) for _ in range(AdaptiveSpeculation.REUSE_PLAIN - 1)][-1] > 0
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    costs(adaptive, 8, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 1)
    assert budget(adaptive, asked, batch=4) == 0
    accept(adaptive, ids, 16, 6)
    assert budget(adaptive, asked, batch=5) > 0  # another batch bucket, where drafts are free: worked out at once
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    accept(adaptive, ids, 16, 1)
    assert budget(adaptive, asked, batch=4) == 0
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.0, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 6)
    choices = [budget(adaptive, asked, batch=4) for _ in range(AdaptiveSpeculation.REUSE_PLAIN + 1)]
    assert choices[:-1] == [0] * AdaptiveSpeculation.REUSE_PLAIN and choices[-1] > 0, choices


def test_each_choice_says_what_it_expects_of_its_round():
    """What a choice expects of its round, which the verifier checks against the round: plain decoding one token a
    request in a plain round's time (a reused plain decision too), a tree its expected drafted tokens on top in the
    tree's round time; nothing before plain rounds are measured."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(4)]
    asked = {i: 16 for i in ids}
    assert adaptive.choose(asked, batch=4) == Choice(0)  # plain rounds are measured first: no estimate
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=10.0)
    accept(adaptive, ids, 16, 1)
    for _ in range(1 + AdaptiveSpeculation.REUSE_PLAIN):  # worked out, then reused as long as it stands
        choice = adaptive.choose(asked, batch=4)
        assert choice.budget == 0 and choice.expected == (4.0, pytest.approx(0.002))
        assert choice.expected_drafted is None  # nothing for the round's trees to be checked against
    costs(adaptive, 4, {1: 2.0, 17: 2.5}, draft_ms=0.5, samples=RecentCost.WINDOW)
    accept(adaptive, ids, 16, 6)
    drafting = ids[:3]
    choice = adaptive.choose({i: 16 for i in drafting}, batch=4)  # the plain decision's run over: worked out anew
    assert choice.budget > 0
    tokens, seconds = choice.expected
    drafted = sum(adaptive.acceptance.expected_tokens(i, choice.budget) - 1 for i in drafting)
    assert tokens == pytest.approx(4 + drafted) and choice.expected_drafted == pytest.approx(drafted)
    assert seconds == pytest.approx(adaptive.costs.round_seconds(4, choice.budget))


def test_graph_timings_price_unsettled_trees_on_top_of_measured_rounds():
    # Say a graph's replay alone is a fraction of a round (0.5 ms of a 2 ms plain round: the rest is host work). An
    # unsettled 17-node bucket costs the plain round plus the graphs' difference, not its bare replay.
    adaptive = AdaptiveSpeculation()
    for nodes, ms in {1: 0.5, 17: 0.7, 129: 2.0}.items():
        adaptive.costs.observe_graph(1, nodes, ms / 1000)
    costs(adaptive, 1, {1: 2.0}, draft_ms=1.0)
    assert adaptive.costs.round_seconds(1, 16) == pytest.approx((2.0 + 0.2 + 1.0) / 1000)
    assert adaptive.costs.round_seconds(1, 128) == pytest.approx((2.0 + 1.5 + 1.0) / 1000)
    # Trees that break even against that price are not taken on the bare replay's promise.
    accept(adaptive, ["a"], 16, 1, rounds=40)  # nothing accepted: trees never pay
    assert budget(adaptive, {"a": 16}, batch=1) == 0
    # Once the bucket's own rounds settle, they are its cost.
    costs(adaptive, 1, {17: 2.6}, draft_ms=1.0)
    assert adaptive.costs.round_seconds(1, 16) == pytest.approx((2.6 + 1.0) / 1000)


def test_a_round_emits_at_most_its_budget_plus_one():
    adaptive = AdaptiveSpeculation()
    accept(adaptive, ["a"], 4, 5)  # every drafted token accepted: a slope above 1
    assert adaptive.acceptance.slope("a") > 1.5
    expected_tokens = adaptive.acceptance.expected_tokens
    assert expected_tokens("a", 1) == 2.0 and 4.5 < expected_tokens("a", 4) <= 5.0


def test_bounds_and_own_budgets_cap_the_choice():
    adaptive = AdaptiveSpeculation(min_budget=2, max_budget=8)
    costs(adaptive, 1, {1: 5.0, 3: 5.0, 5: 5.0, 9: 5.0})  # trees cost nothing extra: the largest allowed wins
    accept(adaptive, ["a"], 8, 4)
    assert budget(adaptive, {"a": 64}, batch=1) == 8
    assert budget(adaptive, {"a": 4}, batch=1) == 4  # the request's own budget
    # Each request drafts the round's budget or its own, whichever is smaller.
    budgets, choice = adaptive.round_budgets({"a": 64, "b": 2}, batch=2)
    assert choice.budget == 8 and budgets == {"a": 8, "b": 2}
    costs(adaptive, 1, {3: 50.0, 5: 100.0, 9: 200.0})  # trees now cost 10x and more: the minimum, not plain
    assert budget(adaptive, {"a": 64}, batch=1) == 2
    with pytest.raises(ValueError, match="0 <= min <= max"):
        AdaptiveSpeculation(min_budget=9, max_budget=8)


def test_a_plain_choice_asks_no_drafter_for_a_tree():
    adaptive = AdaptiveSpeculation()
    assert adaptive.round_budgets({}, batch=3) == ({}, None)  # no request can draft: nothing chosen
    budgets, choice = adaptive.round_budgets({"a": 16, "b": 8}, batch=2)  # plain rounds not measured yet
    assert choice.budget == 0 and budgets == {}


def test_unmeasured_sizes_are_tried_before_judged():
    adaptive = AdaptiveSpeculation(min_budget=1)
    assert budget(adaptive, {"a": 16}, batch=1) == 16  # nothing measured, plain not allowed: as asked, and learn
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 5.0, 17: 6.0})
    accept(adaptive, ["a"], 16, 3)
    # Budget 32 (33 nodes) is unmeasured: it costs what 17 nodes cost until tried, so it is tried.
    assert budget(adaptive, {"a": 32}, batch=1) == 32


def test_one_slow_round_does_not_condemn_a_tree_size():
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 1, {1: 5.0, 17: 6.0})
    accept(adaptive, ["a"], 16, 4)
    adaptive.costs.observe_verify(1, 17, 1.5)  # a 1.5 s hiccup among 6 ms rounds
    assert budget(adaptive, {"a": 16}, batch=1) == 16
    fresh = AdaptiveSpeculation()  # a first sample that was slow is retried before it is believed
    costs(fresh, 1, {1: 5.0})
    fresh.costs.observe_verify(1, 17, 1.5)
    accept(fresh, ["a"], 16, 4)
    assert budget(fresh, {"a": 16}, batch=1) == 16


def test_a_request_with_poor_acceptance_does_not_drag_the_rest():
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 2, {1: 5.0, 2: 5.2, 3: 5.3, 5: 5.4, 9: 5.6, 17: 6.0})
    accept(adaptive, ["good"], 16, 5)
    accept(adaptive, ["poor"], 16, 1)
    assert budget(adaptive, {"good": 16, "poor": 16}, batch=2) > 0
    # A request that left is forgotten: its own evidence no longer counts, as for a request never seen.
    assert adaptive.acceptance.slope("good") > adaptive.acceptance.slope("new")
    adaptive.forget("good")
    assert adaptive.acceptance.slope("good") == adaptive.acceptance.slope("new")


def test_plain_rounds_age_each_requests_evidence_as_if_one_by_one():
    """AcceptanceModel.age costs a plain round no step per request: each request's slope is aged when next read,
    by every plain round since, as it would have been round by round; and its evidence after the ageing counts in
    full."""
    model, reference = AcceptanceModel(), DecayingRatio(AcceptanceModel.DECAY)
    for step in [("tree", 16, 4), ("plain",), ("plain",), ("tree", 8, 1), ("plain",), ("tree", 32, 6), ("plain",)]:
        if step[0] == "plain":
            model.age(0.5)
            reference.age(0.5)
        else:
            model.observe("a", step[1], step[2])
            reference.add(step[2] - 1, math.log2(1 + step[1]))
    overall = model.overall_slope()
    assert model.slope("a", overall) == pytest.approx(reference.value(overall, model.PRIOR_WEIGHT))
    model.age(0.5)
    model.forget("a")
    assert model.slope("a") == model.overall_slope()  # forgotten: no ageing owed


def test_plain_rounds_are_measured_before_trees_are_judged_against_them():
    """Priced like the nearest measured bucket, a larger tree's, plain decoding could never win: a server whose
    requests all speculate from the start would never stop speculating."""
    adaptive = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(8)]
    costs(adaptive, 8, {17: 20.0}, draft_ms=5.0)  # only trees measured so far
    accept(adaptive, ids, 16, 2)  # 2 tokens a round: more than plain rounds at a tree's price would give
    assert budget(adaptive, {i: 16 for i in ids}, batch=8) == 0
    costs(adaptive, 8, {1: 5.0}, draft_ms=5.0)
    assert [budget(adaptive, {i: 16 for i in ids}, batch=8) for _ in range(20)] == [0] * 20
    assert budget(adaptive, {i: 16 for i in ids}, batch=16) == 0  # another batch bucket: its plain rounds first


def test_round_reports_teach_the_costs_and_the_acceptance():
    """A round's report teaches what its trees accepted, what its drafter's round trip took, and what its
    verification took beside that wait; a round that prefilled a prompt teaches no verification cost."""
    adaptive = AdaptiveSpeculation()
    trip = DraftRound({"a": DraftTree([1, 2], [-1, 0])}, propose_s=0.0005, round_trip_s=0.001)
    for _ in range(RecentCost.SETTLED):
        adaptive.observe(report(None, 1, {"a": (0, 1)}, verify_ms=5.0))  # plain
        adaptive.observe(report(Choice(16), 1, {"a": (16, 5)}, verify_ms=6.0, drafts=[trip]))
        adaptive.observe(report(None, 1, {"b": (0, 1)}, verify_ms=50.0, prompts=True))
    assert adaptive.costs.round_seconds(1, 0) == pytest.approx(0.005)
    assert adaptive.costs.round_seconds(1, 16) == pytest.approx(0.006 + 0.001)
    assert adaptive.acceptance.slope("a") > adaptive.acceptance.slope("b")  # "a" accepted 4 of 16, three times


def test_rounds_that_realize_less_than_expected_scale_the_model_down():
    """Requests whose slopes promise more than their rounds emit (new requests on the all-request slope, say):
    once a few rounds have shown it, the model's drafted tokens are scaled by what rounds realized, and plain
    decoding wins; where rounds realize what was expected, speculation goes on."""
    tree_costs = {1: 5.0, 2: 5.3, 3: 5.6, 5: 6.0, 9: 6.7, 17: 7.5}
    ids = [f"r{i}" for i in range(8)]

    def played(committed: list[int]) -> list[int]:
        """The budgets of rounds whose trees commit these tokens per request (a plain round: one each)."""
        adaptive = AdaptiveSpeculation()
        costs(adaptive, 8, tree_costs, draft_ms=0.5)  # at 16: break-even at 1.6 tokens a request and round
        accept(adaptive, ids, 16, 5)  # the slopes say 5 tokens a round
        choices = []
        for _ in range(2 * Calibration.SETTLED):
            choice = adaptive.choose({i: 16 for i in ids}, batch=8)
            choices.append(choice.budget)
            requests = {i: (choice.budget, tokens) if choice.budget else (0, 1) for i, tokens in zip(ids, committed)}
            adaptive.observe(report(choice, 8, requests, tree_costs[tree_bucket_of(choice.budget)]))
        return choices

    assert played([2, 2, 1, 1, 1, 1, 1, 1]) == [16] * Calibration.SETTLED + [0] * Calibration.SETTLED
    assert played([4] * 8) == [16] * (2 * Calibration.SETTLED)


def test_expected_drafts_sum_every_requests_expected_tokens():
    """ExpectedDrafts, which prices each budget without a pass over the requests, gives what summing each request's
    tokens_per_round would: slopes low and high (capped at budget + 1 tokens), own budgets below the round's."""
    rng = random.Random(3)
    for _ in range(50):
        slopes = [(rng.choice([0.0, rng.uniform(0, 1), rng.uniform(1, 12)]), rng.choice([0, 1, 4, 16, 32, 128]))
                  for _ in range(rng.randint(1, 70))]
        expected = ExpectedDrafts(slopes)
        for budget_step in (0,) + BUDGET_STEPS:
            want = sum(tokens_per_round(slope, min(budget_step, own)) - 1 for slope, own in slopes)
            assert expected.at(budget_step) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_tree_rounds_that_catch_up_dearer_than_estimated_make_trees_after_plain_rounds_dearer():
    """Where tree rounds chosen on their merits after plain rounds take longer than the costs estimated (each
    catches every request's drafter context up, which steady costs leave out), trees after plain rounds at that
    batch bucket are priced by what such rounds took, and plain decoding goes on there. Trees after trees are steady
    rounds, priced as measured: after a try has caught the contexts up, trees that pay are played again."""
    tree_costs = {1: 5.0, 2: 5.3, 3: 5.6, 5: 6.0, 9: 6.7, 17: 7.5}
    good = {f"g{i}": 16 for i in range(8)}  # 3 tokens a round at budget 16: 1.7x plain decoding's tokens a second
    # 1 token a round: plain decoding. Their trees are smaller than the good ones' so that the good requests' choice
    # is worked out anew, not the poor ones' plain decision standing (REUSE_PLAIN).
    poor = {f"p{i}": 8 for i in range(7)}

    def trees(asked: dict[str, int], round_trip_ms: float) -> list[DraftRound]:
        return [DraftRound({i: DraftTree([1, 2], [-1, 0]) for i in asked}, round_trip_s=round_trip_ms / 1000,
                           catch_up=round_trip_ms > 1)]

    def policy(batch: int) -> AdaptiveSpeculation:
        adaptive = AdaptiveSpeculation()
        costs(adaptive, batch, tree_costs, draft_ms=0.5)
        accept(adaptive, good, 16, 3)
        return adaptive

    def catch_ups(adaptive: AdaptiveSpeculation, batch: int, catch_up_ms: float) -> list[int]:
        """The budgets of tree choices that each follow a plain round, and take `catch_up_ms` to draft."""
        played = []
        for _ in range(2 * Calibration.SETTLED):
            accept(adaptive, poor, 8, 1, rounds=100)  # requests whose trees keep missing: a plain round
            assert adaptive.choose(poor, batch=batch).budget == 0
            choice = adaptive.choose(good, batch=batch)
            played.append(choice.budget)
            if choice.budget:
                assert choice.estimated_s is not None
                adaptive.observe(report(choice, batch, {i: (16, 3) for i in good}, tree_costs[17],
                                        trees(good, catch_up_ms)))
        return played

    adaptive = policy(8)
    assert catch_ups(adaptive, 8, catch_up_ms=20.0) == [16] * Calibration.SETTLED + [0] * Calibration.SETTLED
    assert adaptive.costs.tree_factor(8) > 2
    assert catch_ups(policy(8), 8, catch_up_ms=0.5) == [16] * (2 * Calibration.SETTLED)
    assert catch_ups(policy(1), 1, catch_up_ms=20.0) == [16] * (2 * Calibration.SETTLED)  # a lone request: tries
    # A try (every so many plain rounds) catches the contexts up; it teaches no factor, and trees go on after it.
    try_choice = next(choice for _ in range(1000) if (choice := adaptive.choose(good, batch=8)).budget)
    assert try_choice.estimated_s is None
    adaptive.observe(report(try_choice, 8, {i: (16, 3) for i in good}, tree_costs[17], trees(good, 20.0)))
    steady = adaptive.choose(good, batch=8)
    assert steady.budget == 16 and steady.estimated_s is None


def tree_bucket_of(budget: int) -> int:
    return next(nodes for nodes in (1, 2, 3, 5, 9, 17) if nodes >= budget + 1)


def test_the_check_of_expected_drafts_is_by_batch_bucket():
    """What speculative rounds drafted over what the choice expected: per batch bucket, 1 until a few rounds are
    seen, nothing learnt from a round that no tree reached (its drafter was down)."""
    adaptive = AdaptiveSpeculation()
    costs(adaptive, 8, {1: 5.0, 2: 5.3, 3: 5.6, 5: 6.0, 9: 6.7, 17: 7.5})
    accept(adaptive, ["a"], 16, 9)
    others = {f"r{i}": (0, 1) for i in range(7)}  # seven requests decode plainly
    choice = adaptive.choose({"a": 16}, batch=8)
    assert choice.budget > 0
    assert adaptive.observe(report(choice, 8, {"a": (0, 1), **others}, verify_ms=5.0)) is None
    assert adaptive.acceptance.calibration_factor(8) == 1.0
    expected = []
    for played in range(Calibration.SETTLED):
        choice = adaptive.choose({"a": 16}, batch=8)  # one request speculates
        assert choice.budget > 0
        expected.append(choice.expected_drafted)
        batch, factor = adaptive.observe(report(choice, 8, {"a": (choice.budget, 2), **others}, verify_ms=7.5))
        assert batch == 8 and (factor == 1.0) == (played < Calibration.SETTLED - 1)  # 1 drafted token realized
    weights = [(1 - Calibration.DECAY) ** (len(expected) - 1 - i) for i in range(len(expected))]
    assert factor == pytest.approx(sum(weights) / sum(w * e for w, e in zip(weights, expected)))
    assert adaptive.acceptance.calibration_factor(5) == factor and adaptive.acceptance.calibration_factor(16) == 1.0
    assert adaptive.observe(report(Choice(0), 8, {"a": (0, 1), **others}, verify_ms=5.0)) is None  # plain


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
        assert sum(chosen.values()) > 0 and set(chosen) <= {str(step) for step in (0, *BUDGET_STEPS)}
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
        # Of what they took: the wait on the drafters (none in plain rounds) and the verification, within it.
        assert all(0 < figures["verify_ms"] and figures["drafters_ms"] + figures["verify_ms"] <= figures["realized_ms"]
                   for figures in checked.values())
        assert all(figures["drafters_ms"] == 0 for label, figures in checked.items() if label == "0")
        assert speculative["identical_to_plain"] == "4/4"
    finally:
        services.stack.stop(grace_s=1)
