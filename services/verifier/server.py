"""The verifier service: owns the target, batches requests continuously and drives the rounds.

Each round: every running request that speculates gets a tree from its drafter (one batched message per
drafter), then one target forward verifies all trees and prefills new requests together, then each request
commits what its tree earned and its stream gets those tokens. Requests join and leave between rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from opentelemetry import trace

from treeserve.errors import TreeserveError
from treeserve.loading import LoadedModel
from treeserve.telemetry import Tracing, VerifierMetrics
from treeserve.tree import MAX_BUDGET
from treeserve.v1 import generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier.drafter_link import DraftRound, DrafterLink
from treeserve.verifier.engine import FeatureBacklog, ForwardPlan, Generation, commit_round, forward_batch
from treeserve.verifier.graphs import TreeVerifier, build_verifier
from treeserve.verifier.tensor_parallel import RankLost
from treeserve.wire import FINISH_REASONS, params_from_proto

log = logging.getLogger("treeserve.verifier")


@dataclasses.dataclass
class Running:
    generation: Generation
    outbox: asyncio.Queue  # VerifierServiceGenerateResponse messages, or an Exception to end the stream with
    link: DrafterLink | None  # the drafter holding this request's context; None: no speculation
    span: trace.Span  # the request's span: its prefill and rounds are children


def use_intra_op_threads(count: int) -> None:
    """Set the calling thread's torch intra-op (OpenMP) threads for good. torch sets a thread's count from a
    process-wide value at that thread's first parallel op, which would undo a setting made before it: that first
    initialisation is forced here."""
    torch.get_num_threads()
    torch.set_num_threads(count)


class Scheduler:
    """Admits a request when it has a batch place and its whole KV (prompt + max_new_tokens + one tree) fits in
    what the pool has not promised to the running ones, so a round never runs out of blocks."""

    def __init__(self, target: LoadedModel, verifier: TreeVerifier, links: list[DrafterLink], max_batch: int,
                 tracing: Tracing | None = None, metrics: VerifierMetrics | None = None,
                 adaptive: AdaptiveSpeculation | None = None, compute: ThreadPoolExecutor | None = None):
        self.target, self.verifier, self.links, self.max_batch = target, verifier, links, max_batch
        # The thread where a forward blocks (`_forward`): the service's one thread for torch's parallel work.
        self.compute = compute or ThreadPoolExecutor(1, "verifier-compute")
        # With `adaptive`, each round's tree budget is chosen for tokens per second (0: plain, no drafter call);
        # without, every request drafts its own budget.
        self.adaptive = adaptive
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or VerifierMetrics()
        self.waiting: dict[str, Running] = {}
        self.running: dict[str, Running] = {}
        self.wake = asyncio.Event()
        self.pool_tokens = verifier.pool.allocator.num_blocks * verifier.pool.block_size
        self.round_in_flight = False
        self.release_after_round: list[Generation] = []
        # The target layers whose hidden states the drafters need, known once one has connected; every drafter
        # of a verifier must want the same ones.
        self.feature_layer_ids: tuple[int, ...] = ()
        if adaptive is not None:  # a request that could draft costs in plain rounds only where it keeps features
            adaptive.drafting_costs_in_plain_rounds = False
        self.feature_backlog = FeatureBacklog()  # kept features on their way to the host, flushed before drafts
        # This round's (budget chosen, tokens and seconds adaptive speculation expected of it), when it had an
        # estimate. Checked against the round (`_check_expectation`) unless the round prefilled a prompt, whose
        # work was not in the estimate.
        self.round_expected: tuple[int, float, float] | None = None
        # Set when a tensor-parallel rank is gone: nothing runs again; `on_rank_lost(error)` takes the service down.
        self.lost: RankLost | None = None
        self.on_rank_lost = None

    async def connect(self, link: DrafterLink) -> bool:
        """Try to (re)connect a drafter; False unless it is up and wants the features the others want."""
        if not await link.connect():
            return False
        if link.feature_layer_ids and not self.feature_layer_ids:
            self.feature_layer_ids = link.feature_layer_ids
            if self.adaptive is not None:
                self.adaptive.drafting_costs_in_plain_rounds = True
        if link.feature_layer_ids and link.feature_layer_ids != self.feature_layer_ids:
            log.error("drafter %s wants features of target layers %s, the others %s: not using it", link.address,
                      list(link.feature_layer_ids), list(self.feature_layer_ids))
            await link.disable()
            return False
        return True

    def speculates_new_request(self) -> bool:
        """Whether a new request that asks for trees should draft (with adaptive speculation, not where drafting
        has stopped paying at the batch it joins: AdaptiveSpeculation.speculates_new_request)."""
        if self.adaptive is None:
            return True
        joining = min(self.max_batch, len(self.running) + len(self.waiting) + 1)
        if self.adaptive.speculates_new_request(joining):
            return True
        self.metrics.plain_admissions.inc()
        return False

    def can_draft(self, entry: Running, link: DrafterLink) -> bool:
        """A drafter that conditions on features can take only requests that kept them from their prefill."""
        return not link.feature_layer_ids or entry.generation.keep_features

    def blocks_promised(self, generation: Generation) -> int:
        return self.verifier.pool.blocks_for(generation.kv_tokens_needed)

    def fits(self, generation: Generation) -> bool:
        promised = sum(self.blocks_promised(entry.generation) for entry in self.running.values())
        return promised + self.blocks_promised(generation) <= self.verifier.pool.allocator.num_blocks

    def submit(self, request_id: str, generation: Generation,
               span: trace.Span = trace.INVALID_SPAN) -> asyncio.Queue:
        """Queue a request; one that could never fit the KV pool is refused (TreeserveError), and every request
        once a tensor-parallel rank is gone (RankLost)."""
        if self.lost is not None:
            raise self.lost
        if generation.kv_tokens_needed > self.pool_tokens:
            raise TreeserveError(f"the request needs {generation.kv_tokens_needed} tokens of KV cache (prompt + "
                                 f"max_new_tokens + budget), and this verifier holds {self.pool_tokens}")
        speculate = generation.budget > 0 and bool(self.links)
        link = min(self.links, key=self._load) if speculate else None
        self.waiting[request_id] = Running(generation, asyncio.Queue(), link, span)
        self._update_gauges()
        self.wake.set()
        return self.waiting[request_id].outbox

    def cancel(self, request_id: str) -> bool:
        """Free the request's KV blocks and tell its drafter to forget it. False when the request had already
        left (finished or failed). During a round the blocks go back once the round's forward has ended: it may
        still be writing to them, or reserving more."""
        entry = self.waiting.pop(request_id, None) or self.running.pop(request_id, None)
        if entry is not None:
            if self.round_in_flight:
                self.release_after_round.append(entry.generation)
            else:
                entry.generation.release()
            if entry.link is not None:
                entry.link.forget(request_id)
            if self.adaptive is not None:
                self.adaptive.forget(request_id)
        self._update_gauges()
        return entry is not None

    def _update_gauges(self) -> None:
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        allocator = self.verifier.pool.allocator
        self.metrics.kv_slots.set((allocator.num_blocks - allocator.free_count) * self.verifier.pool.block_size)

    def _load(self, link: DrafterLink) -> int:
        return sum(1 for entry in self.running.values() if entry.link is link)

    def lose(self, error: RankLost) -> None:
        """A tensor-parallel rank is gone: fail every request (UNAVAILABLE to its client) and stop scheduling."""
        if self.lost is not None:
            return
        log.error("%s: failing every request and going down", error)
        self.lost = error
        self._fail([*self.waiting, *self.running], error)
        self.wake.set()
        if self.on_rank_lost is not None:
            self.on_rank_lost(error)

    async def run(self) -> None:
        while self.lost is None:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            self._admit()
            self._update_gauges()
            try:
                await self._round()
            except RankLost as error:
                self.lose(error)
            except Exception as error:
                if self.verifier.mirror is not None:  # the ranks may have parted ways mid-forward: no next round
                    log.exception("round failed")
                    self.lose(RankLost(f"a round failed on a tensor-parallel verifier ({error})"))
                    continue
                # A bug or device failure: fail this batch, keep serving the next.
                log.exception("round failed")
                self._fail(list(self.running), error)

    def _admit(self) -> None:
        """Waiting requests join the batch, first come first served, while they have places and KV room."""
        while self.waiting and len(self.running) < self.max_batch:
            request_id = next(iter(self.waiting))
            if not self.fits(self.waiting[request_id].generation):
                break  # it waits for running requests to finish
            self.running[request_id] = self.waiting.pop(request_id)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """End these requests with `error` (their streams close with its status) and free what they hold."""
        for request_id in request_ids:
            entry = self.waiting.get(request_id) or self.running[request_id]
            entry.outbox.put_nowait(error)
            self.metrics.requests.labels(outcome="error").inc()
            self.cancel(request_id)

    def _stop_drafting_where_it_does_not_pay(self) -> None:
        """Where adaptive speculation has given up drafting at this batch, the running requests that could draft
        decode plainly from now on, as new ones are admitted, but for the newest few (`drafting_kept`). A request
        that could draft costs even in plain rounds (its kept features, its place in each choice), and requests
        admitted drafting before a batch filled up were most of the drafting ones in a 64-request batch on the
        H200 (docs/benchmarks.md)."""
        kept = self.adaptive.drafting_kept(len(self.running))
        if kept is None:
            return
        drafting = [request_id for request_id, entry in self.running.items() if entry.link is not None]
        for request_id in drafting[:max(0, len(drafting) - kept)]:  # oldest first: admission order
            entry = self.running[request_id]
            entry.link.forget(request_id)
            entry.link = None
            entry.generation.stop_drafting()
            self.adaptive.forget(request_id)
            self.metrics.drafting_stopped.inc()

    async def _drafts(self, spans: dict[str, trace.Span]) -> tuple[dict, float]:
        """Trees for every prefilled, speculating request, one batched round trip per drafter; and the seconds
        spent waiting on drafters: reconnecting, and the longest round trip (a failed one's until it failed)."""
        if self.adaptive is not None:
            self._stop_drafting_where_it_does_not_pay()
        connecting_started = time.perf_counter()
        for entry in self.running.values():
            if entry.link is not None and not entry.link.up and not await self.connect(entry.link):
                healthy = [link for link in self.links if link.up]  # move to a drafter that works
                if healthy:
                    entry.link = min(healthy, key=self._load)
        connecting_s = time.perf_counter() - connecting_started
        speculating = {request_id: entry for request_id, entry in self.running.items()
                       if entry.link is not None and entry.link.up and entry.generation.prefilled
                       and self.can_draft(entry, entry.link)}
        budgets = {request_id: entry.generation.budget for request_id, entry in speculating.items()}
        if self.adaptive is not None and budgets:
            chosen = self.adaptive.choose(budgets, len(self.running))
            if self.adaptive.expected is not None:
                self.round_expected = (chosen, *self.adaptive.expected)
            self.metrics.round_budget.set(chosen)
            self.metrics.rounds_by_budget.labels(budget=str(chosen)).inc()
            budgets = {request_id: min(chosen, own) for request_id, own in budgets.items() if chosen > 0}
        if budgets:
            self.feature_backlog.flush()  # the drafters get every feature row up to now
        by_link: dict[DrafterLink, dict[str, Generation]] = {}
        for request_id in budgets:
            entry = speculating[request_id]
            by_link.setdefault(entry.link, {})[request_id] = entry.generation
        trace_contexts = {request_id: self.tracing.carrier(span) for request_id, span in spans.items()}
        trees = {}
        rounds: list[DraftRound] = await asyncio.gather(
            *(link.draft(requests, trace_contexts, budgets) for link, requests in by_link.items()))
        for found in rounds:
            trees.update(found.trees)
            if found.trees:
                self.metrics.round_seconds.labels(phase="draft").observe(found.propose_s)
                self.metrics.round_seconds.labels(phase="transport").observe(
                    max(0.0, found.round_trip_s - found.propose_s))
        if self.adaptive is not None and budgets and any(found.trees for found in rounds):
            self.adaptive.observe_draft(len(self.running), max(budgets.values()),
                                        max(found.round_trip_s for found in rounds if found.trees))
        return trees, connecting_s + max((found.round_trip_s for found in rounds), default=0.0)

    def _start_spans(self) -> dict[str, trace.Span]:
        """One span per request for this round (its prefill, or a verified tree), when tracing is on."""
        if not self.tracing.enabled:
            return {}
        return {request_id: self.tracing.tracer.start_span(
                    "verifier.round" if entry.generation.prefilled else "verifier.prefill",
                    context=trace.set_span_in_context(entry.span))
                for request_id, entry in self.running.items()}

    async def _round(self) -> None:
        started = time.perf_counter()
        self.round_expected = None
        spans = self._start_spans()
        try:
            tokens, with_prompts = await self._verify(spans)
        finally:
            for span in spans.values():
                span.end()
        seconds = time.perf_counter() - started
        self.metrics.round_seconds.labels(phase="round").observe(seconds)
        if with_prompts:  # beside all rounds: where a mode's rounds with prompts cost more, and how many there were
            self.metrics.round_seconds.labels(phase="round_with_prompts").observe(seconds)
        else:
            self._check_expectation(tokens, seconds)

    def _check_expectation(self, tokens: int, seconds: float) -> None:
        """Adaptive speculation's expected tokens and seconds for this round, beside what it emitted and took (by
        budget, in the metrics): where its model of costs and acceptance errs, and which way."""
        if self.round_expected is None:
            return
        budget, expected_tokens, expected_s = self.round_expected
        label = str(budget)
        self.metrics.checked_rounds.labels(budget=label).inc()
        self.metrics.checked_tokens.labels(budget=label, kind="expected").inc(expected_tokens)
        self.metrics.checked_tokens.labels(budget=label, kind="realized").inc(tokens)
        self.metrics.checked_seconds.labels(budget=label, kind="expected").inc(expected_s)
        self.metrics.checked_seconds.labels(budget=label, kind="realized").inc(seconds)

    async def _forward(self, plans: list[ForwardPlan]) -> tuple[list, list]:
        """forward_batch, with its results on the device when this returns, while the loop goes on serving.

        On one GPU, the forward is launched from the loop's own thread (graph replays return at once) and only the
        wait for the device goes to a worker thread. With the whole forward in a worker, each of its torch calls
        had to win the GIL back from the loop, which at 64 requests is busy with their streams: on the H200 host a
        64-request plain round took 12.1 ms that way against 11.0 (docs/benchmarks.md). The whole forward does run
        in a worker where it blocks: on the CPU (it computes as it is called), and under tensor parallelism, where
        a collective with a dead rank may never return and the loop must stay free to notice and fail the streams."""
        args = (self.target.model, plans, self.feature_layer_ids, self.verifier)
        if self.verifier.pool.data.device.type != "cuda" or self.verifier.mirror is not None:
            return await asyncio.get_running_loop().run_in_executor(self.compute, forward_batch, *args)
        found = forward_batch(*args)
        finished = torch.cuda.Event()
        finished.record()
        await asyncio.to_thread(finished.synchronize)
        return found

    async def _verify(self, spans: dict[str, trace.Span]) -> tuple[int, bool]:
        """One round's drafts, forward and commits; returns the tokens it committed, and whether it prefilled a
        prompt."""
        round_started = time.perf_counter()
        trees, drafters_s = await self._drafts(spans)
        plans = {}
        for request_id, entry in self.running.items():
            try:
                plans[request_id] = entry.generation.plan(trees.get(request_id))
            except TreeserveError as error:  # a malformed tree: verify nothing this round rather than fail
                log.warning("request %s: %s; decoding without a tree this round", request_id, error)
                plans[request_id] = entry.generation.plan(None)
        if not plans:
            return 0, False
        started = time.perf_counter()
        self.round_in_flight = True
        try:  # always the same feature layers: the CUDA graphs were captured computing them
            logits, features = await self._forward(list(plans.values()))
        finally:
            self.round_in_flight = False
            for generation in self.release_after_round:
                generation.release()
            self.release_after_round.clear()
            self._update_gauges()
        alive = [request_id for request_id in plans if request_id in self.running]  # some may have been cancelled
        index = {request_id: i for i, request_id in enumerate(plans)}
        committed_lists = commit_round([self.running[r].generation for r in alive], [plans[r] for r in alive],
                                       [logits[index[r]] for r in alive], [features[index[r]] for r in alive],
                                       self.feature_backlog)
        prompt_free = all(plan.tree is not None for plan in plans.values())
        verified = []  # (drafted nodes, accepted depth) of each request's tree, for the metrics
        for request_id, committed in zip(alive, committed_lists):
            entry, plan = self.running[request_id], plans[request_id]
            generation = entry.generation
            if plan.tree is not None:
                verified.append((plan.tree.size - 1, generation.last_accepted))
                if self.adaptive is not None:
                    self.adaptive.observe_acceptance(request_id, plan.tree.size - 1, len(committed))
            if request_id in spans:
                spans[request_id].set_attributes(round_attributes(plan, generation, committed, len(plans)))
                if self.adaptive is not None:
                    spans[request_id].set_attribute("treeserve.round_budget", self.adaptive.last_choice)
            entry.outbox.put_nowait(verifier_pb2.VerifierServiceGenerateResponse(token_ids=committed))
            if generation.finished:
                entry.outbox.put_nowait(final_message(generation))
                self.metrics.requests.labels(outcome=generation.finish_reason).inc()
                self.cancel(request_id)
        round_tokens = sum(map(len, committed_lists))
        if self.adaptive is not None and prompt_free:
            # The round's cost beside its wait on drafters, taken once its tokens are on their way: everything a
            # tree adds to the host's work (plans, staging, the acceptance walk, the messages) is in it, as well
            # as the forward, whose results commit_round waited for. Timing the forward alone left out 1-4 ms of a
            # 16-64 request n-gram round on the H200, and trees were chosen where plain rounds emitted more a
            # second (docs/benchmarks.md). A drafter that failed or was reconnected to is waited on apart, so
            # its stall does not price this round's verification.
            self.adaptive.observe_verify(len(plans), max(plan.tree.size for plan in plans.values()),
                                         time.perf_counter() - round_started - drafters_s)
        if self.adaptive is not None:
            checked = self.adaptive.observe_round(len(alive), round_tokens, drafted=any(nodes for nodes, _ in verified))
            if checked is not None:
                batch, factor = checked
                self.metrics.realized_over_expected.labels(batch=str(batch)).set(factor)
        self.metrics.generated_tokens.inc(round_tokens)
        self.metrics.record_trees(verified)
        self.metrics.round_seconds.labels(phase="verify").observe(time.perf_counter() - started)
        return round_tokens, not prompt_free


def round_attributes(plan: ForwardPlan, generation: Generation, committed: list[int], batch_size: int) -> dict:
    attributes = {"treeserve.batch_size": batch_size, "treeserve.committed": len(committed)}
    if plan.tree is None:
        return attributes | {"treeserve.prompt_tokens": len(plan.tokens)}
    return attributes | {"treeserve.tree_nodes": plan.tree.size - 1, "treeserve.accepted": generation.last_accepted}


def final_message(generation: Generation) -> verifier_pb2.VerifierServiceGenerateResponse:
    result = generation.result()
    return verifier_pb2.VerifierServiceGenerateResponse(
        finish_reason=FINISH_REASONS[result.finish_reason],
        usage=generation_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids)),
        stats=generation_pb2.SpeculationStats(rounds=result.rounds, round_tokens=result.round_tokens,
                                              drafted_tokens=generation.drafted_tokens,
                                              mean_accepted=result.mean_accepted),
        seed=result.seed)


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, name: str, links: list[DrafterLink], default_budget: int, default_max_new_tokens: int,
                 max_batch: int, tracing: Tracing | None = None, metrics: VerifierMetrics | None = None):
        self.name, self.links = name, links
        self.default_budget, self.default_max_new_tokens, self.max_batch = (
            default_budget, default_max_new_tokens, max_batch)
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or VerifierMetrics()
        self.scheduler: Scheduler | None = None  # set once the model is loaded

    def register(self, server: grpc.aio.Server) -> list[str]:
        """For serving.start: add this servicer and name it for reflection."""
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(self, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name]

    def attach(self, target: LoadedModel, verifier: TreeVerifier | None = None,
               adaptive: AdaptiveSpeculation | None = None, compute: ThreadPoolExecutor | None = None
               ) -> Scheduler:
        """Start scheduling on a loaded target; `verifier` defaults to an eager one with a default-sized pool;
        `adaptive`: choose each round's budget (else every request drafts its own); `compute`: the thread that
        loaded the target, to run the forwards that block."""
        self.target = target
        verifier = verifier or build_verifier(target.model, self.max_batch)
        self.scheduler = Scheduler(target, verifier, self.links, self.max_batch, self.tracing, self.metrics,
                                   adaptive, compute)
        return self.scheduler

    async def Generate(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        try:
            params = params_from_proto(request.sampling, request.stop, self.default_max_new_tokens)
            requested = request.speculation.budget or self.default_budget
            if requested > MAX_BUDGET:
                raise TreeserveError(f"budget must be between 1 and {MAX_BUDGET}, got {requested}")
            budget = 0 if request.speculation.disabled or not self.links else requested

            def generation_with(budget: int) -> Generation:  # (checks the request)
                # A speculating request keeps its target features in case its drafter conditions on them.
                features = self.scheduler.feature_layer_ids if budget > 0 else ()
                return Generation(self.target.model, self.target.tokenizer, list(request.prompt_token_ids),
                                  params, None, budget, features, verifier=self.scheduler.verifier)

            generation = generation_with(budget)
            if budget and not self.scheduler.speculates_new_request():
                budget = 0  # drafting does not pay at this load: plain decoding, without its bookkeeping
                generation = generation_with(budget)
        except TreeserveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = f"{request.request_id or 'request'}-{uuid.uuid4().hex[:8]}"
        span = self.tracing.tracer.start_span(
            "verifier.generate", context=self.tracing.parent(context.invocation_metadata() or ()),
            kind=trace.SpanKind.SERVER, attributes={"treeserve.request_id": request_id,
                                                    "treeserve.prompt_tokens": len(request.prompt_token_ids),
                                                    "treeserve.budget": budget})
        try:
            outbox = self.scheduler.submit(request_id, generation, span)
        except TreeserveError as error:
            span.end()
            code = grpc.StatusCode.UNAVAILABLE if isinstance(error, RankLost) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(error))
        try:
            while True:
                message = await outbox.get()
                if isinstance(message, RankLost):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"verifier going down: {message}")
                if isinstance(message, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"verification failed: {message}")
                yield message
                if message.finish_reason:
                    span.set_attributes({"treeserve.completion_tokens": message.usage.completion_tokens,
                                         "treeserve.mean_accepted": message.stats.mean_accepted})
                    return
        finally:  # finished, failed, or the client went away: free everything the request held
            if self.scheduler.cancel(request_id):
                self.metrics.requests.labels(outcome="cancelled").inc()
            span.end()

    async def GetInfo(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        cfg = self.target.model.config
        return verifier_pb2.VerifierServiceGetInfoResponse(
            model=self.name, vocab_size=cfg.vocab_size, max_context=cfg.max_context,
            eos_token_ids=sorted(self.target.tokenizer.eos_ids), max_budget=MAX_BUDGET,
            default_budget=self.default_budget, drafters=[link.address for link in self.links])
