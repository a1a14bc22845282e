"""Adaptive speculation: each round, the tree budget that maximises expected tokens per second.

A round costs the drafter's round trip (nothing when no request drafts) plus one verification with the host's work
around it, whose cost depends on the batch and on the largest tree in it (the padded bucket it runs in): the
`CostModel`, learnt from the rounds. A request emits, in expectation, 1 + s * log2(1 + b) tokens with a budget of
b: one bonus token always, plus accepted drafts that grow about logarithmically with the tree (each doubling of a
best-first tree adds roughly the same depth), and at most b + 1. The `AcceptanceModel` learns each request's slope s
from what its trees accepted.

The choice (`AdaptiveSpeculation`) is one budget T for the round (0: plain decoding, no drafter call): each
speculating request drafts min(T, its own budget), and

    T = argmax  (batch + c(batch) * sum_i (E_i(min(T, budget_i)) - 1))
                / (draft_time(batch, T) + verify_time(batch, T + 1 nodes)),

plain decoding (T = 0) kept unless the best tree promises MARGIN times its tokens a second (in a batch; a lone
request's, LONE_MARGIN). c(batch) scales the acceptance model by what speculative rounds at that batch bucket really
drafted over what it expected of them. At a batch of more than one request, a tree round after plain rounds (which
catches every request's drafter context up) is priced the same way, by what such rounds took there over their
estimates. A decision stands for a few rounds: a plain one in any batch (REUSE_PLAIN), a lone request's tree too
(REUSE_LONE_TREE), whose trees then run as a fixed budget's do until a run's end finds they no longer pay, even
counting the catch-up that leaving them costs when they return.

A drafter that also drafts by prompt lookup alone (the merged drafter: `DrafterLink.lookup_trees`) offers each
budget twice: its own tree, or lookup's, which costs no model forward and so can pay at batches where the
drafter's own does not (a larger batch on text that copies its prompt). Lookup's acceptance is a model of its own,
learnt from its rounds and from how far the accepted paths of the drafter's own trees followed their lookup chains
(`RequestReport.lookup_accepted`); its draft costs are timed apart, its verifications cost what any tree of their
size costs.

Plain decoding stays a candidate in every round, so where verification turns compute-bound (large batches),
speculation switches itself off rather than costing throughput. Since acceptance is learnt only from trees, a tree
is tried again now and then (`Exploration`), and a lone request drafts its first tree whatever the requests before
it accepted: how well trees do varies from request to request more than within one. Where drafting has not paid
for a while even were every request drafting, new requests decode plainly and running ones stop drafting, but for
a few that keep it tried (`GiveUp`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import logging
import math

from treeserve.tree import MAX_BUDGET
from treeserve.verifier.graphs import TREE_BUCKETS
from treeserve.verifier.round import Choice, RoundReport

log = logging.getLogger("treeserve.verifier")

# Budgets the choice ranges over: 0 and each tree bucket's (nodes - 1).
BUDGET_STEPS = tuple(nodes - 1 for nodes in TREE_BUCKETS)


class RecentCost:
    """The median of the last few samples: one slow round (a first call, a hiccup of the host) does not set a
    bucket's cost. A cost from fewer than SETTLED samples is not trusted yet."""

    WINDOW, SETTLED = 8, 3

    def __init__(self):
        self.samples: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.value = 0.0  # the median, kept up to date: every round reads it many times

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        ordered, middle = sorted(self.samples), len(self.samples) // 2  # (statistics.median: several times slower)
        self.value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    @property
    def settled(self) -> bool:
        return len(self.samples) >= self.SETTLED


class DecayingRatio:
    """A ratio of decaying sums: each observation weighs `1 - decay` times the one after it, so the ratio follows
    what changes over a few dozen observations, and a burst moves it no more than its share of the sums."""

    def __init__(self, decay: float):
        self.decay, self.numerator, self.denominator, self.count = decay, 0.0, 0.0, 0

    def add(self, numerator: float, denominator: float) -> None:
        self.numerator = self.numerator * (1 - self.decay) + numerator
        self.denominator = self.denominator * (1 - self.decay) + denominator
        self.count += 1

    def value(self, prior: float, prior_weight: float) -> float:
        """The ratio, with `prior` counted as `prior_weight` of denominator already observed."""
        return (self.numerator + prior * prior_weight) / (self.denominator + prior_weight)

    def age(self, share: float) -> None:
        """What was observed counts `share` less, with nothing new observed: against a prior, the value moves
        towards it."""
        self.numerator *= 1 - share
        self.denominator *= 1 - share


class Calibration(DecayingRatio):
    """What speculative rounds of one batch bucket realized over what the models expected of them: tokens beyond
    one per request (AcceptanceModel), or seconds (CostModel.tree_factor)."""

    DECAY, SETTLED = 0.02, 3

    def __init__(self):
        super().__init__(self.DECAY)

    @property
    def factor(self) -> float:
        """Realized over expected drafted tokens; 1 until SETTLED rounds are seen."""
        if self.count < self.SETTLED or self.denominator <= 0:
            return 1.0
        return self.numerator / self.denominator


