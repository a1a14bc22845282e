"""One speculative round of the verifier's running batch, top to bottom: drafts -> plan -> forward -> commit -> emit.

The scheduler (server.py) admits requests, keeps their KV promises, handles cancellation and runs the loop: each
turn of it is one `speculative_round`, which returns a `RoundReport` of what happened. What watches the rounds (the
speculation policy's models, the metrics, the spans) reads that report afterwards, outside the round.

How much a round drafts is a `Speculation` policy's: `FixedSpeculation` (every request its own budget) or
`treeserve.verifier.adaptive.AdaptiveSpeculation` (the budget expected to give the most tokens per second).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch
from opentelemetry import trace

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM
from treeserve.tree import DraftTree
from treeserve.v1 import generation_pb2, verifier_pb2
from treeserve.verifier.drafter_link import DraftRound, DrafterLink
from treeserve.verifier.engine import (FeatureCopies, ForwardPlan, Generation, HostPicks, commit_round, forward_batch,
                                       pick_round)
from treeserve.verifier.graphs import TreeVerifier
from treeserve.wire import FINISH_REASONS

log = logging.getLogger("treeserve.verifier")


class Outbox(Protocol):
    """Where a request's messages go: VerifierServiceGenerateResponse messages, or an Exception that ends it (an
    asyncio.Queue that its Generate stream reads, or its Session stream's)."""

    def put_nowait(self, message) -> None: ...


@dataclasses.dataclass
class Running:
    generation: Generation
    outbox: Outbox
    link: DrafterLink | None  # the drafter holding this request's context; None: no speculation
    span: trace.Span  # the request's span: its prefill and rounds are children

    @property
    def asks_for_a_tree(self) -> bool:
        """Prefilled, and its drafter is up and can take it: one that conditions on target features takes only
        requests that kept theirs from their prefill."""
        link, generation = self.link, self.generation
        return (link is not None and link.up and generation.prefilled
                and (not link.feature_layer_ids or generation.features.keep))


@dataclasses.dataclass(frozen=True)
class Choice:
    """A policy's tree budget for one round (0: plain decoding, no drafter call), whether the trees are prompt
    lookup's alone (`lookup`: from a drafter with DrafterLink.lookup_trees), and what it expects of it."""

    budget: int
    expected: tuple[float, float] | None = None  # (tokens, seconds) of the round; None: no estimate to go by
    # The tokens beyond one a request that the round's trees are expected to add, checked against what they add
    # (AdaptiveSpeculation.observe); None where the choice made no such estimate.
    expected_drafted: float | None = None
    lookup: bool = False
    # The cost model's estimate of the round's seconds, before calibration, where the round catches the drafters'
    # contexts up: what its trees took is checked against it (CostModel.observe_tree_round). None otherwise, and
    # for a try, whose catch-up is priced apart.
    estimated_s: float | None = None

    @property
    def label(self) -> str:
        """The choice in the metrics: its budget, `lookup-` before it for lookup's trees."""
        return f"lookup-{self.budget}" if self.lookup else str(self.budget)


@dataclasses.dataclass
class RequestReport:
    """One request's part of a round."""

    request_id: str
    committed: int  # tokens emitted
    prompt_tokens: int = 0  # > 0: the round prefilled this many (and verified no tree)
    tree_nodes: int = 0  # drafted nodes verified, root excluded (0: a plain step, or a prefill)
    accepted: int = 0  # the depth of the accepted path among them
    # Of them, along its tree's lookup chain: what prompt lookup alone would have accepted (a merged drafter's
    # own tree; None otherwise).
    lookup_accepted: int | None = None
    finish_reason: str | None = None  # set once the request has finished


