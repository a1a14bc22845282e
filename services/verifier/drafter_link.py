"""The verifier's side of one drafter: a long-lived Draft stream (gRPC, or frames on the drafter's Unix socket
when it is on this host: treeserve.framing, with feature rows through shared memory: treeserve.feature_region),
and what each request has been sent on it.

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
import torch

from treeserve.errors import TreeserveError
from treeserve.feature_region import DEFAULT_REGION_BYTES, FeatureRegion, PlacedRows
from treeserve.framing import FramedCall
from treeserve.serving import client_options, normalize_address, unix_socket_path
from treeserve.tree import DraftTree
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc
from treeserve.verifier.engine import kept_feature_rows
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
    round_trip_s: float = 0.0  # write to read on the stream (to the failure, for a round that failed); minus
    # propose_s, this is transport
    # The round's messages (more than one request when its features were split: MESSAGE_FEATURE_BYTES).
    requests: list[drafter_pb2.DraftRequest] = dataclasses.field(default_factory=list)
    responses: list[drafter_pb2.DraftResponse] = dataclasses.field(default_factory=list)
    # Whether a request's context moved on by more than its last round (`catches_up`): such a round trip carries
    # more tokens and features than a steady one, so it prices a try, not a round.
    catch_up: bool = False
    # Whether it asked a request's first tree of the drafter's own on this stream, which brings the request's whole
    # context so far (its prompt): dearer than a try after plain rounds.
    prompt: bool = False

    @property
    def request_bytes(self) -> int:
        return sum(message.ByteSize() for message in self.requests)

    @property
    def response_bytes(self) -> int:
        return sum(message.ByteSize() for message in self.responses)


@dataclasses.dataclass
class SentRound:
    """A round's messages written on a link's stream (DrafterLink.send), their replies not yet read."""

    messages: list[drafter_pb2.DraftRequest]
    started: float  # perf_counter before the first write
    catch_up: bool
    lookup_only: bool
    prompt: bool = False


# Most bytes of features one Draft message carries. gRPC refuses a message above its limit (serving.MESSAGE_OPTIONS)
# with INTERNAL, and a long prompt's features, or a catch-up after many plain rounds at a large batch, exceed it;
# such a round goes out as several messages, each request's rows in order, the last piece with its budget.
MESSAGE_FEATURE_BYTES = 16 << 20


@dataclasses.dataclass
class ContextPiece:
    """Part of one request's new context: tokens a .. b of its draft context, with their feature rows."""

    request_id: str
    token_ids: list[int]
    # (rows, width) torch tensor, or PlacedRows where they were written to the feature region, or None for a
    # drafter that takes no features
    features: object | None
    budget: int = 0  # the request's last piece asks for its tree; earlier ones only extend the context

    @property
    def feature_bytes(self) -> int:
        """Bytes of features the message carries."""
        if self.features is None or isinstance(self.features, PlacedRows):
            return 0
        return self.features.numel() * self.features.element_size()


def split_context(request_id: str, token_ids: list[int], features, max_rows: int) -> list[ContextPiece]:
    """Cut a request's new tokens and feature rows into pieces the drafter takes one after another: every token in
    the first, the rows (oldest first) at most `max_rows` a piece; a drafter takes rows later than their tokens."""
    if features is None or len(features) <= max_rows:
        return [ContextPiece(request_id, token_ids, features)]
    return [ContextPiece(request_id, token_ids if start == 0 else [], features[start:start + max_rows])
            for start in range(0, len(features), max_rows)]


def catches_up(sent: int | None, generation) -> bool:
    """Whether a request's next item carries more than its last round's tokens (`sent`: the tokens of its context
    the stream has seen, None if none): it is new there, or it decoded plainly since it was last sent."""
    return sent is None or generation.committed_count - sent > generation.last_accepted + 1


STREAM_FAILURES = (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, asyncio.InvalidStateError)


def describe(error: Exception) -> str:
    detail = error.code().name if isinstance(error, grpc.aio.AioRpcError) else error
    return f"{type(error).__name__}: {detail}"


