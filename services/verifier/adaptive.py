"""Adaptive speculation: each round, the tree budget that maximises expected tokens per second.

A round costs the drafter's round trip (nothing when no request drafts) plus one verification with the host's work
around it, whose cost depends on the batch and on the largest tree in it (the padded bucket it runs in). A request
emits, in expectation, 1 + s * log2(1 + b) tokens with a budget of b: one bonus token always, plus accepted drafts
that grow about logarithmically with the tree (each doubling of a best-first tree adds roughly the same depth), and
at most b + 1. The slope s is learnt per request as a ratio of decaying sums (tokens accepted beyond the bonus one,
over log2(1 + b)), shrunk towards the same ratio over all requests: acceptance comes in bursts (a stretch that
copies the prompt, then misses), and an average of per-round slopes swings with each burst where a ratio of sums
does not. In plain rounds a request's own sums age (PLAIN_AGING), so that a few misses are forgotten by the next
time a plain decision is worked out, and the request is judged by the all-request slope again. Costs are learnt
per (batch bucket, tree bucket) from the rounds themselves (the median of the last few). Plain rounds are measured
first at each batch bucket: they are the yardstick. Until a tree bucket has a few, its cost is the nearest settled
bucket's plus the difference between their CUDA graphs, timed at start-up; without graph timings it costs at most
what the nearest smaller one measured, so a larger tree is tried before it is judged.

So the choice is one budget T for the round (0: plain decoding, no drafter call): each speculating request drafts
min(T, its own budget), and

    T = argmax  (batch + c(batch) * sum_i (E_i(min(T, budget_i)) - 1))
                / (draft_time(batch, T) + verify_time(batch, T + 1 nodes)),

plain decoding (T = 0) kept unless the best tree promises MARGIN times its tokens a second.

c(batch) checks the model against what speculative rounds at that batch bucket really drafted: their realized
drafted tokens over the model's expected ones (decaying sums), 1 until a few rounds are seen. The slopes alone
read high where acceptance shifts along requests and where rounds are chosen on a good estimate: on the H200,
sampled n-gram drafts made a new request expect 4.3 tokens a round from the all-request slope (a request's first
rounds copy from its prompt and accept well) where it had about 1.5, and rounds speculated and lost.

Plain decoding stays a candidate in every round, so where verification turns compute-bound (large batches),
speculation switches itself off rather than costing throughput. Where a request that could draft still costs more
than a plain one in a plain round (a DFlash request keeps its target features for the drafter), and drafting would
not have paid for a while even were every request drafting, new requests decode plainly, and so do the running
ones from then on, but for a few that keep drafting so that it is tried again (`speculates_new_request`,
`drafting_kept`; for a drafter without features, not at one request: `gave_up`).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

from treeserve.tree import MAX_BUDGET
from treeserve.verifier.graphs import TREE_BUCKETS

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
        self.value = statistics.median(self.samples)

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
    """What speculative rounds of one batch bucket emitted beyond one token per request, over what the model
    expected of them."""

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


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch`: the padded batch its CUDA graph runs (up to --max-batch), so costs
    measured at 40 requests also price 50, and a batch size met for the first time is not unmeasured."""
    return 1 << (max(batch, 1) - 1).bit_length()


# nodes -> the tree bucket that holds them, precomputed: the choice looks buckets up many times a round.
TREE_BUCKET_OF = [next(size for size in TREE_BUCKETS if size >= nodes) for nodes in range(TREE_BUCKETS[-1] + 1)]


def tree_bucket(nodes: int) -> int:
    return TREE_BUCKET_OF[nodes]