def tokens_per_round(slope: float, budget: int) -> float:
    """A request's expected tokens from a round at this budget: 1 + slope * log2(1 + budget), at most budget + 1
    (1 without a tree)."""
    if budget < 1:
        return 1.0
    return min(1.0 + budget, 1.0 + slope * math.log2(1 + budget))


class ExpectedDrafts:
    """The tokens beyond one a round's trees are expected to add over requests of these (slope, own budget): at
    round budget T, the sum of tokens_per_round(slope, min(T, own)) - 1. Each own budget's slopes are sorted once
    with their running sums, so that the choice prices each candidate budget in a bisection, not a pass over the
    requests: at a batch of many requests a choice comes every few rounds, and such passes were a visible part of
    a plain round."""

    def __init__(self, slopes: list[tuple[float, int]]):
        by_own: dict[int, list[float]] = {}
        for slope, own in slopes:
            by_own.setdefault(own, []).append(slope)
        self.groups = []  # (own budget, its slopes ascending, their running sums from 0)
        for own, values in by_own.items():
            values.sort()
            self.groups.append((own, values, list(itertools.accumulate(values, initial=0.0))))

    def at(self, budget: int) -> float:
        total = 0.0
        for own, slopes, sums in self.groups:
            nodes = min(budget, own)
            if nodes < 1:
                continue
            scale = math.log2(1 + nodes)
            # Slopes below nodes / scale add slope * scale; the rest reach the cap of `nodes` tokens.
            below = bisect.bisect_left(slopes, nodes / scale)
            total += scale * sums[below] + nodes * (len(slopes) - below)
        return total


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch`: the padded batch its CUDA graph runs (up to --max-batch), so costs
    measured at 40 requests also price 50, and a batch size met for the first time is not unmeasured."""
    return 1 << (max(batch, 1) - 1).bit_length()


# nodes -> the tree bucket that holds them, precomputed: the choice looks buckets up many times a round.
TREE_BUCKET_OF = [next(size for size in TREE_BUCKETS if size >= nodes) for nodes in range(TREE_BUCKETS[-1] + 1)]


def tree_bucket(nodes: int) -> int:
    return TREE_BUCKET_OF[nodes]


class CostModel:
    """What a round costs per (batch bucket, tree bucket), learnt from the rounds themselves (the median of the last
    few). Plain rounds are measured first at each batch bucket: they are the yardstick. Until a tree bucket has a
    few rounds, its cost is the nearest settled bucket's plus the difference between their CUDA graphs, timed at
    start-up; without graph timings, at most what the nearest smaller bucket measured, so that a larger tree is
    tried before it is judged. A verification costs what its tree's size costs, whoever drafted it; the drafter's
    round trips are timed apart for its own trees and for prompt lookup's alone (`lookup`)."""

    def __init__(self):
        # batch bucket -> tree bucket -> seconds
        self.verify_s: dict[int, dict[int, RecentCost]] = {}
        self.draft_s: dict[bool, dict[int, dict[int, RecentCost]]] = {False: {}, True: {}}  # lookup -> as above
        # lookup -> batch bucket -> drafter round trips that caught up
        self.catch_up_s: dict[bool, dict[int, RecentCost]] = {False: {}, True: {}}
        self.graph_s: dict[int, dict[int, float]] = {}  # each captured graph's replay alone, timed at start-up
        # (lookup, batch bucket) -> what tree rounds that caught the drafters up took over their estimates
        self.tree_calibration: dict[tuple[bool, int], Calibration] = {}

    @staticmethod
    def _add(table: dict, batch: int, nodes: int, seconds: float) -> None:
        table.setdefault(batch_bucket(batch), {}).setdefault(tree_bucket(nodes), RecentCost()).add(seconds)

    def observe_verify(self, batch: int, nodes: int, seconds: float) -> None:
        """A round of `batch` requests without a prompt, whose largest tree had `nodes` nodes (1: plain decoding),
        took `seconds` beside its drafter round trip: the forward and the host's work around it."""
        self._add(self.verify_s, batch, nodes, seconds)

    def observe_graph(self, batch: int, nodes: int, seconds: float) -> None:
        """A captured graph's replay, timed alone at start-up: device time only, without the host work of a real
        round (staging, picking, committing), so it prices the difference between tree sizes, not a round."""
        self.graph_s.setdefault(batch_bucket(batch), {})[tree_bucket(nodes)] = seconds

    def observe_draft(self, batch: int, budget: int, seconds: float, catch_up: bool = False,
                      lookup: bool = False) -> None:
        """A drafter round trip for `batch` requests at round budget `budget` (`lookup`: for prompt lookup's trees
        alone). One that caught a request's context up (`catch_up`: its prompt, or the rounds it decoded plainly)
        prices the next try, not a steady round: at one request a catch-up costs a DFlash drafter several steady
        rounds, and judging trees by it would keep them from ever being played."""
        if catch_up:
            self.catch_up_s[lookup].setdefault(batch_bucket(batch), RecentCost()).add(seconds)
        else:
            self._add(self.draft_s[lookup], batch, budget + 1, seconds)

    def catch_up_extra(self, batch: int, budget: int, lookup: bool = False) -> float:
        """What a try's drafting (its Draft messages and the drafter's answer) costs beyond a steady round trip at
        this batch and budget (0 when unknown)."""
        bucket = batch_bucket(batch)
        caught_up = self.catch_up_s[lookup].get(bucket)
        if caught_up is None:
            return 0.0
        return max(0.0, caught_up.value - self._draft_estimate(bucket, tree_bucket(budget + 1), lookup))

    def observe_tree_round(self, batch: int, lookup: bool, seconds: float, estimated: float) -> None:
        """A round of trees chosen on their merits that caught the drafters' contexts up (after plain rounds),
        without a prompt, took `seconds` where `estimated` (by round_seconds, uncalibrated) were expected. A lone
        request is left out: its trees are played in runs, and its catch-ups are priced as tries."""
        if batch_bucket(batch) > 1:
            self.tree_calibration.setdefault((lookup, batch_bucket(batch)), Calibration()).add(seconds, estimated)

    def tree_factor(self, batch: int, lookup: bool = False) -> float:
        """What tree rounds that caught up took over their estimates at this batch bucket (1 until a few were seen):
        at a batch of many requests such a round catches every request's drafter context up, which the steady
        rounds' costs leave out."""
        record = self.tree_calibration.get((lookup, batch_bucket(batch)))
        return record.factor if record is not None else 1.0

    def round_seconds(self, batch: int, budget: int, lookup: bool = False) -> float | None:
        """Estimated time of one round of `batch` requests at round budget `budget` (`lookup`: prompt lookup's trees
        alone), before tree_factor; None when unknown."""
        costs = self.round_costs(batch, [budget], (lookup,))
        return None if costs is None else costs[(lookup and budget > 0, budget)]

    def round_costs(self, batch: int, budgets: list[int], sources: tuple[bool, ...] = (False,)
                    ) -> dict[tuple[bool, int], float] | None:
        """round_seconds of each (lookup, budget) of these (plain decoding: (False, 0)), each verification priced
        once for every source; None when any is unknown. A choice prices them all every time it is worked out."""
        bucket, costs = batch_bucket(batch), {}
        for budget in budgets:
            nodes = tree_bucket(budget + 1)
            verify = self._verify_estimate(bucket, nodes)
            if verify is None:
                return None
            if budget == 0:
                costs[(False, 0)] = verify
                continue
            for lookup in sources:
                costs[(lookup, budget)] = verify + self._draft_estimate(bucket, nodes, lookup)
        return costs

    def plain_settled(self, batch: int) -> bool:
        return self.settled(batch, 0)

    def settled(self, batch: int, budget: int, lookup: bool = False) -> bool:
        """Whether a round at this batch and budget is priced by its own settled costs (its verification's, and its
        drafter round trip's where it drafts), not by a neighbour's or a guess."""
        bucket, nodes = batch_bucket(batch), tree_bucket(budget + 1)
        verify = self.verify_s.get(bucket, {}).get(nodes)
        draft = self.draft_s[lookup].get(bucket, {}).get(nodes) if budget else verify
        return verify is not None and verify.settled and draft is not None and draft.settled

    @staticmethod
    def _estimate(table: dict, batch: int, bucket: int) -> float | None:
        """The bucket's cost at this batch; optimistic while it is unmeasured or unsettled: then at most what the
        nearest smaller bucket costs, so a larger tree gets tried (and an early slow sample retried) before it
        is judged. Without any smaller figure, the nearest larger one; None when this batch bucket has none."""
        row = table.get(batch)
        if not row:
            return None
        own = row.get(bucket)
        if own is not None and own.settled:
            return own.value
        smaller = max((size for size in row if size < bucket), default=None)
        below = row[smaller].value if smaller is not None else None
        if own is not None:
            return own.value if below is None else min(own.value, below)
        if below is not None:
            return below
        larger = min((size for size in row if size > bucket), default=None)
        return row[larger].value if larger is not None else None

    def _verify_estimate(self, batch: int, bucket: int) -> float | None:
        """A verification's cost at this batch and tree bucket: its own rounds once settled. Before that, with
        start-up graph timings, the nearest settled bucket's rounds plus the graphs' difference: a graph's replay
        alone (a fraction of a round for a small target) would make every unsettled tree look almost free. That
        leaves out what larger trees add to the host's work, so it errs low, and a tree is tried before it is
        judged. Without graph timings, the optimistic `_estimate`."""
        row, graphs = self.verify_s.get(batch, {}), self.graph_s.get(batch, {})
        if bucket in row and row[bucket].settled:
            return row[bucket].value
        settled = [size for size in row if row[size].settled and size in graphs]
        if bucket in graphs and settled:
            nearest = min(settled, key=lambda size: (abs(size - bucket), size))
            return row[nearest].value + graphs[bucket] - graphs[nearest]
        return self._estimate(self.verify_s, batch, bucket)

    def _draft_estimate(self, batch: int, bucket: int, lookup: bool = False) -> float:
        """The drafter's cost for this batch and tree bucket. A batch size whose drafts were never timed takes
        the figure of the nearest batch size that was (the smaller on a tie), not zero: the batch changes as
        requests come and go, and a draft assumed free would make each new batch size try trees whatever they
        cost. A smaller batch's figure is scaled up to this one: a try after plain rounds sends every request's
        context since its last draft, which grows with the batch. Zero only before any draft was timed."""
        table = self.draft_s[lookup]
        own = self._estimate(table, batch, bucket)
        if own is not None:
            return own
        others = sorted(table, key=lambda size: (abs(math.log2(size / batch)), size))
        return next((cost * max(1.0, batch / size) for size in others
                     if (cost := self._estimate(table, size, bucket)) is not None), 0.0)


class AcceptanceModel:
    """Each request's slope (accepted tokens per log2(1 + budget)) as a ratio of decaying sums, shrunk towards the
    same ratio over all requests: acceptance comes in bursts (a stretch that copies the prompt, then misses), and an
    average of per-round slopes swings with each burst where a ratio of sums does not. And, per batch bucket, what
    speculative rounds really drafted over what the model expected of them (`calibration_factor`): per-request
    slopes read high where acceptance shifts along requests, and where rounds are chosen on a good estimate."""

    # A request's own observations are shrunk towards the slope over all requests by this much log-budget (about
    # one round at budget 16), so that its first round or two do not decide alone.
    PRIOR_WEIGHT = 4.0
    # Each tree round weighs 1 - DECAY times the next: a memory of about fifty rounds. A shorter one follows each run
    # of misses down to plain decoding, where trees would have done about as well as on average (at one request on
    # chat, replaying the policy over each position's acceptance): the next round is hard to tell from the last few.
    DECAY = 0.02

    def __init__(self, prior_slope: float = 0.5, decay: float = DECAY):
        self.prior_slope, self.decay = prior_slope, decay
        self.slopes: dict[str, DecayingRatio] = {}
        self.overall = DecayingRatio(decay)
        self.calibration: dict[int, Calibration] = {}  # batch bucket -> its speculative rounds' record
        # Ageing is applied to a request's slope when it is next read: the log of the share of evidence every
        # `age` so far has left, and its value when each request's slope was last brought up to date. A plain round
        # then costs no step per request.
        self.kept_log = 0.0
        self.aged_to: dict[str, float] = {}

    def observe(self, request_id: str, budget: int, tokens: int) -> None:
        """A round of this request with a tree of `budget` drafted nodes emitted `tokens` tokens."""
        if budget < 1:
            return
        accepted, log_budget = max(0, tokens - 1), math.log2(1 + budget)
        own = self._own(request_id)
        if own is None:
            own = self.slopes[request_id] = DecayingRatio(self.decay)
            self.aged_to[request_id] = self.kept_log
        own.add(accepted, log_budget)
        self.overall.add(accepted, log_budget)

    def age(self, share: float) -> None:
        """Every request's own evidence counts `share` less (a plain round, which observes no acceptance; the
        requests that could not draft in it hold no evidence, or none that is read again)."""
        self.kept_log += math.log1p(-min(share, 1 - 1e-9))  # (a share of 1 taken as just under it: finite)

    def _own(self, request_id: str) -> DecayingRatio | None:
        """The request's own ratio, aged as far as `age` has gone."""
        own = self.slopes.get(request_id)
        if own is not None:
            behind = self.kept_log - self.aged_to[request_id]
            if behind:
                own.age(-math.expm1(behind))
                self.aged_to[request_id] = self.kept_log
        return own

    def forget(self, request_id: str) -> None:
        self.slopes.pop(request_id, None)
        self.aged_to.pop(request_id, None)

    def overall_slope(self) -> float:
        return self.overall.value(self.prior_slope, self.PRIOR_WEIGHT)

    def slope(self, request_id: str, overall: float | None = None) -> float:
        """The request's slope (`overall`: the all-request slope, when the caller has it already)."""
        if overall is None:
            overall = self.overall_slope()
        own = self._own(request_id)
        return own.value(overall, self.PRIOR_WEIGHT) if own is not None else overall

    def expected_tokens(self, request_id: str, budget: int) -> float:
        return tokens_per_round(self.slope(request_id), budget)

    def calibrate(self, batch: int, realized: float, expected: float) -> float:
        """A speculative round at this batch drafted `realized` tokens beyond one a request where `expected`
        were; returns the batch bucket's factor now."""
        record = self.calibration.setdefault(batch_bucket(batch), Calibration())
        record.add(realized, expected)
        return record.factor

    def calibration_factor(self, batch: int) -> float:
        """Realized over expected drafted tokens of speculative rounds at this batch's bucket (1 when unknown)."""
        record = self.calibration.get(batch_bucket(batch))
        return record.factor if record is not None else 1.0


class Exploration:
    """After a run of plain rounds, one round tries the best tree anyway: acceptance is only learnt from trees, and
    it changes along a request (a repetitive stretch, a new topic). A try comes after `interval` plain rounds, and
    once it costs at most SHARE of their time (a try can cost many plain rounds). A try that does not win
    speculation back doubles the interval, up to AT_MOST, so a drafter that never pays costs ever less; a round
    that speculates on its merits starts it over."""

    AT_MOST, SHARE = 1024, 0.02

    def __init__(self, every: int):
        self.every = self.interval = every
        self.plain_rounds, self.plain_s = 0, 0.0  # since the last speculative round
        self.try_extra_s = 0.0  # what a try would cost beyond a plain round, as last worked out

    def due(self, rounds: int = 0, seconds: float = 0.0) -> bool:
        """Whether a try is due, `rounds` more plain rounds of `seconds` on."""
        return (self.plain_rounds + rounds >= self.interval
                and (self.plain_s + seconds) * self.SHARE >= self.try_extra_s)

    def plain(self, seconds: float) -> None:
        self.plain_rounds += 1
        self.plain_s += seconds

    def paid(self) -> None:
        """A tree was chosen on its merits."""
        self.plain_rounds, self.plain_s, self.interval = 0, 0.0, self.every

    def try_now(self, extra_s: float) -> bool:
        """After a plain choice: whether to try the best tree instead, which costs `extra_s` more."""
        self.try_extra_s = max(0.0, extra_s)
        if not self.due():
            return False
        self.plain_rounds, self.plain_s = 0, 0.0
        self.interval = min(2 * self.interval, self.AT_MOST)
        return True


@dataclasses.dataclass
class StandingChoice:
    """A choice worked out for rounds of this `signature` (batch bucket, largest budget, lookup offered), played
    again for up to `limit` more of them (AdaptiveSpeculation.REUSE_PLAIN, REUSE_LONE_TREE)."""

    signature: tuple
    choice: Choice
    limit: int
    rounds: int = 0  # rounds it has stood since worked out

    def stands(self, signature: tuple, first_try: bool, exploration: Exploration) -> bool:
        """Whether it stands for this round (and count it): not for a request's first try, and a plain one not in
        place of a try that Exploration has due."""
        if signature != self.signature or self.rounds >= self.limit or first_try:
            return False
        if self.choice.budget == 0:
            plain_s = self.choice.expected[1]
            if exploration.due(1, plain_s):
                return False
            exploration.plain(plain_s)
        self.rounds += 1
        return True


class GiveUp:
    """Once the rounds at a batch bucket have been plain for `after_s` since drafting last paid there (the choice
    would not speculate even were every request drafting), new requests there decode plainly but for one in
    CANARY_EVERY, which keeps drafting so that speculation is tried again; running requests stop drafting but for
    the newest one in CANARY_EVERY. A request that could draft costs even in plain rounds where the drafters
    condition on target features (it keeps them, and its batch waits on their copies). A lone request is never
    given up: that would save no one else's time, only the tries (which Exploration bounds) and, with features,
    one request's copies of its own rows, and take the stretches that pay, which come in bursts within a request."""

    CANARY_EVERY = 16

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.unpaid_s: dict[int, float] = {}  # batch bucket -> plain rounds' time since drafting last paid there
        self.plain_admissions = 0  # new requests told to decode plainly: every CANARY_EVERY-th drafts anyway

    def note(self, batch: int, seconds: float | None) -> None:
        """Add `seconds` of rounds in which drafting would not have paid at this batch's bucket (None: it would,
        and the count starts over)."""
        bucket = batch_bucket(batch)
        before = self.unpaid_s.get(bucket, 0.0)
        self.unpaid_s[bucket] = 0.0 if seconds is None else before + seconds
        if bucket > 1 and before < self.after_s <= self.unpaid_s[bucket]:  # a lone request is never given up
            log.info("adaptive: drafting has not paid at batches of up to %d requests for %.1f s of rounds; new "
                     "requests there decode plainly, but for one in %d", bucket, self.unpaid_s[bucket],
                     self.CANARY_EVERY)

    def gave_up(self, batch: int) -> bool:
        bucket = batch_bucket(batch)
        if bucket == 1:
            return False
        return self.unpaid_s.get(bucket, 0.0) >= self.after_s

    def admits_drafting(self, batch: int) -> bool:
        if not self.gave_up(batch):
            return True
        self.plain_admissions += 1
        return self.plain_admissions % self.CANARY_EVERY == 0

    def drafting_kept(self, batch: int) -> int | None:
        return max(1, batch // self.CANARY_EVERY) if self.gave_up(batch) else None


class AdaptiveSpeculation:
    """The choice of each round's budget, a `treeserve.verifier.round.Speculation`. min_budget..max_budget: the
    bounds of the round budget (min_budget 0 allows plain decoding)."""

    # A plain decision stands for up to this many more rounds of the same batch bucket (whose costs price it): plain
    # rounds observe no acceptance, so the choice's inputs move only as the evidence ages (PLAIN_AGING), and working
    # it out is a visible part of a small target's round. Not the same batch, nor the same number of speculating
    # requests: at a large batch a request finishes or joins most rounds, which would work it out nearly every round.
    REUSE_PLAIN = 8
    # A lone request's tree decision stands the same way, for up to this many more rounds: its next round's acceptance
    # is hard to tell from the last few, a tree after plain rounds costs more than a steady one (its drafter catches
    # up), and working the choice out is a visible part of a tree round. So its trees run as a fixed budget's do,
    # until a run's end finds they no longer pay. A tree tried after plain rounds (Exploration) runs too: a try alone
    # is a catch-up, which prices no steady round, so the steady costs that keep trees out would never be measured
    # again. (Only a tree priced by its own settled costs: an unmeasured size is tried for a round, then judged.)
    REUSE_LONE_TREE = 8
    # In a batch, a tree must promise this much more than plain decoding to be chosen (and for drafting to count as
    # paying): the choice takes the best of noisy estimates over many requests and sources, so the chosen tree's is
    # the likeliest to read high, and a round of trees also costs what no estimate here holds (every request's
    # drafter catch-up, new requests' prompts joining its trees).
    MARGIN = 1.05
    # A lone request's trees need promise no more than plain decoding's tokens a second: its catch-ups are rows sent
    # ahead (send_lagging_rows), its first tree prices nothing, and its costs are its own rounds, played in runs.
    # A margin there would only turn it plain where its trees pay.
    LONE_MARGIN = 1.0
    # In each plain round, a speculating request's own acceptance evidence counts this much less: by the time a
    # plain decision is worked out again (REUSE_PLAIN rounds on), a request that has just missed is back at about
    # the all-request slope, and is tried again where that pays. A request that has just missed a few times says
    # little about the stretch it will be in a few rounds on.
    PLAIN_AGING = 0.5
    # Prompt lookup's prior slope, as a share of the drafter's own: lookup proposes nothing on new text.
    LOOKUP_PRIOR = 0.5

    def __init__(self, min_budget: int = 0, max_budget: int = MAX_BUDGET, prior_slope: float = 0.5,
                 decay: float = AcceptanceModel.DECAY, explore_every: int = 32, give_up_after_s: float = 1.0):
        if not 0 <= min_budget <= max_budget <= MAX_BUDGET:
            raise ValueError(f"adaptive budget bounds must satisfy 0 <= min <= max <= {MAX_BUDGET}, got "
                             f"{min_budget}..{max_budget}")
        self.min_budget, self.max_budget = min_budget, max_budget
        self.costs = CostModel()
        self.acceptance = AcceptanceModel(prior_slope, decay)  # the drafter's own trees
        # Prompt lookup's trees alone, where a drafter offers them: learnt from those rounds, and from how far the
        # accepted paths of its own trees followed their lookup chains.
        self.lookup_acceptance = AcceptanceModel(prior_slope * self.LOOKUP_PRIOR, decay)
        self.exploration = Exploration(explore_every)
        self.give_up = GiveUp(give_up_after_s)
        self.tried: set[str] = set()  # requests that were given a tree budget (a tree may have come back empty)
        self.standing: StandingChoice | None = None  # the last choice worked out, where it may stand
        self.worked_out = 0  # choices worked out, not reused (for benches: each costs the host a visible share)
        self.last_played: Choice = Choice(0)  # the last round's choice

    # ----------------------------------------------------------------------------------- the policy interface

    def round_budgets(self, asked: dict[str, int], batch: int, lookup: bool = False
                      ) -> tuple[dict[str, int], Choice | None]:
        if not asked:
            return {}, None
        choice = self.choose(asked, batch, lookup)
        if choice.budget == 0:
            return {}, choice
        return {request_id: min(choice.budget, own) for request_id, own in asked.items()}, choice

    def observe(self, report: RoundReport) -> tuple[int, float] | None:
        """Learn from a round: its trees' acceptance, its drafters' and its verification's costs, and what its
        trees drafted beside what the choice expected. Returns (batch bucket, realized over expected drafted
        tokens) when that was checked on the drafter's own trees."""
        model = self.lookup_acceptance if report.lookup else self.acceptance
        drafted = report.drafted
        for request in report.requests if drafted else ():  # (a plain round's observe nothing)
            model.observe(request.request_id, request.tree_nodes, request.committed)
            if request.lookup_accepted is not None:  # an own tree's lookup chain, of at most half its budget
                self.lookup_acceptance.observe(request.request_id, report.budgets.get(request.request_id, 0) // 2,
                                               request.lookup_accepted + 1)
        trips = [found.round_trip_s for found in report.drafts if found.trees]
        # A lone request's first tree, played whatever the choice (a first try), brings its prompt: it would price
        # the tries after plain rounds, which bring at most a few rows (send_lagging_rows), far above their cost.
        first_tree_alone = report.batch == 1 and any(found.prompt for found in report.drafts)
        if report.budgets and trips and not first_tree_alone:
            catch_up = any(found.catch_up for found in report.drafts)
            # A catch-up is timed from the round's start to its trees: its Draft messages carry every row since each
            # request's last tree, which at a batch of many requests costs about what the drafter's answer does.
            self.costs.observe_draft(report.batch, max(report.budgets.values()),
                                     report.draft_s if catch_up else max(trips), catch_up=catch_up,
                                     lookup=report.lookup)
        choice = report.choice
        if (choice is not None and choice.estimated_s is not None and drafted and not report.with_prompts):
            self.costs.observe_tree_round(report.batch, choice.lookup, report.seconds, choice.estimated_s)
        if report.forward_batch and not report.with_prompts:
            # The whole round less its wait on drafters: everything a tree adds to the host's work (plans,
            # staging, the acceptance walk, the messages) as well as the forward. A drafter that failed is waited
            # on apart, so its stall does not price this round's verification.
            self.costs.observe_verify(report.forward_batch, report.largest_tree, report.seconds - report.drafters_s)
        if choice is None or choice.expected_drafted is None or not drafted:
            return None
        realized = max(0, report.tokens - len(report.requests))
        factor = model.calibrate(report.batch, realized, choice.expected_drafted)
        return None if report.lookup else (batch_bucket(report.batch), factor)

    def admits_drafting(self, batch: int) -> bool:
        return self.give_up.admits_drafting(batch)

    def drafting_kept(self, batch: int) -> int | None:
        return self.give_up.drafting_kept(batch)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self.lookup_acceptance.forget(request_id)
        self.tried.discard(request_id)

    # --------------------------------------------------------------------------------------------- the choice

    def choose(self, asked: dict[str, int], batch: int, lookup: bool = False) -> Choice:
        """The round budget for the speculating requests (`asked`: request id -> its own budget, not empty) in a
        batch of `batch` requests (the rest decode plainly: one token each); with `lookup`, the drafters also
        draft by prompt lookup alone, and the choice may ask for that."""
        # A lone request's first tree is its own try: at one request a try costs no one else's time, and the
        # requests before it say little of how its trees will do (one copies its prompt, the next writes anew).
        first_try = batch == 1 and any(request_id not in self.tried and request_id not in self.acceptance.slopes
                                       for request_id in asked)
        choice = self._choose(asked, batch, first_try, lookup)
        self.last_played = choice
        if choice.budget == 0:  # a plain round: what the requests' trees did ages
            self.acceptance.age(self.PLAIN_AGING)
            self.lookup_acceptance.age(self.PLAIN_AGING)
        else:
            self.tried.update(asked)
            if choice.lookup:  # nor does a round of lookup's trees observe the drafter's own
                self.acceptance.age(self.PLAIN_AGING)
        return choice

    def _choose(self, asked: dict[str, int], batch: int, first_try: bool = False, lookup: bool = False) -> Choice:
        most = min(self.max_budget, max(asked.values()))
        signature = (batch_bucket(batch), most, lookup)
        standing = self.standing
        if standing is not None and standing.stands(signature, first_try, self.exploration):
            choice = standing.choice  # (a plain one expects a token of each of this round's requests)
            return choice if choice.budget else Choice(0, (float(batch), choice.expected[1]))
        self.standing = None
        self.worked_out += 1
        reused = standing.rounds if standing is not None and standing.choice.budget == 0 else 0  # plain ones
        steps = [step for step in (0,) + BUDGET_STEPS if self.min_budget <= step <= most]
        if not steps:
            steps = [min(self.min_budget, most)]
        if 0 in steps and not self.costs.plain_settled(batch):
            # Plain rounds are what trees are judged against: measured first. Priced by a tree's cost instead, as
            # an unmeasured bucket with only larger ones measured is, plain decoding could never win a round.
            return Choice(0)
        # Each candidate is (lookup's trees alone, budget); plain decoding is (False, 0).
        sources = (False, True) if lookup else (False,)
        estimated = self.costs.round_costs(batch, steps, sources)
        if estimated is None:  # nothing measured at this batch size yet: speculate as asked, and learn
            return Choice(most)
        rates, seconds, drafted, gained = {}, {}, {}, {}
        for source in sources:
            model = self.lookup_acceptance if source else self.acceptance
            overall = model.overall_slope()
            expected = ExpectedDrafts([(model.slope(request_id, overall), own) for request_id, own in asked.items()])
            factor = model.calibration_factor(batch)
            cost_factor = self.costs.tree_factor(batch, source) if self._catches_up(source) else 1.0
            for step in steps:
                if source and step == 0:
                    continue
                key = (source, step)
                seconds[key] = estimated[key] * cost_factor if step else estimated[key]
                drafted[key] = expected.at(step)
                gained[key] = factor * drafted[key]
                rates[key] = (batch + gained[key]) / max(seconds[key], 1e-9)
        best = max(rates, key=lambda key: (rates[key], -key[1]))  # ties: the smaller tree
        plain = (False, 0)
        if plain in rates:
            margin = self.LONE_MARGIN if batch == 1 else self.MARGIN
            if rates[best] < margin * rates[plain]:
                best = plain
            if best == plain and batch == 1:
                best = self._kept_trees(rates, seconds[plain], margin)
            # Would the drafter's own trees pay were every request drafting, as the drafting ones do? (What a
            # request that could draft costs in plain rounds, its kept features, is for those trees alone.)
            everyone = batch / len(asked)
            pays = any((batch + gained[key] * everyone) / seconds[key] > margin * rates[plain]
                       for key in rates if key[1] > 0 and not key[0])
            self.give_up.note(batch, None if pays else seconds[plain] * (1 + reused))
        if log.isEnabledFor(logging.DEBUG):
            bucket = batch_bucket(batch)
            log.debug("adaptive: batch %d, %d drafting, all-request slope %.3f; by (lookup, budget): expected "
                      "tokens/s, tokens, ms %s; of them the verification's, ms %s", batch, len(asked),
                      self.acceptance.overall_slope(),
                      {key: (round(rates[key], 1), round(batch + gained[key], 2), round(seconds[key] * 1e3, 3))
                       for key in rates},
                      {step: round(self.costs._verify_estimate(bucket, tree_bucket(step + 1)) * 1e3, 3)
                       for step in steps})
        chosen = self._explore(best, rates, seconds, batch, first_try)
        calibrated = chosen[1] > 0 and chosen == best and self._catches_up(chosen[0])
        choice = Choice(chosen[1], (batch + gained[chosen], seconds[chosen]),
                        drafted[chosen] if chosen[1] > 0 else None, lookup=chosen[0],
                        estimated_s=estimated[chosen] if calibrated else None)
        if chosen[1] == 0:
            self.standing = StandingChoice(signature, choice, self.REUSE_PLAIN)
        elif batch == 1 and not first_try and self.costs.settled(batch, chosen[1], chosen[0]):
            # (its reuses are steady rounds: nothing to calibrate a catch-up by)
            self.standing = StandingChoice(signature, dataclasses.replace(choice, estimated_s=None),
                                           self.REUSE_LONE_TREE)
        return choice

    def _kept_trees(self, rates: dict, plain_s: float, margin: float) -> tuple[bool, int]:
        """Where plain decoding beats a lone request's trees: its last tree's size all the same, if the request has
        been drafting its own trees and they still beat (by `margin`) plain rounds with the catch-up that trees
        cost when they return (its drafter's context then lags by the plain stretch), spread over the
        1 + REUSE_PLAIN rounds a plain decision stands for; else plain decoding."""
        last = self.last_played
        kept = (False, last.budget)
        if last.budget == 0 or last.lookup or kept not in rates:
            return (False, 0)
        leaving_s = plain_s + self.costs.catch_up_extra(1, last.budget) / (1 + self.REUSE_PLAIN)
        return kept if rates[kept] >= margin / leaving_s else (False, 0)

    def _catches_up(self, lookup: bool) -> bool:
        """Whether a round of these trees would catch the drafters' contexts up: after a plain round, and for the
        drafter's own trees after lookup's alone too (those send no features). Only such rounds are scaled by, and
        teach, CostModel.tree_factor: a round after a tree round is a steady one, which the steady costs price."""
        last = self.last_played
        return last.budget == 0 or (last.lookup and not lookup)

    def _explore(self, best: tuple[bool, int], rates: dict, seconds: dict, batch: int, first_try: bool = False
                 ) -> tuple[bool, int]:
        """The (lookup, budget) to play: `best`, or a tree tried: as a request's `first_try` the drafter's own best
        (which teaches both models: its lookup chain too), or after enough plain rounds the best tree (its drafter
        round trip catches every request up)."""
        tries = [key for key in rates if key[1] > 0]
        own = [key for key in tries if not key[0]]
        if first_try and own and best not in own:  # not an exploration: it neither waits for one nor backs them off
            return max(own, key=lambda key: rates[key])
        if best[1] > 0:
            self.exploration.paid()
            return best
        self.exploration.plain(seconds[best])
        if not tries:
            return best
        trial = max(tries, key=lambda key: rates[key])
        extra_s = seconds[trial] - seconds[best] + self.costs.catch_up_extra(batch, trial[1], trial[0])
        return trial if self.exploration.try_now(extra_s) else best
