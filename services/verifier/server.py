"""The verifier service: owns the target, batches requests continuously and drives the rounds.

The scheduler admits each request once its KV fits, runs one round of the running batch after another
(`treeserve.verifier.round.speculative_round`: drafts, one target forward for every request's tree or prompt,
commits, each stream its tokens), and lets the speculation policy, the metrics and the spans observe each round's
report. Requests join and leave between rounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from opentelemetry import trace

from treeserve import framing, serving
from treeserve.errors import RequestFailed, TreeserveError
from treeserve.loading import LoadedModel
from treeserve.round_traces import RoundTraces
from treeserve.telemetry import Tracing, VerifierMetrics
from treeserve.tree import MAX_BUDGET
from treeserve.v1 import verifier_pb2, verifier_pb2_grpc
from treeserve.verifier.drafter_link import DrafterLink
from treeserve.verifier.engine import Generation
from treeserve.verifier.graphs import TreeVerifier, build_verifier
from treeserve.verifier.round import (FixedSpeculation, Outbox, RequestReport, RoundReport, Running, Speculation,
                                      TargetRunner, speculative_round)
from treeserve.verifier.tensor_parallel import RankLost
from treeserve.wire import params_from_proto

log = logging.getLogger("treeserve.verifier")


def use_intra_op_threads(count: int) -> None:
    """Set the calling thread's torch intra-op (OpenMP) threads for good. torch sets a thread's count from a
    process-wide value at that thread's first parallel op, which would undo a setting made before it: that first
    initialisation is forced here."""
    torch.get_num_threads()
    torch.set_num_threads(count)


class Scheduler:
    """Admits a request when it has a batch place and its whole KV (prompt + max_new_tokens + one tree) fits in
    what the pool has not promised to the running ones, so a round never runs out of blocks; then runs the rounds.

    `speculation`: how much each round drafts (default FixedSpeculation: every request its own budget);
    `compute`: the thread where a forward that blocks runs, the service's one thread for torch's parallel work."""

    def __init__(self, target: LoadedModel, verifier: TreeVerifier, links: list[DrafterLink], max_batch: int,
                 tracing: Tracing | None = None, metrics: VerifierMetrics | None = None,
                 speculation: Speculation | None = None, compute: ThreadPoolExecutor | None = None):
        self.verifier, self.links, self.max_batch = verifier, links, max_batch
        self.runner = TargetRunner(target.model, verifier, compute or ThreadPoolExecutor(1, "verifier-compute"))
        self.speculation = speculation or FixedSpeculation()
        self.tracing = tracing or Tracing.off()
        self.round_traces = RoundTraces("verifier")  # torch profiler traces of rounds, for benches
        self.metrics = metrics or VerifierMetrics()
        self.waiting: dict[str, Running] = {}
        self.running: dict[str, Running] = {}
        self.wake = asyncio.Event()
        # Set when a tensor-parallel rank is gone: nothing runs again; `on_rank_lost(error)` takes the service down.
        self.lost: RankLost | None = None
        self.on_rank_lost = None
        # Read when the metrics are scraped, not kept up to date round by round.
        self.metrics.waiting.set_function(lambda: len(self.waiting))
        self.metrics.running.set_function(lambda: len(self.running))
        self.metrics.kv_slots.set_function(self._kv_slots)

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafters need, known once one has connected; every drafter
        of a verifier must want the same ones."""
        return self.runner.feature_layer_ids

    @property
    def pool_tokens(self) -> int:
        return self.verifier.pool.allocator.num_blocks * self.verifier.pool.block_size

    async def connect(self, link: DrafterLink) -> bool:
        """Try to (re)connect a drafter; False unless it is up and wants the features the others want."""
        if not await link.connect():
            return False
        if link.feature_layer_ids and not self.feature_layer_ids:
            try:  # (room for them was left at start-up for the drafters up then: build_verifier)
                self.verifier.keep_features(link.feature_layer_ids)
            except torch.OutOfMemoryError:
                log.error("drafter %s wants features of target layers %s, and the KV pool has no room left to keep "
                          "them: not using it (start the drafters before the verifier, or lower --kv-cache-tokens)",
                          link.address, list(link.feature_layer_ids))
                await link.disable()
                return False
            self.runner.feature_layer_ids = link.feature_layer_ids
        if link.feature_layer_ids and link.feature_layer_ids != self.feature_layer_ids:
            log.error("drafter %s wants features of target layers %s, the others %s: not using it", link.address,
                      list(link.feature_layer_ids), list(self.feature_layer_ids))
            await link.disable()
            return False
        return True

    def speculates_new_request(self) -> bool:
        """Whether a new request that asks for trees should draft (not where the policy finds that drafting has
        stopped paying at the batch it joins)."""
        joining = min(self.max_batch, len(self.running) + len(self.waiting) + 1)
        if self.speculation.admits_drafting(joining):
            return True
        self.metrics.plain_admissions.inc()
        return False

    def blocks_promised(self, generation: Generation) -> int:
        return self.verifier.pool.blocks_for(generation.kv_tokens_needed)

    def fits(self, generation: Generation) -> bool:
        promised = sum(self.blocks_promised(entry.generation) for entry in self.running.values())
        return promised + self.blocks_promised(generation) <= self.verifier.pool.allocator.num_blocks

    def submit(self, request_id: str, generation: Generation, span: trace.Span = trace.INVALID_SPAN,
               outbox: Outbox | None = None) -> Outbox:
        """Queue a request, its messages for `outbox` (default: a new queue); one that could never fit the KV pool
        is refused (TreeserveError), and every request once a tensor-parallel rank is gone (RankLost)."""
        if self.lost is not None:
            raise self.lost
        if generation.kv_tokens_needed > self.pool_tokens:
            raise TreeserveError(f"the request needs {generation.kv_tokens_needed} tokens of KV cache (prompt + "
                                 f"max_new_tokens + budget), and this verifier holds {self.pool_tokens}")
        speculate = generation.budget > 0 and bool(self.links)
        link = min(self.links, key=self._load) if speculate else None
        outbox = asyncio.Queue() if outbox is None else outbox
        self.waiting[request_id] = Running(generation, outbox, link, span)
        self.wake.set()
        return outbox

    def cancel(self, request_id: str) -> bool:
        """Free the request's KV blocks (once the forward in flight, if any, has ended) and tell its drafter and
        the policy to forget it. False when the request had already left (finished or failed)."""
        entry = self.waiting.pop(request_id, None) or self.running.pop(request_id, None)
        if entry is not None:
            self.runner.release(entry.generation)
            if entry.link is not None:
                entry.link.forget(request_id)
            self.speculation.forget(request_id)
        return entry is not None

    def _kv_slots(self) -> int:
        allocator = self.verifier.pool.allocator
        return (allocator.num_blocks - allocator.free_count) * self.verifier.pool.block_size

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
        """Admit, prepare the drafters, run a round, let its observers read it: until a rank is lost."""
        while self.lost is None:
            if not self.waiting and not self.running:
                await self._send_drops()
            if not self.waiting and not self.running:  # (a request may have come while the drops went out)
                self.wake.clear()
                await self.wake.wait()
            self._admit()
            spans = {}
            try:
                started = time.perf_counter()
                self._stop_drafting_where_it_does_not_pay()
                await self._reconnect()
                spans = self._round_spans()
                carriers = {request_id: self.tracing.carrier(span) for request_id, span in spans.items()}
                with self.round_traces.round():
                    report = await speculative_round(self.running, self.speculation, self.runner, carriers)
                self._observe(report, spans, started)
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
            finally:
                for span in spans.values():
                    span.end()

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
        """Where the policy has given up drafting at this batch, the running requests that could draft decode
        plainly from now on, as new ones are admitted, but for the newest few it keeps: a request that could draft
        costs even in plain rounds (its kept features, its place in each choice), and the requests admitted
        drafting before a batch filled up would otherwise stay most of its drafting ones."""
        kept = self.speculation.drafting_kept(len(self.running))
        if kept is None:
            return
        drafting = [request_id for request_id, entry in self.running.items() if entry.link is not None]
        for request_id in drafting[:max(0, len(drafting) - kept)]:  # oldest first: admission order
            entry = self.running[request_id]
            entry.link.forget(request_id)
            entry.link = None
            entry.generation.stop_drafting()
            self.speculation.forget(request_id)
            self.metrics.drafting_stopped.inc()

    async def _send_drops(self) -> None:
        """With the batch empty, no round carries the finished requests' drops: send them on their own, so the
        drafters free those contexts now, off any round's path."""
        for link in self.links:
            await link.send_drops()

    async def _reconnect(self) -> None:
        """Drafters that are down are tried again (as their backoff allows); a request whose drafter stays down
        moves to one that works."""
        for entry in list(self.running.values()):  # (a request may be cancelled while a drafter is tried)
            if entry.link is not None and not entry.link.up and not await self.connect(entry.link):
                healthy = [link for link in self.links if link.up]
                if healthy:
                    entry.link = min(healthy, key=self._load)

    def _round_spans(self) -> dict[str, trace.Span]:
        """One span per request for this round (its prefill, or a verified tree), when tracing is on."""
        if not self.tracing.enabled:
            return {}
        return {request_id: self.tracing.tracer.start_span(
                    "verifier.round" if entry.generation.prefilled else "verifier.prefill",
                    context=trace.set_span_in_context(entry.span))
                for request_id, entry in self.running.items()}

    def _observe(self, report: RoundReport, spans: dict[str, trace.Span], started: float) -> None:
        """The round's observers read its report: the speculation policy, the spans and the metrics. Then the
        requests that finished leave. The metrics are recorded at the loop's next turn, which on a GPU comes
        while the next round's forward runs: off the rounds' path."""
        checked = self.speculation.observe(report)
        for request in report.requests:
            if request.request_id in spans:
                spans[request.request_id].set_attributes(round_attributes(request, report))
        asyncio.get_running_loop().call_soon(self._record, report, checked, time.perf_counter() - started)
        for request in report.requests:
            if request.finish_reason is not None:
                self.metrics.requests.labels(outcome=request.finish_reason).inc()
                self.cancel(request.request_id)

    def _record(self, report: RoundReport, checked: tuple[int, float] | None, seconds: float) -> None:
        """The round's metrics (`checked`: the policy's realized over expected drafts at a batch bucket, when it
        checked them; `seconds`: the whole round, scheduling included)."""
        metrics = self.metrics
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", report.log_line())
        if report.choice is not None:
            metrics.round_budget.set(report.choice.budget)
            metrics.by_budget(report.choice.label).rounds.inc()
        for found in report.drafts:
            if found.trees:
                metrics.phase_seconds["draft"].observe(found.propose_s)
                transport_s = max(0.0, found.round_trip_s - found.propose_s)
                metrics.phase_seconds["transport"].observe(transport_s)
        if report.forward_batch:
            metrics.generated_tokens.inc(report.tokens)
            metrics.record_trees([(request.tree_nodes, request.accepted) for request in report.requests
                                  if not request.prompt_tokens])
            metrics.phase_seconds["verify"].observe(report.verify_phase_s)
        if checked is not None:
            batch, factor = checked
            metrics.realized_over_expected.labels(batch=str(batch)).set(factor)
        metrics.phase_seconds["round"].observe(seconds)
        if report.with_prompts:  # beside all rounds: where a mode's rounds with prompts cost more, and how many
            metrics.phase_seconds["round_with_prompts"].observe(seconds)
        else:
            self._check_expectation(report, seconds)

    def _check_expectation(self, report: RoundReport, seconds: float) -> None:
        """The tokens and seconds the policy's choice expected of this round, beside what it emitted and took (by
        budget, in the metrics): where its model of costs and acceptance errs, and which way. Not for a round that
        prefilled a prompt, whose work was not in the estimate."""
        if report.choice is None or report.choice.expected is None:
            return
        expected_tokens, expected_s = report.choice.expected
        counters = self.metrics.by_budget(report.choice.label)
        counters.checked_rounds.inc()
        counters.expected_tokens.inc(expected_tokens)
        counters.realized_tokens.inc(report.tokens)
        counters.expected_seconds.inc(expected_s)
        counters.realized_seconds.inc(seconds)
        counters.drafters_seconds.inc(report.drafters_s)
        counters.verify_seconds.inc(report.verify_phase_s)


