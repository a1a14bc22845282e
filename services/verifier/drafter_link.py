"""The verifier's side of one drafter: a long-lived Draft stream, and what each request has been sent on it.

A request stays with one drafter, which holds its draft context. If the drafter is down, answers late or
breaks the stream, the link marks itself down (its requests decode without trees meanwhile, never wrong) and
reconnects with backoff; a new stream starts empty, so every request's full context is sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from treeserve.serving import MESSAGE_OPTIONS
from treeserve.tree import DraftTree
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("treeserve.verifier")


class DrafterLink:
    def __init__(self, address: str, timeout_s: float, max_backoff_s: float = 5.0):
        self.address, self.timeout_s, self.max_backoff_s = address, timeout_s, max_backoff_s
        self.channel = grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS)
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.call = None  # the Draft stream while up
        self.kind, self.max_budget = "", 0
        self.sent: dict[str, int] = {}  # request id -> tokens of its context this stream has seen
        self.to_drop: set[str] = set()  # finished or cancelled requests the drafter should forget
        self.round = 0
        self.backoff_s, self.retry_at = 0.1, 0.0

    @property
    def up(self) -> bool:
        return self.call is not None

    async def connect(self) -> bool:
        """Try once (if the backoff allows); True when the stream is up."""
        if self.up or time.monotonic() < self.retry_at:
            return self.up
        try:
            info = await self.stub.GetInfo(drafter_pb2.DrafterServiceGetInfoRequest(), timeout=self.timeout_s)
            self.kind, self.max_budget = info.kind, info.max_budget
            self.call = self.stub.Draft()
            self.sent.clear()
            self.backoff_s = 0.1
            log.info("drafter %s (%s, max budget %d) connected", self.address, self.kind, self.max_budget)
        except grpc.aio.AioRpcError as error:
            self._down(f"connect failed: {error.code().name}")
        return self.up

    def forget(self, request_id: str) -> None:
        if self.sent.pop(request_id, None) is not None:
            self.to_drop.add(request_id)

    async def draft(self, requests: dict) -> dict[str, DraftTree]:
        """requests: request id -> its Generation (committed tokens and budget). Only tokens this stream has
        not seen travel. Returns the trees the drafter proposed; an empty dict when the link is down or fails
        this round (those requests then decode plainly)."""
        if not self.up:
            return {}
        self.round += 1
        message = drafter_pb2.DraftRequest(round=self.round)
        for request_id in self.to_drop:
            message.items.add(request_id=request_id, finished=True)
        self.to_drop.clear()
        for request_id, generation in requests.items():
            message.items.add(request_id=request_id,
                              new_token_ids=generation.committed_since(self.sent.get(request_id, 0)),
                              budget=min(generation.budget, self.max_budget))
            self.sent[request_id] = generation.committed_count
        try:
            await self.call.write(message)
            reply = await asyncio.wait_for(self.call.read(), self.timeout_s)
            if reply is grpc.aio.EOF or reply.round != self.round:
                raise ConnectionError("the stream ended or answered out of turn")
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, asyncio.InvalidStateError) as error:
            self._down(f"round failed: {type(error).__name__}: {getattr(error, 'code', lambda: error)()}")
            return {}
        return {tree.request_id: DraftTree(list(tree.token_ids), list(tree.parents)) for tree in reply.trees}

    def _down(self, why: str) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        self.sent.clear()
        self.to_drop.clear()  # a new stream starts with no contexts: nothing to drop there
        self.retry_at = time.monotonic() + self.backoff_s
        log.warning("drafter %s down (%s); retrying in %.1f s", self.address, why, self.backoff_s)
        self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        await self.channel.close()
