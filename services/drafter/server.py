"""The drafter as a gRPC service: one long-lived Draft stream per verifier, one tree per request per round (over
gRPC, or as frames on a Unix socket beside the gRPC one for a verifier on this host: treeserve.framing).

Each stream keeps the token context of its own requests only (they belong to the one verifier on the other end),
so contexts live exactly as long as the stream: when the verifier disconnects or cancels, they are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from opentelemetry import trace

from treeserve import framing, serving
from treeserve.errors import TreeserveError
from treeserve.feature_region import MappedRegion
from treeserve.round_traces import RoundTraces
from treeserve.telemetry import DrafterMetrics, Tracing
from treeserve.tree import MAX_BUDGET, DraftContext, Drafter, DraftPoolFull, DraftTree
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc
from treeserve.wire import features_from_proto

log = logging.getLogger("treeserve.drafter")

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


async def start(listen: str, servicer: "DrafterServicer") -> serving.Service:
    """serving.start for a drafter: gRPC on `listen` and, on a Unix socket, the Draft stream as frames beside it
    (stopped with the service)."""
    service = await serving.start(listen, servicer.register)
    await framing.listen_beside(service, servicer.frames, "draft")
    return service


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter | None, max_budget: int = MAX_BUDGET, tracing: Tracing | None = None,
                 metrics: DrafterMetrics | None = None):
        """`drafter` may come later, through attach(), once loaded; until then calls get UNAVAILABLE."""
        if max_budget < 1:
            raise TreeserveError(f"max budget must be at least 1, got {max_budget}")
        self.drafter, self.max_budget = drafter, max_budget
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or DrafterMetrics()
        self.frames = framing.FrameServer(self.serve_frames)  # Draft streams as frames, where it listens for them
        self.round_traces = RoundTraces("drafter")  # torch profiler traces of rounds, for benches

    def register(self, server: grpc.aio.Server) -> list[str]:
        """For serving.start: add this servicer and name it for reflection."""
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    def attach(self, drafter: Drafter) -> None:
        self.drafter = drafter

    async def GetInfo(self, request, context):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading")
        return drafter_pb2.DrafterServiceGetInfoResponse(kind=self.drafter.name, max_budget=self.max_budget,
                                                         feature_layer_ids=self.drafter.feature_layer_ids,
                                                         draft_socket=self.frames.path,
                                                         lookup_trees=self.lookup_trees)

    @property
    def lookup_trees(self) -> bool:
        """Whether the drafter also drafts by prompt lookup alone (a merged drafter: `propose_lookup`)."""
        return hasattr(self.drafter, "propose_lookup")

    async def Draft(self, request_iterator, context):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading")
        log.debug("draft stream opened by %s", context.peer())
        with self.stream() as answer:
            async for request in request_iterator:  # (no feature region over gRPC)
                try:
                    response = answer(request)
                except TreeserveError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"round {request.round}: {error}")
                yield response
                self.write_ahead()

    async def serve_frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The Draft stream of a verifier on this host, over the socket beside the gRPC one (treeserve.framing):
        the same messages and answers, and the feature region it may share; a bad frame or round raises
        TreeserveError, which the FrameServer refuses the stream with."""
        region: MappedRegion | None = None
        try:
            if self.drafter is None:
                raise TreeserveError("the drafter is still loading")
            with self.stream() as answer:
                while (frame := await framing.read_frame(reader)) is not None:
                    if frame[0] == framing.REGION:
                        region, why_not = self.map_region(frame[1], region)
                        framing.write_frame(writer, why_not.encode(), framing.REGION)
                    else:
                        request = framing.parse_message(*frame, drafter_pb2.DraftRequest)
                        try:
                            response = answer(request, region)
                        except TreeserveError as error:
                            raise TreeserveError(f"round {request.round}: {error}") from None
                        framing.write_frame(writer, response.SerializeToString())
                        self.write_ahead()  # (the answer is on its way: the socket took it)
                    await writer.drain()
        finally:
            if region is not None:
                region.close()

    def map_region(self, payload: bytes, mapped: MappedRegion | None) -> tuple[MappedRegion | None, str]:
        """The stream's feature region, from a verifier's offer (in place of any it offered before), and "" or why
        it cannot be used."""
        if mapped is not None:
            mapped.close()
        if not self.drafter.feature_layer_ids:
            return None, f"the {self.drafter.name} drafter takes no features"
        try:
            return MappedRegion(payload.decode(errors="replace")), ""
        except TreeserveError as error:
            return None, str(error)

    @contextlib.contextmanager
    def stream(self):
        """One Draft stream's state, through whichever door it came: yields its `answer(request, region=None) ->
        response` (region: the stream's feature region; TreeserveError for a bad round, which leaves every context
        as it was). The stream's contexts are freed when it ends."""
        contexts: dict[str, DraftContext] = {}  # request_id -> its draft context, this stream only
        dropped: set[str] = set()  # requests whose context did not fit: no trees for them, until they finish
        self.metrics.streams.inc()

        def answer(request: drafter_pb2.DraftRequest, region: MappedRegion | None = None) -> drafter_pb2.DraftResponse:
            started, held = time.perf_counter(), len(contexts)
            reply = drafter_pb2.DraftResponse(round=request.round)
            with self.round_traces.round():
                self.draft_round(request, contexts, dropped, reply.trees, region)
            reply.propose_seconds = elapsed = time.perf_counter() - started
            self.metrics.contexts.inc(len(contexts) - held)
            self.metrics.rounds.inc()
            self.metrics.propose_seconds.observe(elapsed)
            return reply

        try:
            yield answer
        finally:
            log.debug("draft stream closed, dropping %d contexts", len(contexts))
            for held_context in contexts.values():
                self.drafter.release(held_context)
            self.metrics.streams.dec()
            self.metrics.contexts.dec(len(contexts))

    def write_ahead(self) -> None:
        """Write the feature rows that came without a tree (a verifier keeps its requests' contexts current
        through rounds it decodes plainly), once an answer is on its way and no tree waits on it: a later tree then
        finds them written, not all of them to write before its block forward."""
        if self.drafter.feature_layer_ids:
            self.drafter.write_context()

    def draft_round(self, request: drafter_pb2.DraftRequest, contexts: dict[str, DraftContext], dropped: set[str],
                    replies, region: MappedRegion | None = None) -> None:
        """The round's trees, added to `replies` (a DraftResponse's trees: built in place, not built apart and
        copied in)."""
        # Check every item before touching any context, so a rejected round leaves none half-updated.
        started, seen = time.perf_counter(), set()
        features = [self.check_item(item, contexts, dropped, seen, region) for item in request.items]
        asking: list[tuple[drafter_pb2.DraftItem, DraftContext]] = []
        for item, item_features in zip(request.items, features):
            if item.finished:
                finished = contexts.pop(item.request_id, None)
                if finished is not None:
                    self.drafter.release(finished)
                dropped.discard(item.request_id)
                continue
            if item.request_id in dropped:
                continue
            context = contexts.get(item.request_id)
            if context is None:
                context = contexts[item.request_id] = self.drafter.new_context()
            try:
                self.drafter.extend(context, list(item.new_token_ids), item_features)
            except DraftPoolFull as error:  # this request decodes without trees; the others keep theirs
                log.warning("request %s: %s; it gets no more trees", item.request_id, error)
                self.drafter.release(contexts.pop(item.request_id))
                dropped.add(item.request_id)
                continue
            if item.budget > 0:
                asking.append((item, context))
        if not asking:
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("round %d: %d items checked and their contexts extended in %.3f ms", request.round,
                      len(request.items), (time.perf_counter() - started) * 1e3)
        spans = self.start_spans([item for item, _ in asking])
        trees = self.propose(asking)
        self.metrics.trees.inc(len(trees))
        self.metrics.tree_nodes.inc(sum(tree.size - 1 for tree in trees))
        for (item, context), tree in zip(asking, trees):
            if item.request_id in spans:
                spans[item.request_id].set_attributes({
                    "treeserve.budget": item.budget, "treeserve.tree_nodes": tree.size - 1,
                    "treeserve.context_tokens": len(context.tokens), "treeserve.batch_size": len(asking)})
                spans[item.request_id].end()
            replies.add(request_id=item.request_id, token_ids=tree.tokens, parents=tree.parents,
                        lookup_nodes=tree.lookup_nodes or 0)

    def propose(self, asking: list[tuple[drafter_pb2.DraftItem, DraftContext]]) -> list[DraftTree]:
        """The items' trees, in order: the drafter's own, or prompt lookup's alone for those that ask for it."""
        trees: list[DraftTree | None] = [None] * len(asking)
        for lookup_only in (False, True):
            chosen = [i for i, (item, _) in enumerate(asking) if item.lookup_only == lookup_only]
            if chosen:
                propose = self.drafter.propose_lookup if lookup_only else self.drafter.propose
                found = propose([asking[i][1] for i in chosen], [asking[i][0].budget for i in chosen])
                for i, tree in zip(chosen, found):
                    trees[i] = tree
        return trees

    def start_spans(self, items: list[drafter_pb2.DraftItem]) -> dict[str, trace.Span]:
        """A drafter.propose span per item whose verifier sent a trace context (the batch shares its timing)."""
        if not self.tracing.enabled:
            return {}
        spans = {}
        for item in items:
            parent = self.tracing.parent(item.trace_context)
            if parent is not None:
                spans[item.request_id] = self.tracing.tracer.start_span(
                    "drafter.propose", context=parent, attributes={"treeserve.request_id": item.request_id})
        return spans

    def check_item(self, item: drafter_pb2.DraftItem, contexts: dict[str, DraftContext], dropped: set[str],
                   seen: set[str], region: MappedRegion | None = None):
        """Raises TreeserveError for a bad item; returns its features, decoded (None when it has none)."""
        if not item.request_id:
            raise TreeserveError("an item has no request_id")
        if item.request_id in seen:
            raise TreeserveError(f"request {item.request_id!r} has more than one item")
        seen.add(item.request_id)
        if item.budget > self.max_budget:
            raise TreeserveError(f"request {item.request_id!r}: budget {item.budget} is above this drafter's "
                                 f"maximum {self.max_budget}")
        if item.lookup_only and not self.lookup_trees:
            raise TreeserveError(f"request {item.request_id!r} asks for prompt lookup's tree alone, which the "
                                 f"{self.drafter.name} drafter does not draft")
        if item.request_id in dropped:
            return None  # its tokens and features are ignored until it finishes
        if not item.finished and not item.new_token_ids and item.request_id not in contexts:
            raise TreeserveError(f"request {item.request_id!r} is unknown on this stream and the item has no "
                                 "tokens (a new request's first item carries its prompt)")
        return self.check_features(item, contexts, region)

    def check_features(self, item: drafter_pb2.DraftItem, contexts: dict[str, DraftContext],
                       region: MappedRegion | None = None):
        """Features come for the tokens that entered the target's KV cache (every token but the newest, the next
        root), oldest first: an item that asks for the drafter's own tree brings every row its context still lacks;
        one that asks for none, or for prompt lookup's alone, may bring fewer (the rest come later)."""
        if not self.drafter.feature_layer_ids:
            if item.HasField("features"):
                raise TreeserveError(f"request {item.request_id!r}: features sent, but this drafter asks for none")
            return None
        if item.finished:
            return None
        context = contexts.get(item.request_id)
        new = len(item.new_token_ids)
        wanted = max(0, new - 1) if context is None else self.drafter.rows_wanted(context, new)
        sent = item.HasField("features")
        shape = tuple(item.features.shape) if sent else (0, self.drafter.feature_size)
        all_needed = item.budget > 0 and not item.lookup_only
        if shape[1:] != (self.drafter.feature_size,) or shape[0] > wanted or (all_needed and shape[0] < wanted):
            raise TreeserveError(f"request {item.request_id!r}: features of shape {shape} for {new} new tokens; "
                                 f"expected ({wanted}, {self.drafter.feature_size})"
                                 f"{'' if all_needed else ' or fewer rows'}")
        # Rows that the drafter's own tree of this round writes are read before the answer goes back, and so before
        # the verifier writes the region again: those are read in place. Others wait for a later round: copied.
        return features_from_proto(item.features, region, copy=not all_needed) if sent else None