def round_attributes(request: RequestReport, report: RoundReport) -> dict:
    attributes = {"treeserve.batch_size": report.forward_batch, "treeserve.committed": request.committed}
    if report.choice is not None:
        attributes["treeserve.round_budget"] = report.choice.budget
    if request.prompt_tokens:
        return attributes | {"treeserve.prompt_tokens": request.prompt_tokens}
    return attributes | {"treeserve.tree_nodes": request.tree_nodes, "treeserve.accepted": request.accepted}


async def start(listen: str, servicer: "VerifierServicer") -> serving.Service:
    """serving.start for a verifier: gRPC on `listen` and, on a Unix socket, the Session stream as frames beside it
    (stopped with the service)."""
    service = await serving.start(listen, servicer.register)
    await framing.listen_beside(service, servicer.frames, "session")
    return service


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, name: str, links: list[DrafterLink], default_budget: int, default_max_new_tokens: int,
                 max_batch: int, tracing: Tracing | None = None, metrics: VerifierMetrics | None = None):
        self.name, self.links = name, links
        self.default_budget, self.default_max_new_tokens, self.max_batch = (
            default_budget, default_max_new_tokens, max_batch)
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or VerifierMetrics()
        self.scheduler: Scheduler | None = None  # set once the model is loaded
        self.draining = False  # shutting down: the requests running finish, no new one starts
        self.frames = framing.FrameServer(self.serve_session_frames)  # Session streams as frames, where it listens

    def register(self, server: grpc.aio.Server) -> list[str]:
        """For serving.start: add this servicer and name it for reflection."""
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(self, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name]

    def attach(self, target: LoadedModel, verifier: TreeVerifier | None = None,
               speculation: Speculation | None = None, compute: ThreadPoolExecutor | None = None
               ) -> Scheduler:
        """Start scheduling on a loaded target; `verifier` defaults to an eager one with a default-sized pool;
        `speculation`: how much each round drafts (default: every request its own budget); `compute`: the thread
        that loaded the target, to run the forwards that block."""
        self.target = target
        verifier = verifier or build_verifier(target.model, self.max_batch)
        self.scheduler = Scheduler(target, verifier, self.links, self.max_batch, self.tracing, self.metrics,
                                   speculation, compute)
        return self.scheduler

    def start(self, request: verifier_pb2.VerifierServiceGenerateRequest, trace_parent,
              outbox: Outbox | None = None) -> tuple[str, Outbox, trace.Span]:
        """Check and queue a request, whichever RPC brought it (RequestFailed where it cannot be served): its id on
        this verifier, its outbox and its span (`trace_parent`: the caller's span context, or None)."""
        if self.scheduler is None:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        if self.draining:  # (a gateway's Session stream stays open while the server drains: refused here)
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down")
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
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        request_id = f"{request.request_id or 'request'}-{uuid.uuid4().hex[:8]}"
        span = self.tracing.tracer.start_span(
            "verifier.generate", context=trace_parent, kind=trace.SpanKind.SERVER,
            attributes={"treeserve.request_id": request_id, "treeserve.prompt_tokens": len(request.prompt_token_ids),
                        "treeserve.budget": budget})
        try:
            return request_id, self.scheduler.submit(request_id, generation, span, outbox), span
        except TreeserveError as error:
            span.end()
            code = grpc.StatusCode.UNAVAILABLE if isinstance(error, RankLost) else grpc.StatusCode.INVALID_ARGUMENT
            raise RequestFailed(code, str(error)) from None

    def drain(self) -> None:
        """Shutting down: refuse new requests (UNAVAILABLE, so a gateway takes them to another verifier)."""
        self.draining = True

    def end(self, request_id: str, span: trace.Span) -> None:
        """The request is over for its caller (finished, failed, cancelled or gone): free everything it held."""
        if self.scheduler.cancel(request_id):
            self.metrics.requests.labels(outcome="cancelled").inc()
        span.end()

    async def Generate(self, request, context):
        try:
            request_id, outbox, span = self.start(request, self.tracing.parent(context.invocation_metadata() or ()))
        except RequestFailed as refused:
            await context.abort(refused.code, refused.message)
        try:
            while True:
                message = await outbox.get()
                if isinstance(message, Exception):
                    await context.abort(*failure_status(message))
                yield message
                if message.finish_reason:
                    set_final_attributes(span, message)
                    return
        finally:  # finished, failed, or the client went away
            self.end(request_id, span)

    async def Session(self, request_iterator, context):
        session = SessionStream(self)
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            while (message := await session.outgoing.get()) is not None:
                yield message
        finally:  # the caller ended the stream or went away: its requests still running end with it
            reader.cancel()
            session.close()

    async def serve_session_frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The Session stream of a gateway on this host, over the socket beside the gRPC one (treeserve.framing):
        the same messages, each round's written as the loop next runs its callbacks; the socket's close ends the
        stream and its requests, and a bad frame (FrameError) is refused with why by the FrameServer."""
        def deliver(message: verifier_pb2.VerifierServiceSessionResponse) -> None:
            if not writer.is_closing():  # (a round's message after the gateway has gone: nowhere to go)
                framing.write_frame(writer, message.SerializeToString())

        session = SessionStream(self, deliver)
        try:
            while (frame := await framing.read_frame(reader)) is not None:
                session.take(framing.parse_message(*frame, verifier_pb2.VerifierServiceSessionRequest))
        finally:
            session.close()

    async def GetInfo(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        cfg = self.target.model.config
        return verifier_pb2.VerifierServiceGetInfoResponse(
            model=self.name, vocab_size=cfg.vocab_size, max_context=cfg.max_context,
            eos_token_ids=sorted(self.target.tokenizer.eos_ids), max_budget=MAX_BUDGET,
            default_budget=self.default_budget, drafters=[link.address for link in self.links],
            session_socket=self.frames.path)


def failure_status(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a request that the scheduler failed with `error` ends with."""
    if isinstance(error, RankLost):
        return grpc.StatusCode.UNAVAILABLE, f"verifier going down: {error}"
    return grpc.StatusCode.INTERNAL, f"verification failed: {error}"