@dataclasses.dataclass
class RoundReport:
    """What one round did: its sizes, what each request emitted, and how long each phase took."""

    batch: int  # requests running as it began: the batch its budget was chosen and its trees drafted for
    choice: Choice | None  # the policy's round budget, where it chose one
    budgets: dict[str, int]  # the trees asked of the drafters, by request
    drafts: list[DraftRound]  # what each drafter asked brought back
    forward_batch: int = 0  # requests in the forward (0: none; those cancelled while drafting are not in it)
    largest_tree: int = 0  # nodes of the forward's largest tree, root included
    with_prompts: bool = False  # whether the forward prefilled a prompt (its cost is not a verification's)
    requests: list[RequestReport] = dataclasses.field(default_factory=list)  # those still running after it
    draft_s: float = 0.0  # from the round's start to the trees back
    plan_s: float = 0.0
    verify_s: float = 0.0  # the forward and the commits
    emit_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(request.committed for request in self.requests)

    @property
    def lookup(self) -> bool:
        """Whether its trees were prompt lookup's alone."""
        return self.choice is not None and self.choice.lookup

    @property
    def drafted(self) -> bool:
        """Whether any tree reached the forward (a drafter that was down says nothing of what trees earn)."""
        return any(request.tree_nodes for request in self.requests)

    @property
    def drafters_s(self) -> float:
        """The wait on drafters: the longest round trip (a failed one's until it failed)."""
        return max((found.round_trip_s for found in self.drafts), default=0.0)

    @property
    def seconds(self) -> float:
        return self.draft_s + self.plan_s + self.verify_s + self.emit_s

    def log_line(self) -> str:
        """The round in one line, as the verifier logs it at DEBUG (`treeserve.bench.round_log` reads it back)."""
        expected = self.choice.expected if self.choice else None
        expected_text = f"{expected[0]:.2f} in {expected[1] * 1e3:.3f}" if expected else "-"
        catch_up = " (catch-up)" if any(found.catch_up for found in self.drafts) else ""
        prompts = " (with prompts)" if self.with_prompts else ""
        return (f"round of batch {self.batch}, choice {self.choice.label if self.choice else '-'}: {self.tokens} "
                f"tokens in {self.seconds * 1e3:.3f} ms (expected {expected_text}), of them drafters "
                f"{self.drafters_s * 1e3:.3f} ms{catch_up}{prompts}; choice and messages "
                f"{(self.draft_s - self.drafters_s) * 1e3:.3f}, plan {self.plan_s * 1e3:.3f}, forward and commit "
                f"{self.verify_s * 1e3:.3f}, emit {self.emit_s * 1e3:.3f} ms")

    @property
    def verify_phase_s(self) -> float:
        """The forward, the commits and the messages out: the metrics' verify phase."""
        return self.verify_s + self.emit_s


class Speculation(Protocol):
    """How much a round drafts, and what the policy learns from each round."""

    def round_budgets(self, asked: dict[str, int], batch: int, lookup: bool = False
                      ) -> tuple[dict[str, int], Choice | None]:
        """This round's tree budget per request (`asked`: each request that can draft, its own budget), leaving
        out those that decode plainly this round; and the choice made, if any. `lookup`: whether the drafters can
        also draft by prompt lookup alone (the choice may then ask for that)."""

    def observe(self, report: RoundReport) -> tuple[int, float] | None:
        """Learn from a round; where it checked its model, (batch bucket, realized over expected tokens)."""

    def admits_drafting(self, batch: int) -> bool:
        """Whether a new request that asks for trees, making a batch of `batch`, drafts."""

    def drafting_kept(self, batch: int) -> int | None:
        """How many of a batch's drafting requests go on drafting; None: all."""

    def forget(self, request_id: str) -> None:
        """The request has left, or stopped drafting."""


class FixedSpeculation:
    """Every request that can draft asks for its own budget in every round, its drafter's own tree."""

    def round_budgets(self, asked: dict[str, int], batch: int, lookup: bool = False
                      ) -> tuple[dict[str, int], Choice | None]:
        return asked, None

    def observe(self, report: RoundReport) -> tuple[int, float] | None:
        return None

    def admits_drafting(self, batch: int) -> bool:
        return True

    def drafting_kept(self, batch: int) -> int | None:
        return None

    def forget(self, request_id: str) -> None:
        pass


class TargetRunner:
    """Runs the rounds' target forwards for the scheduler, with the feature layers its drafters asked for (the
    CUDA graphs were captured computing them), and gives back the KV blocks of a request cancelled during a
    forward only once that forward, which may still write them or reserve more, has ended."""

    def __init__(self, model: DecoderLM, verifier: TreeVerifier, compute: ThreadPoolExecutor):
        self.model, self.verifier, self.compute = model, verifier, compute
        self.feature_layer_ids: tuple[int, ...] = ()
        self.feature_copies = FeatureCopies()  # drafted trees' kept features on their way to the host
        self.in_flight = False
        self.release_after: list[Generation] = []

    def release(self, generation: Generation) -> None:
        if self.in_flight:
            self.release_after.append(generation)
        else:
            generation.release()

    async def forward(self, plans: list[ForwardPlan], generations: list[Generation]
                      ) -> tuple[list, list, list[list[int]]]:
        """forward_batch, its results on the device when this returns, and each plan's picks for its generation
        (pick_round) on the host, while the loop goes on serving.

        On one GPU the forward is launched from the loop's own thread (graph replays return at once), the picks
        and their copy to the host behind it, and the loop polls for their end (`wait_for_device`): from a
        worker, each torch call would have to win the GIL back from the loop, busy with the streams. Where the
        forward blocks, all of it runs on the compute thread: on the CPU, which computes as it is called, and
        under tensor parallelism, where a collective with a dead rank may never return and the loop must stay
        free to notice and fail the streams."""
        self.in_flight = True
        try:
            self.verifier.pool.launch_held_moves()  # (the last commit's, if the loop has not launched them yet)
            args = (self.model, plans, self.feature_layer_ids, self.verifier, generations, self.feature_copies)
            if self.verifier.pool.data.device.type != "cuda" or self.verifier.mirror is not None:
                return await asyncio.get_running_loop().run_in_executor(self.compute, forward_and_picks, *args)
            logits, features, picks = launch_forward_and_picks(*args)
            staged, moved = self.verifier.runner.staging_copies, self.verifier.pool.move_copies
            copies = staged.queued, moved.queued
            await wait_for_device(picks.copied)
            staged.settled(copies[0])  # (queued before the picks: made)
            moved.settled(copies[1])
            return logits, features, picks.lists()
        finally:
            self.in_flight = False
            for generation in self.release_after:
                generation.release()
            self.release_after.clear()


