"""The drafter as a gRPC service: one long-lived Draft stream per verifier, one tree per request per round.

Each stream keeps the token context of its own requests only (they belong to the one verifier on the other end),
so contexts live exactly as long as the stream: when the verifier disconnects or cancels, they are freed.
"""

from __future__ import annotations

import logging
import time

import grpc

from opentelemetry import trace

from treeserve.errors import TreeserveError
from treeserve.telemetry import DrafterMetrics, Tracing
from treeserve.tree import MAX_BUDGET, DraftContext, Drafter, DraftPoolFull
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc
from treeserve.wire import features_from_proto

log = logging.getLogger("treeserve.drafter")

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter | None, max_budget: int = MAX_BUDGET, tracing: Tracing | None = None,
                 metrics: DrafterMetrics | None = None):
        """`drafter` may come later, through attach(), once loaded; until then calls get UNAVAILABLE."""
        if max_budget < 1:
            raise TreeserveError(f"max budget must be at least 1, got {max_budget}")
        self.drafter, self.max_budget = drafter, max_budget
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or DrafterMetrics()

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
                                                         feature_layer_ids=self.drafter.feature_layer_ids)

    async def Draft(self, request_iterator, context):
        if self.drafter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading")
        contexts: dict[str, DraftContext] = {}  # request_id -> its draft context, this stream only
        dropped: set[str] = set()  # requests whose context did not fit: no trees for them, until they finish
        log.debug("draft stream opened by %s", context.peer())
        self.metrics.streams.inc()
        try:
            async for request in request_iterator:
                started = time.perf_counter()
                held = len(contexts)
                try:
                    trees = self.draft_round(request, contexts, dropped)
                except TreeserveError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"round {request.round}: {error}")
                elapsed = time.perf_counter() - started
                self.metrics.contexts.inc(len(contexts) - held)
                self.metrics.rounds.inc()
                self.metrics.propose_seconds.observe(elapsed)
                yield drafter_pb2.DraftResponse(round=request.round, trees=trees, propose_seconds=elapsed)
        finally:
            log.debug("draft stream from %s closed, dropping %d contexts", context.peer(), len(contexts))
            for held_context in contexts.values():
                self.drafter.release(held_context)
            self.metrics.streams.dec()
            self.metrics.contexts.dec(len(contexts))

    def draft_round(self, request: drafter_pb2.DraftRequest, contexts: dict[str, DraftContext],
                    dropped: set[str]) -> list[drafter_pb2.DraftTree]:
        # Check every item before touching any context, so a rejected round leaves none half-updated.
        seen: set[str] = set()
        features = [self.check_item(item, contexts, dropped, seen) for item in request.items]
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
            return []
        spans = self.start_spans([item for item, _ in asking])
        trees = self.drafter.propose([context for _, context in asking], [item.budget for item, _ in asking])
        self.metrics.trees.inc(len(trees))
        self.metrics.tree_nodes.inc(sum(tree.size - 1 for tree in trees))
        replies = []
        for (item, context), tree in zip(asking, trees):
            if item.request_id in spans:
                spans[item.request_id].set_attributes({
                    "treeserve.budget": item.budget, "treeserve.tree_nodes": tree.size - 1,
                    "treeserve.context_tokens": len(context.tokens), "treeserve.batch_size": len(asking)})
                spans[item.request_id].end()
            replies.append(drafter_pb2.DraftTree(request_id=item.request_id, token_ids=tree.tokens,
                                                 parents=tree.parents))
        return replies

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
                   seen: set[str]):
        """Raises TreeserveError for a bad item; returns its features, decoded (None when it has none)."""
        if not item.request_id:
            raise TreeserveError("an item has no request_id")
        if item.request_id in seen:
            raise TreeserveError(f"request {item.request_id!r} has more than one item")
        seen.add(item.request_id)
        if item.budget > self.max_budget:
            raise TreeserveError(f"request {item.request_id!r}: budget {item.budget} is above this drafter's "
                                 f"maximum {self.max_budget}")
        if item.request_id in dropped:
            return None  # its tokens and features are ignored until it finishes
        if not item.finished and not item.new_token_ids and item.request_id not in contexts:
            raise TreeserveError(f"request {item.request_id!r} is unknown on this stream and the item has no "
                                 "tokens (a new request's first item carries its prompt)")
        return self.check_features(item, contexts)

    def check_features(self, item: drafter_pb2.DraftItem, contexts: dict[str, DraftContext]):
        """Features come exactly for the tokens that entered the target's KV cache: every new token, except the
        newest (the next root) on a request's first item, whose context holds no root yet."""
        if not self.drafter.feature_layer_ids:
            if item.HasField("features"):
                raise TreeserveError(f"request {item.request_id!r}: features sent, but this drafter asks for none")
            return None
        if item.finished:
            return None
        rows = len(item.new_token_ids) - (0 if item.request_id in contexts else 1)
        sent = item.HasField("features")
        shape = tuple(item.features.shape) if sent else (0, self.drafter.feature_size)
        if shape != (rows, self.drafter.feature_size):
            raise TreeserveError(f"request {item.request_id!r}: features of shape {shape} for "
                                 f"{len(item.new_token_ids)} new tokens; expected ({rows}, {self.drafter.feature_size})")
        return features_from_proto(item.features) if sent else None