class DrafterLink:
    def __init__(self, address: str, timeout_s: float, max_backoff_s: float = 5.0,
                 region_bytes: int = DEFAULT_REGION_BYTES):
        """region_bytes: the feature region offered to a drafter on this host that takes features (0: none)."""
        self.address, self.timeout_s, self.max_backoff_s = address, timeout_s, max_backoff_s
        self.region_bytes = region_bytes
        self.region: FeatureRegion | None = None  # shared with the drafter on this stream, while up
        self.channel = grpc.aio.insecure_channel(address, options=client_options(max_backoff_s))
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.call = None  # the Draft stream while up
        self.kind, self.max_budget = "", 0
        self.feature_layer_ids: tuple[int, ...] = ()  # target layers whose hidden states the drafter needs
        self.lookup_trees = False  # whether it also drafts by prompt lookup alone (lookup_only rounds)
        self.sent: dict[str, int] = {}  # request id -> tokens of its context this stream has seen
        self.rows_sent: dict[str, int] = {}  # request id -> feature rows of its context this stream has seen
        self.to_drop: set[str] = set()  # finished or cancelled requests the drafter should forget
        self.unanswered: list[drafter_pb2.DraftRequest] = []  # messages of send_rows whose answers are unread
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
            self.lookup_trees = info.lookup_trees
            self.call = await self._open_stream(info.draft_socket)
            if isinstance(self.call, FramedCall) and self.feature_layer_ids:
                self.region = await self._share_region(self.call)
            self.sent.clear()
            self.rows_sent.clear()
            self.backoff_s = 0.1
            log.info("drafter %s (%s, max budget %d) connected%s", self.address, self.kind, self.max_budget,
                     " (Draft stream as frames on its Unix socket)" if isinstance(self.call, FramedCall) else "")
        except grpc.aio.AioRpcError as error:
            self._down(f"connect failed: {error.code().name}")
        except STREAM_FAILURES as error:  # the draft socket, while a feature region was offered
            self._down(f"connect failed: {describe(error)}")
        return self.up

    async def _open_stream(self, draft_socket: str):
        """The Draft stream: as frames on the drafter's own Unix socket for it when it has one and this link
        reaches it over a Unix socket too (so on its host), else over gRPC."""
        if draft_socket and unix_socket_path(self.address) is not None:
            try:
                return await FramedCall.open(draft_socket, drafter_pb2.DraftResponse)
            except OSError as error:
                log.warning("drafter %s: its draft socket %s: %s; drafting over gRPC", self.address, draft_socket,
                            error)
        return self.stub.Draft()

    async def _share_region(self, call: FramedCall) -> FeatureRegion | None:
        """A feature region the drafter has mapped, or None (features then travel in the messages)."""
        region = FeatureRegion.create(self.region_bytes)
        if region is None:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                why_not = await call.share_region(region.path)
        except BaseException:
            region.close()
            raise
        region.unlink()  # both ends have it mapped: nothing is left behind, however either ends
        if why_not:
            log.warning("drafter %s: no feature region (%s); features travel in the messages", self.address,
                        why_not)
            region.close()
            return None
        return region

    def forget(self, request_id: str) -> None:
        self.rows_sent.pop(request_id, None)
        if self.sent.pop(request_id, None) is not None:
            self.to_drop.add(request_id)

    async def draft(self, requests: dict, trace_contexts: dict[str, dict[str, str]],
                    budgets: dict[str, int] | None = None, lookup_only: bool = False) -> DraftRound:
        """requests: request id -> its Generation (committed tokens and budget); trace_contexts: request id ->
        W3C headers of its round span (empty when tracing is off); budgets: this round's tree budget per request
        (default: each request's own); lookup_only: prompt lookup's trees alone (a drafter with lookup_trees),
        without feature rows: those go with the next round that drafts the drafter's own trees.
        Only tokens and rows this stream has not seen travel.
        Returns the trees the drafter proposed; none when the link is down or fails this round (those requests
        then decode plainly)."""
        return await self.replies(await self.send(requests, trace_contexts, budgets, lookup_only))

    async def send(self, requests: dict, trace_contexts: dict[str, dict[str, str]],
                   budgets: dict[str, int] | None = None, lookup_only: bool = False) -> SentRound | DraftRound:
        """The first half of `draft`: the round's messages written. A frame's write does not suspend the caller (a
        gRPC stream's message is handed over before it does), so the drafter has them before any other task of the
        loop runs (a gateway stream's message, the last round's bookkeeping): those then run while it drafts.
        Returns what `replies` waits on, or the DraftRound of a link that is down or failed."""
        if not self.up:
            return DraftRound({})
        began = time.perf_counter()
        try:
            await self._read_answers_to_rows()
            waited = time.perf_counter() - began
            catch_up = any(self._catches_up(request_id, generation, lookup_only)
                           for request_id, generation in requests.items())
            prompt = not lookup_only and any(request_id not in self._contexts_sent for request_id in requests)
            messages = self._messages(requests, trace_contexts, budgets or {}, lookup_only)
            # The round trip runs from the first write, and a wait for send_rows' answers is the drafter's too.
            started = time.perf_counter() - waited
            for message in messages:  # all written first: the drafter works through them while the rest travel
                await self.call.write(message)
        except STREAM_FAILURES as error:
            self._down(f"round failed: {describe(error)}")
            return DraftRound({}, round_trip_s=time.perf_counter() - began)
        return SentRound(messages, started, catch_up, lookup_only, prompt)

    async def replies(self, sent: SentRound | DraftRound) -> DraftRound:
        """The second half of `draft`: the trees the drafter answered `send`'s messages with."""
        if isinstance(sent, DraftRound):
            return sent
        trees, propose_s, replies = {}, 0.0, []
        try:
            for message in sent.messages:
                reply = await self._reply_to(message)
                trees.update((tree.request_id, self._tree(tree, sent.lookup_only)) for tree in reply.trees)
                propose_s += reply.propose_seconds
                replies.append(reply)
        except STREAM_FAILURES as error:
            self._down(f"round failed: {describe(error)}")
            return DraftRound({}, round_trip_s=time.perf_counter() - sent.started)  # the wait counts all the same
        return DraftRound(trees, propose_s, time.perf_counter() - sent.started, sent.messages, replies, sent.catch_up,
                          sent.prompt)

    @property
    def _contexts_sent(self) -> dict[str, int]:
        """The requests whose contexts the drafter has for its own trees: their rows, for one that takes features."""
        return self.rows_sent if self.feature_layer_ids else self.sent

    def _catches_up(self, request_id: str, generation, lookup_only: bool) -> bool:
        """Whether the request's item carries more than its last round's: tokens, or for the drafter's own tree
        the feature rows too (rounds of lookup's trees alone send none)."""
        if self.feature_layer_ids and not lookup_only:
            rows = self.rows_sent.get(request_id)
            return catches_up(None if rows is None else rows + 1, generation)  # row i is token i's
        return catches_up(self.sent.get(request_id), generation)

    def _tree(self, tree: drafter_pb2.DraftTree, lookup_only: bool) -> DraftTree:
        """A reply's tree. The own trees of a drafter that drafts by lookup alone too (merged) say how long their
        lookup chain is, 0 included."""
        chain = tree.lookup_nodes if self.lookup_trees and not lookup_only else None
        # A repeated field's slice is a list, made about twice as fast as list() iterating over the field.
        return DraftTree(tree.token_ids[:], tree.parents[:], chain)

    async def send_rows(self, requests: dict) -> None:
        """The feature rows these requests' draft contexts lack (requests: request id -> its Generation), on a
        message that asks for no tree, whose answer is read only before the link's next message: the drafter
        writes them while the verifier goes on (DrafterServicer's write_ahead), so that a tree after rounds of
        plain decoding need not write them first."""
        if not self.up or not requests:
            return
        try:
            await self._read_answers_to_rows()
            for message in self._messages(requests, {}, dict.fromkeys(requests, 0)):
                await self.call.write(message)
                self.unanswered.append(message)
        except STREAM_FAILURES as error:
            self._down(f"sending feature rows failed: {describe(error)}")

    async def _read_answers_to_rows(self) -> None:
        """The answers to send_rows' messages, read before another message is built: the drafter has then
        taken their rows out of the feature region, which the next message writes again."""
        while self.unanswered:
            await self._reply_to(self.unanswered[0])
            del self.unanswered[0]

    async def send_drops(self) -> None:
        """Tell the drafter now which requests ended, on a message of their own, rather than with this link's
        next round: for when no round follows soon (the batch is empty), so their contexts are freed."""
        if not self.up or not self.to_drop:
            return
        try:
            await self._read_answers_to_rows()
            message = self._new_message()
            self._add_drops(message)
            await self.call.write(message)
            await self._reply_to(message)
        except STREAM_FAILURES as error:
            self._down(f"dropping finished requests failed: {describe(error)}")

    async def _reply_to(self, message: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        async with asyncio.timeout(self.timeout_s):  # (wait_for would start a task for every read)
            reply = await self.call.read()
        if reply is grpc.aio.EOF or reply.round != message.round:
            raise ConnectionError("the stream ended or answered out of turn")
        return reply

    def _add_drops(self, message: drafter_pb2.DraftRequest) -> None:
        """The requests that finished or were cancelled since the last message, for the drafter to forget."""
        for request_id in self.to_drop:
            message.items.add(request_id=request_id, finished=True)
        self.to_drop.clear()

    def _messages(self, requests: dict, trace_contexts: dict[str, dict[str, str]], budgets: dict[str, int],
                  lookup_only: bool = False) -> list[drafter_pb2.DraftRequest]:
        """This round's Draft messages: one, unless the features to send exceed MESSAGE_FEATURE_BYTES. Then the
        requests' contexts are cut into pieces, and the messages carry every request's first piece, then every
        second piece, and so on (as many messages for each as the bytes need): a request's pieces arrive in order,
        never two in one message."""
        waves: list[list[ContextPiece]] = []
        if self.region is not None:
            self.region.clear()  # the drafter has answered every message before this round's
        with_features = bool(self.feature_layer_ids) and not lookup_only
        if with_features:  # every row since the last the drafter was sent, for all requests at once
            feature_rows = kept_feature_rows(list(requests.values()),
                                             [self.rows_sent.get(request_id, 0) for request_id in requests])
            placed = self.region.place_items(feature_rows) if self.region is not None else [None] * len(requests)
        for i, (request_id, generation) in enumerate(requests.items()):
            sent, features = self.sent.get(request_id, 0), None
            if with_features:
                rows = feature_rows[i]
                self.rows_sent[request_id] = generation.cache.length  # every token but the root
                features = placed[i]
                if features is None:
                    features = rows[0] if len(rows) == 1 else torch.cat(rows)
            tokens = generation.committed_since(sent)
            if isinstance(features, PlacedRows):
                pieces = [ContextPiece(request_id, tokens, features)]
            else:
                row_bytes = features[:1].numel() * features.element_size() if features is not None else 0
                pieces = split_context(request_id, tokens, features, MESSAGE_FEATURE_BYTES // max(row_bytes, 1))
            pieces[-1].budget = min(budgets.get(request_id, generation.budget), self.max_budget)
            for wave, piece in enumerate(pieces):
                if wave == len(waves):
                    waves.append([])
                waves[wave].append(piece)
            self.sent[request_id] = generation.committed_count
        messages = [self._new_message()]
        self._add_drops(messages[0])
        for wave, pieces in enumerate(waves):
            if wave > 0:
                messages.append(self._new_message())
            carried = 0
            for piece in pieces:
                if carried and carried + piece.feature_bytes > MESSAGE_FEATURE_BYTES:
                    messages.append(self._new_message())
                    carried = 0
                carried += piece.feature_bytes
                item = messages[-1].items.add(request_id=piece.request_id, new_token_ids=piece.token_ids,
                                              budget=piece.budget, lookup_only=lookup_only and piece.budget > 0)
                if piece.budget:
                    item.trace_context.update(trace_contexts.get(piece.request_id, {}))
                if piece.features is not None:  # the rows of every token that entered the KV cache since
                    features_to_proto(piece.features, into=item.features)
        return messages

    def _new_message(self) -> drafter_pb2.DraftRequest:
        self.round += 1
        return drafter_pb2.DraftRequest(round=self.round)

    def _down(self, why: str) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        self._close_region()
        self.sent.clear()
        self.rows_sent.clear()
        self.to_drop.clear()  # a new stream starts with no contexts: nothing to drop there
        self.unanswered.clear()
        self.retry_at = time.monotonic() + self.backoff_s
        log.warning("drafter %s down (%s); retrying in %.1f s", self.address, why, self.backoff_s)
        self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)

    async def disable(self) -> None:
        """Stop using this drafter for good (it cannot serve this verifier's requests)."""
        self._down("disabled")
        self.retry_at = float("inf")

    def _close_region(self) -> None:
        """A stream's region dies with it: a new stream gets a new one, which no reader of the old can see."""
        if self.region is not None:
            self.region.close()
            self.region = None

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self._close_region()
        await self.channel.close()