def set_final_attributes(span: trace.Span, message: verifier_pb2.VerifierServiceGenerateResponse) -> None:
    span.set_attributes({"treeserve.completion_tokens": message.usage.completion_tokens,
                         "treeserve.mean_accepted": message.stats.mean_accepted})


class SessionStream:
    """One Session stream's requests. What the rounds put in their outboxes joins one message, sent when the loop
    next runs its ready callbacks: after the round has emitted for every request, so a round makes one message for
    the whole stream (one write, one read on the other side) where Generate makes one a request.

    `deliver(message)` sends one; by default it queues it in `outgoing`, which the gRPC stream yields from."""

    def __init__(self, servicer: VerifierServicer, deliver=None):
        self.servicer = servicer
        self.requests: dict[str, tuple[str, trace.Span]] = {}  # the caller's request_id -> this verifier's, its span
        self.outgoing: asyncio.Queue = asyncio.Queue()  # messages to send; None ends the stream
        self.deliver = deliver or self.outgoing.put_nowait
        self.pending: verifier_pb2.VerifierServiceSessionResponse | None = None
        self.reading = True

    async def read(self, request_iterator) -> None:
        """The caller's starts and cancels, until it closes its side (or the stream fails)."""
        try:
            async for message in request_iterator:
                self.take(message)
        except grpc.aio.AioRpcError:  # the caller went away: Session's own end cancels its requests
            pass
        self.reading = False
        if not self.requests and self.pending is None:
            self.outgoing.put_nowait(None)

    def take(self, message: verifier_pb2.VerifierServiceSessionRequest) -> None:
        """One message from the caller: a start or a cancel."""
        if message.HasField("start"):
            self.start(message.start)
        elif message.cancel:
            self.cancel(message.cancel)

    def start(self, start: verifier_pb2.SessionStart) -> None:
        name = start.request.request_id
        if not name or name in self.requests:
            why = "a request on a Session stream needs a request_id" if not name else (
                f"request {name!r} is already running on this stream")
            self._error(name, grpc.StatusCode.INVALID_ARGUMENT, why)
            return
        outbox = SessionOutbox(self, name)
        try:
            request_id, _, span = self.servicer.start(start.request, self.servicer.tracing.parent(start.trace_context),
                                                      outbox)
        except RequestFailed as refused:
            self._error(name, refused.code, refused.message)
            return
        self.requests[name] = (request_id, span)

    def _error(self, name: str, code: grpc.StatusCode, why: str) -> None:
        update = self._update(name)
        update.error_code, update.error_message = code.value[0], why

    def cancel(self, name: str) -> None:
        """The caller ends a request (one that has just ended is no longer here: nothing to do)."""
        if name in self.requests:
            self.servicer.end(*self.requests.pop(name))

    def post(self, name: str, message) -> None:
        """A request's message from the scheduler (an Exception: it failed), into the next message."""
        if name not in self.requests:  # cancelled meanwhile
            return
        if isinstance(message, Exception):
            self._error(name, *failure_status(message))
        else:
            self._update(name).response.CopyFrom(message)
            if not message.finish_reason:
                return
            set_final_attributes(self.requests[name][1], message)
        # Over: the scheduler lets a finished or failed request go itself, after the round.
        self.requests.pop(name)[1].end()

    def close(self) -> None:
        for name in list(self.requests):
            self.cancel(name)

    def _update(self, name: str) -> verifier_pb2.SessionUpdate:
        if self.pending is None:
            self.pending = verifier_pb2.VerifierServiceSessionResponse()
            asyncio.get_running_loop().call_soon(self._send)
        return self.pending.updates.add(request_id=name)

    def _send(self) -> None:
        self.deliver(self.pending)
        self.pending = None
        if not self.reading and not self.requests:
            self.outgoing.put_nowait(None)


class SessionOutbox:
    """A Session request's outbox: what the scheduler puts in it goes to its stream's next message."""

    __slots__ = ("session", "name")

    def __init__(self, session: SessionStream, name: str):
        self.session, self.name = session, name

    def put_nowait(self, message) -> None:
        self.session.post(self.name, message)
