"""The drafter as a gRPC service: one long-lived Draft stream per verifier, one tree per request per round.

Each stream keeps the token context of its own requests only (they belong to the one verifier on the other end),
so contexts live exactly as long as the stream: when the verifier disconnects or cancels, they are freed.
"""

from __future__ import annotations

import logging

import grpc

from treeserve.errors import TreeserveError
from treeserve.tree import MAX_BUDGET, Drafter
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("treeserve.drafter")

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter: Drafter, max_budget: int = MAX_BUDGET):
        if max_budget < 1:
            raise TreeserveError(f"max budget must be at least 1, got {max_budget}")
        self.drafter, self.max_budget = drafter, max_budget

    def register(self, server: grpc.aio.Server) -> list[str]:
        """For serving.start: add this servicer and name it for reflection."""
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    async def GetInfo(self, request, context):
        return drafter_pb2.DrafterServiceGetInfoResponse(kind=self.drafter.name, max_budget=self.max_budget)

    async def Draft(self, request_iterator, context):
        contexts: dict[str, list[int]] = {}  # request_id -> prompt and output so far, this stream only
        log.debug("draft stream opened by %s", context.peer())
        try:
            async for request in request_iterator:
                try:
                    trees = self.draft_round(request, contexts)
                except TreeserveError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"round {request.round}: {error}")
                yield drafter_pb2.DraftResponse(round=request.round, trees=trees)
        finally:
            log.debug("draft stream from %s closed, dropping %d contexts", context.peer(), len(contexts))

    def draft_round(self, request: drafter_pb2.DraftRequest,
                    contexts: dict[str, list[int]]) -> list[drafter_pb2.DraftTree]:
        # Check every item before touching any context, so a rejected round leaves none half-updated.
        seen: set[str] = set()
        for item in request.items:
            self.check_item(item, contexts, seen)
        trees = []
        for item in request.items:
            if item.finished:
                contexts.pop(item.request_id, None)
                continue
            tokens = contexts.setdefault(item.request_id, [])
            tokens.extend(item.new_token_ids)
            if item.budget > 0:
                tree = self.drafter.propose(tokens, item.budget)
                trees.append(drafter_pb2.DraftTree(request_id=item.request_id, token_ids=tree.tokens,
                                                   parents=tree.parents))
        return trees

    def check_item(self, item: drafter_pb2.DraftItem, contexts: dict[str, list[int]], seen: set[str]) -> None:
        if not item.request_id:
            raise TreeserveError("an item has no request_id")
        if item.request_id in seen:
            raise TreeserveError(f"request {item.request_id!r} has more than one item")
        seen.add(item.request_id)
        if item.budget > self.max_budget:
            raise TreeserveError(f"request {item.request_id!r}: budget {item.budget} is above this drafter's "
                                 f"maximum {self.max_budget}")
        if item.HasField("features"):
            raise TreeserveError(f"request {item.request_id!r}: features sent, but this drafter asks for none")
        if not item.finished and not item.new_token_ids and item.request_id not in contexts:
            raise TreeserveError(f"request {item.request_id!r} is unknown on this stream and the item has no "
                                 "tokens (a new request's first item carries its prompt)")