def launch_forward_and_picks(model: DecoderLM, plans: list[ForwardPlan], feature_layer_ids: tuple[int, ...],
                             verifier: TreeVerifier, generations: list[Generation],
                             copies: FeatureCopies | None = None) -> tuple[list, list, HostPicks]:
    """forward_batch, then the round's picks and their copy to the host queued behind it, then the copies of the
    drafted trees' kept features (FeatureCopies.prepare), waiting for none."""
    logits, features = forward_batch(model, plans, feature_layer_ids, verifier)
    picks = HostPicks(pick_round(generations, plans, logits))
    if copies is not None:
        features = copies.prepare(features, plans, [generation.features.keep for generation in generations])
    return logits, features, picks


def forward_and_picks(*args) -> tuple[list, list, list[list[int]]]:
    """launch_forward_and_picks, waited for."""
    logits, features, picks = launch_forward_and_picks(*args)
    return logits, features, picks.lists()


# How long the loop polls for a forward's end before it waits in a thread: longer than a small target's round.
DEVICE_POLL_S = 0.02


async def wait_for_device(finished: torch.cuda.Event) -> None:
    """Until the device has passed `finished`, serving the streams meanwhile. The loop polls, yielding to every
    other task between polls: a wait in a worker thread ends in waking the loop's thread, which a small target's
    short round feels; a forward that runs long (a batch of long prompts) is waited for in a thread."""
    deadline = time.perf_counter() + DEVICE_POLL_S
    while not finished.query():
        if time.perf_counter() > deadline:
            await asyncio.to_thread(finished.synchronize)
            return
        await asyncio.sleep(0)


async def speculative_round(running: dict[str, Running], speculation: Speculation, runner: TargetRunner,
                            trace_contexts: dict[str, dict[str, str]]) -> RoundReport:
    """One round of the running batch (`trace_contexts`: W3C headers of each request's round span, for its
    drafter; empty when tracing is off). Requests cancelled meanwhile leave `running` and the round."""
    started, batch = time.perf_counter(), len(running)
    # Drafts: the policy's budget for each request that can draft, one batched round trip per drafter.
    asking = {request_id: entry for request_id, entry in running.items() if entry.asks_for_a_tree}
    budgets, choice = speculation.round_budgets(
        {request_id: entry.generation.budget for request_id, entry in asking.items()}, batch,
        bool(asking) and all(entry.link.lookup_trees for entry in asking.values()))
    drafts = await draft(asking, budgets, trace_contexts, runner.feature_copies, choice is not None and choice.lookup)
    trees = {request_id: tree for found in drafts for request_id, tree in found.trees.items()}
    await send_lagging_rows(asking, batch, runner.feature_copies)
    drafted = time.perf_counter()
    report = RoundReport(batch, choice, budgets, drafts, draft_s=drafted - started)
    # Plan: each request's rows of one forward, its tree's or its prompt's (the root alone: a plain step).
    plans = {request_id: plan(request_id, entry.generation, trees.get(request_id))
             for request_id, entry in running.items()}
    if not plans:
        return report
    planned = time.perf_counter()
    report.plan_s = planned - drafted
    # Forward: the target over every request's rows at once.
    logits, features, choices = await runner.forward(
        list(plans.values()), [running[request_id].generation for request_id in plans])
    # Commit: each request keeps its longest accepted path and the target's own next token.
    alive = {request_id: i for i, request_id in enumerate(plans) if request_id in running}
    generations = [running[request_id].generation for request_id in alive]
    committed = commit_round(generations, [plans[request_id] for request_id in alive],
                             [logits[i] for i in alive.values()], [features[i] for i in alive.values()],
                             runner.feature_copies, [choices[i] for i in alive.values()], hold_moves=True)
    # The accepted paths' KV move is launched when the loop next runs its ready tasks: after the next round's Draft
    # messages are written, while the drafters draft (a reservation or forward before then launches it first).
    asyncio.get_running_loop().call_soon(runner.verifier.pool.launch_held_moves)
    verified = time.perf_counter()
    report.verify_s = verified - planned
    # Emit: the committed tokens on each request's stream, then the final message of one that has finished.
    for request_id, generation, tokens in zip(alive, generations, committed):
        outbox = running[request_id].outbox
        outbox.put_nowait(verifier_pb2.VerifierServiceGenerateResponse(token_ids=tokens))
        if generation.finished:
            outbox.put_nowait(final_message(generation))
        report.requests.append(request_report(request_id, plans[request_id], generation, tokens))
    report.forward_batch = len(plans)
    report.largest_tree = max((plan.tree.size for plan in plans.values() if plan.tree is not None), default=0)
    report.with_prompts = any(plan.tree is None for plan in plans.values())
    report.emit_s = time.perf_counter() - verified
    return report