class AdaptiveSpeculation:
    """min_budget..max_budget: the bounds of the round budget (min_budget 0 allows plain decoding)."""

    # A request's own observations are shrunk towards the slope over all requests by this much log-budget (about
    # one round at budget 16), so that its first round or two do not decide alone.
    PRIOR_WEIGHT = 4.0
    # Exploration backs off to at most this many plain rounds between tries, while tries keep failing.
    EXPLORE_AT_MOST = 1024
    # And a try waits until it costs at most this share of the plain rounds' time since the last one. A DFlash
    # try at 64 requests on the H200 cost 230-300 ms more than a plain round (the drafter catches up every
    # request's features), and the 1-3 tries a 5-second run made by round count alone cost it 5-15 %.
    EXPLORE_SHARE = 0.02
    # Once the rounds at a batch bucket have been plain for this long since drafting last paid there (the choice
    # would not speculate even were every request drafting), new requests there decode plainly but for one in
    # CANARY_EVERY, which keeps drafting so that speculation is tried again; running requests stop drafting but
    # for the newest one in CANARY_EVERY (`drafting_kept`). A request that drafts costs even in
    # plain rounds: on the H200 at 64 requests, a DFlash request's kept features made plain rounds 1-1.5 ms
    # dearer, and that drafter never paid (docs/benchmarks.md). After 2 s, the DFlash stacks on the H200 never
    # gave up at 4 requests on code: two runs there held about 2 s of rounds at that bucket, and lost 3-8 %.
    GIVE_UP_AFTER_S, CANARY_EVERY = 1.0, 16
    # A plain decision stands for up to this many more rounds of the same batch: plain rounds observe no
    # acceptance, so the choice's inputs move only as the evidence ages (PLAIN_AGING), and working it out (tens of
    # microseconds to a tenth of a millisecond on the CPU machine) was a visible part of a SmolLM2 round at one
    # request.
    REUSE_PLAIN = 8
    # A tree must promise this much more than plain decoding to be chosen (and for drafting to count as paying).
    # The choice takes the best of noisy estimates, so the chosen tree's is the likeliest to read high: on the H200
    # at 16-64 requests, the trees chosen emitted 1-12 % fewer tokens a second than expected, and a round of trees
    # also costs what no estimate here holds (the drafter's catch-up, trees in rounds with prompts). Near break-even
    # speculating risks that and gains nothing; at one request the gains chosen were 50-90 %.
    MARGIN = 1.05
    # In each plain round, a speculating request's own acceptance evidence counts this much less: by the time a
    # plain decision is worked out again (REUSE_PLAIN rounds on), a request that has just missed is back at about
    # the all-request slope, and is tried again where that pays. Acceptance comes in runs (n-gram drafts on code:
    # a stretch copied from the prompt accepts 10 tokens a round, most other rounds nothing), and a request that
    # has just missed a few times says little about the stretch it will be in a few rounds on.
    # Replayed on the one-request code cell's real acceptance with the H200's costs, a lone request's trees went
    # from 1.18-1.20x plain decoding without it to 1.33-1.35x, and the 4-64 request replays gained or held
    # (docs/benchmarks.md, "One request, replayed").
    PLAIN_AGING = 0.5

    def __init__(self, min_budget: int = 0, max_budget: int = MAX_BUDGET, prior_slope: float = 0.5,
                 decay: float = 0.05, explore_every: int = 32):
        if not 0 <= min_budget <= max_budget <= MAX_BUDGET:
            raise ValueError(f"adaptive budget bounds must satisfy 0 <= min <= max <= {MAX_BUDGET}, got "
                             f"{min_budget}..{max_budget}")
        self.min_budget, self.max_budget, self.decay = min_budget, max_budget, decay
        # batch bucket -> tree bucket -> seconds
        self.verify_s: dict[int, dict[int, RecentCost]] = {}
        self.draft_s: dict[int, dict[int, RecentCost]] = {}
        self.graph_s: dict[int, dict[int, float]] = {}  # each captured graph's replay alone, timed at start-up
        self.slopes: dict[str, DecayingRatio] = {}  # accepted tokens per log2(1 + budget)
        self.calibration: dict[int, Calibration] = {}  # batch bucket -> its speculative rounds' record
        # (batch bucket, expected drafted tokens) of a speculative round chosen last, until observe_round
        self.pending: tuple[int, float] | None = None
        self.overall_slope = DecayingRatio(decay)
        self.prior_slope = prior_slope
        self.last_choice = 0
        # (tokens, seconds) the last choice expected of its round; None where it had no estimate to go by
        self.expected: tuple[float, float] | None = None
        # After `explore_interval` plain rounds in a row (and EXPLORE_SHARE), one round speculates anyway:
        # acceptance is only learnt from trees, and it changes along a request (a repetitive stretch, a new
        # topic). A try that does not win speculation back doubles the interval, so a drafter that never pays
        # (its catch-up drafts are the dearest rounds) costs ever less; a round that speculates on its merits
        # resets it.
        self.explore_every, self.explore_interval, self.plain_rounds = explore_every, explore_every, 0
        self.plain_seconds = 0.0  # the plain rounds' estimated time since the last speculative round
        self.try_extra_s = 0.0  # what a try would cost beyond a plain round, as last worked out
        self.plain_signature: tuple | None = None  # (batch, speculating requests, largest budget) of a plain choice
        self.plain_round_s = 0.0  # the estimated plain round of that choice
        self.reused = 0
        self.unpaid_s: dict[int, float] = {}  # batch bucket -> plain rounds' time since drafting last paid there
        self.plain_admissions = 0  # new requests told to decode plainly: every CANARY_EVERY-th drafts anyway
        # Whether a request that could draft costs more than a plain one in a plain round (its drafter conditions
        # on target features, which it keeps); the scheduler sets it from its drafters. Where it does not (n-gram
        # lookup, a draft model), drafting is not given up for a lone request (`gave_up`).
        self.drafting_costs_in_plain_rounds = True

    # ------------------------------------------------------------------------------------------- observations

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

    def observe_draft(self, batch: int, budget: int, seconds: float) -> None:
        """A drafter round trip for `batch` requests at round budget `budget`."""
        self._add(self.draft_s, batch, budget + 1, seconds)

    def observe_acceptance(self, request_id: str, budget: int, tokens: int) -> None:
        """A round of this request with a tree of `budget` drafted nodes emitted `tokens` tokens."""
        if budget < 1:
            return
        accepted, log_budget = max(0, tokens - 1), math.log2(1 + budget)
        self.slopes.setdefault(request_id, DecayingRatio(self.decay)).add(accepted, log_budget)
        self.overall_slope.add(accepted, log_budget)

    def observe_round(self, requests: int, tokens: int, drafted: bool = True) -> tuple[int, float] | None:
        """The round chosen last emitted `tokens` for its `requests` (prefilled and new): a speculative round's
        realized drafted tokens are checked against the model's expected ones, unless no tree reached the
        round (`drafted` False: a drafter that was down says nothing of what trees earn). Returns the batch
        bucket and its realized over expected factor now; None when nothing was checked."""
        pending, self.pending = self.pending, None
        if pending is None or not drafted:
            return None
        batch, expected = pending
        record = self.calibration.setdefault(batch, Calibration())
        record.add(max(0, tokens - requests), expected)
        return batch, record.factor

    def calibration_factor(self, batch: int) -> float:
        """Realized over expected drafted tokens of speculative rounds at this batch's bucket (1 when unknown)."""
        record = self.calibration.get(batch_bucket(batch))
        return record.factor if record is not None else 1.0

    def forget(self, request_id: str) -> None:
        self.slopes.pop(request_id, None)

    # ---------------------------------------------------------------------------------------------- estimates

    def slope(self, request_id: str, overall: float | None = None) -> float:
        """The request's slope (`overall`: the all-request slope, when the caller has it already)."""
        if overall is None:
            overall = self.overall_slope.value(self.prior_slope, self.PRIOR_WEIGHT)
        own = self.slopes.get(request_id)
        return own.value(overall, self.PRIOR_WEIGHT) if own is not None else overall

    def expected_tokens(self, request_id: str, budget: int) -> float:
        return tokens_per_round(self.slope(request_id), budget)

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

    def round_seconds(self, batch: int, budget: int) -> float | None:
        """Estimated time of one round of `batch` requests at round budget `budget`; None when unknown."""
        batch = batch_bucket(batch)
        verify = self._verify_estimate(batch, tree_bucket(budget + 1))
        if verify is None:
            return None
        if budget == 0:
            return verify
        return verify + self._draft_estimate(batch, tree_bucket(budget + 1))

    def _verify_estimate(self, batch: int, bucket: int) -> float | None:
        """A verification's cost at this batch and tree bucket: its own rounds once settled. Before that, with
        start-up graph timings, the nearest settled bucket's rounds plus the graphs' difference: a graph's replay
        alone (a fraction of a round at SmolLM2's size) would make every unsettled tree look almost free. That
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

    def _draft_estimate(self, batch: int, bucket: int) -> float:
        """The drafter's cost for this batch and tree bucket. A batch size whose drafts were never timed takes
        the figure of the nearest batch size that was (the smaller on a tie), not zero: the batch changes as
        requests come and go, and a draft assumed free made each new batch size try trees whatever they cost (a
        DFlash draft at 64 requests on the H200: 20-80 ms). A smaller batch's figure is scaled up to this one:
        a try after plain rounds sends every request's context since its last draft, and that grows with the
        batch (on the H200, a DFlash try at 64 requests priced at one request's 12 ms cost 430 ms). Zero only
        before any draft was timed."""
        own = self._estimate(self.draft_s, batch, bucket)
        if own is not None:
            return own
        others = sorted(self.draft_s, key=lambda size: (abs(math.log2(size / batch)), size))
        return next((cost * max(1.0, batch / size) for size in others
                     if (cost := self._estimate(self.draft_s, size, bucket)) is not None), 0.0)

    def _note_unpaid(self, batch: int, seconds: float | None) -> None:
        """Add `seconds` of rounds in which drafting would not have paid at this batch's bucket (None: it would,
        and the count starts over)."""
        bucket = batch_bucket(batch)
        before = self.unpaid_s.get(bucket, 0.0)
        self.unpaid_s[bucket] = 0.0 if seconds is None else before + seconds
        if before < self.GIVE_UP_AFTER_S <= self.unpaid_s[bucket] and self.gave_up(bucket):
            log.info("adaptive: drafting has not paid at batches of up to %d requests for %.1f s of rounds; new "
                     "requests there decode plainly, but for one in %d", bucket, self.unpaid_s[bucket],
                     self.CANARY_EVERY)

    def _try_due(self, plain_rounds: int, plain_seconds: float) -> bool:
        """Whether plain rounds have gone on long enough for a speculative try: explore_interval of them, and
        enough of their time that the try costs at most EXPLORE_SHARE of it."""
        return plain_rounds >= self.explore_interval and plain_seconds * self.EXPLORE_SHARE >= self.try_extra_s

    def gave_up(self, batch: int) -> bool:
        """Whether rounds at this batch's bucket have been plain for GIVE_UP_AFTER_S since drafting last paid.

        Never for a lone request whose drafting costs nothing in plain rounds: there giving up saves no one else's
        time, only the tries (which EXPLORE_SHARE bounds), and it takes the stretches that pay, which come in bursts
        within a request. On the H200, one request at a time on code, the n-gram stack gave up within a second,
        then drafted one request in CANARY_EVERY: 0.97x and 1.07x plain decoding in two runs, 1.19x not giving up
        there (docs/benchmarks.md). From two requests up giving up also stops trees the choice misjudges (their
        costs, learnt from few rounds, read low: never giving up, n-gram tree rounds at 64 requests took 14-22 ms
        where 11-16 were expected)."""
        bucket = batch_bucket(batch)
        if bucket == 1 and not self.drafting_costs_in_plain_rounds:
            return False
        return self.unpaid_s.get(bucket, 0.0) >= self.GIVE_UP_AFTER_S

    def speculates_new_request(self, batch: int) -> bool:
        """Whether a new request that asks for trees, joining a batch of `batch`, should draft: not where drafting
        has been given up at that batch bucket, but for one request in CANARY_EVERY."""
        if not self.gave_up(batch):
            return True
        self.plain_admissions += 1
        return self.plain_admissions % self.CANARY_EVERY == 0

    def drafting_kept(self, batch: int) -> int | None:
        """How many of a batch's requests may go on drafting: all (None), unless drafting has been given up at its
        bucket; then one in CANARY_EVERY, at least one, as new requests are admitted."""
        return max(1, batch // self.CANARY_EVERY) if self.gave_up(batch) else None

    def _plain_settled(self, batch: int) -> bool:
        plain = self.verify_s.get(batch_bucket(batch), {}).get(tree_bucket(1))
        return plain is not None and plain.settled

    # --------------------------------------------------------------------------------------------------- choice

    def choose(self, budgets: dict[str, int], batch: int) -> int:
        """The round budget for the speculating requests (`budgets`: request id -> its own budget) in a batch of
        `batch` requests (the rest decode plainly: one token each)."""
        chosen = self._choose(budgets, batch)
        if chosen == 0:  # a plain round: what the requests' trees did ages (PLAIN_AGING)
            for request_id in budgets:
                own = self.slopes.get(request_id)
                if own is not None:
                    own.age(self.PLAIN_AGING)
        return chosen

    def _choose(self, budgets: dict[str, int], batch: int) -> int:
        self.pending, self.expected = None, None
        if not budgets:
            return 0
        most = min(self.max_budget, max(budgets.values()))
        signature = (batch, len(budgets), most)
        if (signature == self.plain_signature and self.reused < self.REUSE_PLAIN
                and not self._try_due(self.plain_rounds + 1, self.plain_seconds + self.plain_round_s)):
            self.reused += 1  # (never in place of a try)
            self.plain_rounds += 1
            self.plain_seconds += self.plain_round_s
            self.expected = (float(batch), self.plain_round_s)
            return 0
        reused, self.plain_signature, self.reused = self.reused, None, 0
        candidates = [step for step in (0,) + BUDGET_STEPS if self.min_budget <= step <= most]
        if not candidates:
            candidates = [min(self.min_budget, most)]
        if 0 in candidates and not self._plain_settled(batch):
            # Plain rounds are what trees are judged against: measured first. Priced by a tree's cost instead, as
            # an unmeasured bucket with only larger ones measured is, plain decoding could never win a round.
            self.last_choice = 0
            return 0
        overall = self.overall_slope.value(self.prior_slope, self.PRIOR_WEIGHT)
        slopes = [(self.slope(request_id, overall), own) for request_id, own in budgets.items()]
        rates, seconds, drafted, factor = {}, {}, {}, self.calibration_factor(batch)
        for step in candidates:
            seconds[step] = self.round_seconds(batch, step)
            if seconds[step] is None:  # nothing measured at this batch size yet: speculate as asked, and learn
                self.last_choice = most
                return most
            drafted[step] = sum(tokens_per_round(slope, min(step, own)) - 1 for slope, own in slopes) if step else 0.0
            tokens = batch + factor * drafted[step]
            rates[step] = tokens / max(seconds[step], 1e-9)
        best = max(rates, key=lambda step: (rates[step], -step))  # ties: the smaller tree
        if 0 in rates:
            if rates[best] < self.MARGIN * rates[0]:
                best = 0
            # Would drafting pay were every request drafting, as the drafting ones do?
            everyone = batch / len(budgets)
            pays = any((batch + factor * drafted[step] * everyone) / seconds[step] > self.MARGIN * rates[0]
                       for step in rates if step > 0)
            self._note_unpaid(batch, None if pays else seconds[0] * (1 + reused))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("adaptive: batch %d, mean slope %.2f, realized over expected drafts %.2f, expected tokens/s "
                      "by budget %s", batch, statistics.fmean(slope for slope, _ in slopes), factor,
                      {step: round(rate, 1) for step, rate in rates.items()})
        if best > 0:
            self.plain_rounds, self.plain_seconds, self.explore_interval = 0, 0.0, self.explore_every
        else:
            self.plain_rounds += 1
            self.plain_seconds += seconds[0]
            tries = [step for step in rates if step > 0]
            if tries:
                trial = max(tries, key=lambda step: rates[step])
                self.try_extra_s = max(0.0, seconds[trial] - seconds[0])
                if self._try_due(self.plain_rounds, self.plain_seconds):
                    best = trial
                    self.plain_rounds, self.plain_seconds = 0, 0.0
                    self.explore_interval = min(2 * self.explore_interval, self.EXPLORE_AT_MOST)
        if best == 0:
            self.plain_signature, self.plain_round_s = signature, seconds[0]
        else:
            self.pending = (batch_bucket(batch), drafted[best])
        self.last_choice = best
        self.expected = (batch + factor * drafted[best], seconds[best])
        return best
