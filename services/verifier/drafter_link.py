"""The verifier's side of one drafter: a long-lived Draft stream, and what each request has been sent on it.

A request stays with one drafter, which holds its draft context. If the drafter is down, answers late or
breaks the stream, the link marks itself down (its requests decode without trees meanwhile, never wrong) and
reconnects with backoff; a new stream starts empty, so every request's full context is sent again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time

import grpc

from treeserve.errors import TreeserveError
from treeserve.serving import client_options, normalize_address
from treeserve.tree import DraftTree
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc
from treeserve.wire import features_to_proto

log = logging.getLogger("treeserve.verifier")


def expand_drafter_addresses(addresses: list[str]) -> list[str]:
    """`dns:///name:port` stands for every address the name resolves to (drafter replicas behind one DNS name,
    as compose runs them): each becomes a drafter of its own, since a request's context lives on one replica.
    Other addresses are taken as they are."""
    expanded = []
    for address in addresses:
        if not address.startswith("dns:///"):
            expanded.append(normalize_address(address))
            continue
        host, _, port = address[len("dns:///"):].rpartition(":")
        if not host or not port.isdigit():
            raise TreeserveError(f"bad drafter address {address!r}: use dns:///name:port")
        try:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise TreeserveError(f"drafter address {address!r}: cannot resolve {host}: {error}") from None
        ips = sorted({info[4][0] for info in found})
        expanded.extend(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
        log.info("drafter %s resolved to %s", address, ", ".join(ips))
    return expanded


@dataclasses.dataclass
class DraftRound:
    """What one round trip to a drafter brought back, and how long its parts took."""

    trees: dict[str, DraftTree]
    propose_s: float = 0.0  # the drafter's compute, as it reports it
    round_trip_s: float = 0.0  # write to read on the stream; minus propose_s, this is transport
    request: drafter_pb2.DraftRequest | None = None  # the two messages, for whoever measures their size
    response: drafter_pb2.DraftResponse | None = None


class DrafterLink:
    def __init__(self, address: str, timeout_s: float, max_backoff_s: float = 5.0):
        self.address, self.timeout_s, self.max_backoff_s = address, timeout_s, max_backoff_s
        self.channel = grpc.aio.insecure_channel(address, options=client_options(max_backoff_s))
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.call = None  # the Draft stream while up
        self.kind, self.max_budget = "", 0
        self.feature_layer_ids: tuple[int, ...] = ()  # target layers whose hidden states the drafter needs
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
            self.feature_layer_ids = tuple(info.feature_layer_ids)
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

    async def draft(self, requests: dict, trace_contexts: dict[str, dict[str, str]],
                    budgets: dict[str, int] | None = None) -> DraftRound:
        """requests: request id -> its Generation (committed tokens and budget); trace_contexts: request id ->
        W3C headers of its round span (empty when tracing is off); budgets: this round's tree budget per request
        (default: each request's own). Only tokens this stream has not seen travel.
        Returns the trees the drafter proposed; none when the link is down or fails this round (those requests
        then decode plainly)."""
        if not self.up:
            return DraftRound({})
        self.round += 1
        message = drafter_pb2.DraftRequest(round=self.round)
        for request_id in self.to_drop:
            message.items.add(request_id=request_id, finished=True)
        self.to_drop.clear()
        for request_id, generation in requests.items():
            sent = self.sent.get(request_id, 0)
            item = message.items.add(request_id=request_id, new_token_ids=generation.committed_since(sent),
                                     budget=min((budgets or {}).get(request_id, generation.budget),
                                                self.max_budget),
                                     trace_context=trace_contexts.get(request_id, {}))
            if self.feature_layer_ids:  # the rows of every token that entered the KV cache since the last item
                item.features.CopyFrom(features_to_proto(generation.features_since(max(sent - 1, 0))))
            self.sent[request_id] = generation.committed_count
        started = time.perf_counter()
        try:
            await self.call.write(message)
            reply = await asyncio.wait_for(self.call.read(), self.timeout_s)
            if reply is grpc.aio.EOF or reply.round != self.round:
                raise ConnectionError("the stream ended or answered out of turn")
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, asyncio.InvalidStateError) as error:
            detail = error.code().name if isinstance(error, grpc.aio.AioRpcError) else error
            self._down(f"round failed: {type(error).__name__}: {detail}")
            return DraftRound({})
        round_trip_s = time.perf_counter() - started
        trees = {tree.request_id: DraftTree(list(tree.token_ids), list(tree.parents)) for tree in reply.trees}
        return DraftRound(trees, reply.propose_seconds, round_trip_s, message, reply)

    def _down(self, why: str) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        self.sent.clear()
        self.to_drop.clear()  # a new stream starts with no contexts: nothing to drop there
        self.retry_at = time.monotonic() + self.backoff_s
        log.warning("drafter %s down (%s); retrying in %.1f s", self.address, why, self.backoff_s)
        self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)

    async def disable(self) -> None:
        """Stop using this drafter for good (it cannot serve this verifier's requests)."""
        self._down("disabled")
        self.retry_at = float("inf")

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        await self.channel.close()