async def draft(asking: dict[str, Running], budgets: dict[str, int], trace_contexts: dict[str, dict[str, str]],
                copies: FeatureCopies, lookup_only: bool = False) -> list[DraftRound]:
    """The trees of the requests given budgets (prompt lookup's alone with `lookup_only`), one batched round trip
    per drafter; for their own trees, the drafters first get every feature row up to now (kept_feature_rows)."""
    if not budgets:
        return []
    if not lookup_only:  # lookup's trees alone need no features
        copies.wait()
    by_link: dict[DrafterLink, dict[str, Generation]] = {}
    for request_id in budgets:
        entry = asking[request_id]
        by_link.setdefault(entry.link, {})[request_id] = entry.generation
    # Every drafter's messages written before the loop runs anything else (tasks for the writes would queue behind
    # what the last round woke: the gateway streams' messages, its metrics), then the replies awaited together.
    sent = [(link, await link.send(requests, trace_contexts, budgets, lookup_only))
            for link, requests in by_link.items()]
    if len(sent) == 1:  # (one drafter, as usual: no task to wake in between)
        link, written = sent[0]
        return [await link.replies(written)]
    return list(await asyncio.gather(*(link.replies(written) for link, written in sent)))


# Feature rows a lone request's draft context may lag its KV cache by (while it decodes plainly, or drafts by prompt
# lookup alone) before they go to its drafter without a tree: fewer than a drafter writes within the block forward
# of a tree (DFlash's staged rows, 32), so that a tree after plain rounds costs about what a steady one does.
CONTEXT_LAG_ROWS = 16


async def send_lagging_rows(asking: dict[str, Running], batch: int, copies: FeatureCopies) -> None:
    """Once a lone request's draft context lags by CONTEXT_LAG_ROWS rows, they go to its drafter on a message that
    asks for no tree (DrafterLink.send_rows): the drafter writes them while the verifier goes on, not before the
    request's next tree. Alone only: in a batch, the sends and the drafter's writes beside the plain rounds cost
    those rounds more than they saved the trees."""
    if batch != 1 or len(asking) != 1:
        return
    (request_id, entry), = asking.items()
    link = entry.link
    if link.feature_layer_ids and entry.generation.cache.length - link.rows_sent.get(request_id, 0) >= CONTEXT_LAG_ROWS:
        copies.wait()  # (rows of the last forward's drafted tree come from their copy to the host)
        await link.send_rows({request_id: entry.generation})


def plan(request_id: str, generation: Generation, tree: DraftTree | None) -> ForwardPlan:
    try:
        return generation.plan(tree)
    except TreeserveError as error:  # a malformed tree: verify nothing this round rather than fail
        log.warning("request %s: %s; decoding without a tree this round", request_id, error)
        return generation.plan(None)


def request_report(request_id: str, plan: ForwardPlan, generation: Generation, committed: list[int]
                   ) -> RequestReport:
    if plan.tree is None:
        return RequestReport(request_id, len(committed), prompt_tokens=len(plan.tokens),
                             finish_reason=generation.finish_reason)
    return RequestReport(request_id, len(committed), tree_nodes=plan.tree.size - 1,
                         accepted=generation.last_accepted, finish_reason=generation.finish_reason,
                         lookup_accepted=generation.last_lookup_accepted if plan.tree.size > 1 else None)


def final_message(generation: Generation) -> verifier_pb2.VerifierServiceGenerateResponse:
    result = generation.result()
    return verifier_pb2.VerifierServiceGenerateResponse(
        finish_reason=FINISH_REASONS[result.finish_reason],
        usage=generation_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids)),
        stats=generation_pb2.SpeculationStats(rounds=result.rounds, round_tokens=result.round_tokens,
                                              drafted_tokens=generation.drafted_tokens,
                                              mean_accepted=result.mean_accepted),
        seed=result.seed)
