"""The gateway: validates and tokenizes a request, streams it through the least busy verifier, detokenizes.

One long-lived channel per verifier. A request goes to the verifier with the fewest requests in flight from this
gateway (one that just failed goes last, ties to the least recently used) and moves on to the next verifier
while none has answered it yet. Text is streamed as it settles (see TextStream).

Health follows the verifiers: SERVING while at least one verifier's own health says SERVING, NOT_SERVING
otherwise. A prompt is refused by its size in bytes before tokenizing where it cannot fit the context, and long
prompts are tokenized in a thread, so one client's large prompts never stall the other streams.

`GatewayServicer.generate` is the one implementation of a request; the gRPC handler here and the
OpenAI-compatible HTTP API (treeserve.gateway.openai_api) are two front doors to it, each answering its
RequestFailed in its own protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Iterable, Mapping

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from treeserve.detokenize import TextStream
from treeserve.errors import RequestFailed, TreeserveError
from treeserve.framing import FramedCall
from treeserve.serving import (Service, client_options, freeze_startup_objects, normalize_address, start,
                               unix_socket_path)
from treeserve.telemetry import GatewayMetrics, Tracing
from treeserve.tokenizer import Tokenizer
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.wire import params_from_proto, params_to_proto

log = logging.getLogger("treeserve.gateway")

# Verifier statuses that mean something to the client as they are; any other failure is UNAVAILABLE.
PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
# Failures after which another verifier may take a request that has produced nothing yet.
TRY_NEXT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Prompts longer than this (characters) are tokenized in a thread; shorter ones cost less than the hand-off.
INLINE_TOKENIZE_CHARS = 4096
HEALTH_RETRY_S = 0.5  # between attempts to watch an unreachable verifier's health
CHAT_ROLES = ("system", "user", "assistant")


class Undecodable:
    """A request whose bytes do not parse (a string that is not UTF-8, a truncated field): answered with
    INVALID_ARGUMENT by the handler, where a failing deserializer would give the client UNKNOWN."""

    def __init__(self, message_name: str):
        self.message_name = message_name

    def error(self) -> str:
        return f"the request is not a valid {self.message_name}: a string that is not UTF-8, or truncated bytes"


def tolerant(message_class):
    """message_class.FromString, returning an Undecodable instead of raising."""
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Undecodable(message_class.DESCRIPTOR.full_name)
    return deserialize


class VerifierFailed(Exception):
    """How a verifier ended one request: the gRPC status it gave, or the session's failure."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
DEADLINE_PASSED = object()  # put in a request's updates when its deadline passes


class VerifierSession:
    """This gateway's Session stream to one verifier, which carries all of its requests there: per round one
    message with every request's tokens, where a stream a request would take a message each. Each request's
    updates go to its own queue; when the stream fails, every request on it gets the failure.

    `frames`: the stream as frames on the verifier's session socket (a verifier on this host); None: over gRPC."""

    def __init__(self, stub: verifier_pb2_grpc.VerifierServiceStub, frames: FramedCall | None = None):
        if frames is None:
            self.outgoing: asyncio.Queue = asyncio.Queue()  # starts and cancels, in the order the stream sends them
            self.call = stub.Session(self._requests())
            self.send = self.outgoing.put_nowait
        else:
            self.call, self.send = frames, frames.send  # (a frame's write is buffered: no task to wake)
        self.queues: dict[str, asyncio.Queue] = {}  # request_id -> its updates (SessionUpdate or VerifierFailed)
        self.failure: VerifierFailed | None = None
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self):  # (for as long as the call lasts: close() cancels it)
        while True:
            yield await self.outgoing.get()

    def start(self, request: verifier_pb2.VerifierServiceGenerateRequest, trace_context: dict[str, str]
              ) -> asyncio.Queue:
        queue = self.queues[request.request_id] = asyncio.Queue()
        start = verifier_pb2.SessionStart(request=request, trace_context=trace_context)
        self.send(verifier_pb2.VerifierServiceSessionRequest(start=start))
        return queue

    def end(self, request_id: str, cancel: bool) -> None:
        """The request is over here; with `cancel`, the verifier is told to end it too."""
        if self.queues.pop(request_id, None) is not None and cancel and self.failure is None:
            self.send(verifier_pb2.VerifierServiceSessionRequest(cancel=request_id))

    async def _read(self) -> None:
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                for update in message.updates:
                    queue = self.queues.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
            failure = VerifierFailed(grpc.StatusCode.UNAVAILABLE, "the verifier ended the session")
        except grpc.aio.AioRpcError as error:
            failure = VerifierFailed(error.code(), error.details() or error.code().name)
        except ConnectionError as error:  # the framed stream's socket (a refusal says why)
            failure = VerifierFailed(grpc.StatusCode.UNAVAILABLE, f"the verifier's session socket: {error}")
        except asyncio.CancelledError:
            failure = VerifierFailed(grpc.StatusCode.UNAVAILABLE, "the gateway is closing")
        self.failure = failure
        for queue in self.queues.values():
            queue.put_nowait(failure)
        self.queues.clear()

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class Verifier:
    """One verifier: its channel, its info once it answered GetInfo, and this gateway's requests on it."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(normalize_address(address), options=client_options())
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.channel)
        self.info: verifier_pb2.VerifierServiceGetInfoResponse | None = None
        self.inflight = 0
        self.failed = False  # its last call found it unreachable
        self.last_pick = 0
        self.serving = False  # its own health says SERVING
        self._session: VerifierSession | None = None

    async def session(self) -> VerifierSession:
        """The Session stream, opened at the first request and again once it has failed: as frames on the
        verifier's session socket where it names one and is on this host, else over gRPC."""
        if self._session is None or self._session.failure is not None:
            frames, socket = None, self.info.session_socket if self.info is not None else ""
            if socket and unix_socket_path(self.address) is not None:
                try:
                    frames = await FramedCall.open(socket, verifier_pb2.VerifierServiceSessionResponse)
                    log.info("verifier %s: Session stream as frames on %s", self.address, socket)
                except OSError as error:
                    log.warning("verifier %s: its session socket %s: %s; Session over gRPC", self.address, socket,
                                error)
            if self._session is None or self._session.failure is not None:  # (unless one opened meanwhile)
                self._session = VerifierSession(self.stub, frames)
            elif frames is not None:
                frames.cancel()
        return self._session

    def close_session(self) -> None:
        if self._session is not None:
            self._session.close()

    async def fetch_info(self, timeout: float) -> None:
        try:
            self.info = await self.stub.GetInfo(verifier_pb2.VerifierServiceGetInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            log.debug("verifier %s: GetInfo: %s: %s", self.address, error.code().name, error.details())
            self.failed = True
            return
        self.failed = False
        log.info("verifier %s: model %s, context %d, drafters: %s", self.address, self.info.model,
                 self.info.max_context, ", ".join(self.info.drafters) or "none")

    async def watch_health(self, on_change: Callable[[], Awaitable[None]]) -> None:
        """Follows the verifier's health for good; unreachable counts as not serving. Calls on_change on a change."""
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest()):
                    await self._set_serving(reply.status == health_pb2.HealthCheckResponse.SERVING, on_change)
            except grpc.aio.AioRpcError as error:
                log.debug("verifier %s: health: %s: %s", self.address, error.code().name, error.details())
            await self._set_serving(False, on_change)
            await asyncio.sleep(HEALTH_RETRY_S)

    async def _set_serving(self, serving: bool, on_change: Callable[[], Awaitable[None]]) -> None:
        if serving == self.serving:
            return
        if serving:  # a verifier back from a restart may serve another model or context
            await self.fetch_info(timeout=5.0)
        self.serving = serving
        log.info("verifier %s: %s", self.address, "SERVING" if serving else "NOT_SERVING")
        await on_change()


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, tokenizer: Tokenizer, verifiers: list[str], max_inflight: int = 256,
                 default_max_new_tokens: int = 64, tracing: Tracing | None = None,
                 metrics: GatewayMetrics | None = None):
        if not verifiers:
            raise TreeserveError("the gateway needs at least one verifier address")
        self.tokenizer = tokenizer
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics or GatewayMetrics()
        self.verifiers = [Verifier(address) for address in verifiers]
        self.max_inflight, self.default_max_new_tokens = max_inflight, default_max_new_tokens
        self.inflight = 0
        self.picks = itertools.count(1)
        self.watchers: list[asyncio.Task] = []
        # Few threads: large prompts from one client queue here rather than take every core, and the event loop
        # keeps a core of its own for the streams.
        threads = max(1, min(2, (os.cpu_count() or 1) - 1))
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self.bytes_per_token = tokenizer.longest_token_bytes

    @property
    def serving(self) -> bool:
        return any(v.serving and v.info is not None for v in self.verifiers)

    def watch_verifiers(self, on_change: Callable[[], Awaitable[None]]) -> None:
        """Follows every verifier's health; on_change is called whenever one changes."""
        self.watchers = [asyncio.ensure_future(v.watch_health(on_change)) for v in self.verifiers]

    @property
    def info(self) -> verifier_pb2.VerifierServiceGetInfoResponse | None:
        return next((v.info for v in self.verifiers if v.info is not None), None)

    async def refresh_info(self, timeout: float = 5.0) -> bool:
        """Asks the verifiers that have not answered yet; True once at least one has."""
        await asyncio.gather(*(v.fetch_info(timeout) for v in self.verifiers if v.info is None))
        first = self.info
        for v in self.verifiers:
            if v.info is not None and (v.info.model, v.info.max_context) != (first.model, first.max_context):
                log.warning("verifier %s serves %s (context %d) but %s serves %s (context %d)", v.address,
                            v.info.model, v.info.max_context, self.verifiers[0].address, first.model, first.max_context)
        return first is not None

    async def wait_for_verifiers(self, retry_s: float = 1.0) -> None:
        while not await self.refresh_info():
            await asyncio.sleep(retry_s)
        if self.tokenizer.vocab_size > self.info.vocab_size:
            log.warning("the tokenizer has %d tokens but the verifier's model only %d: is --target the verifier's "
                        "model?", self.tokenizer.vocab_size, self.info.vocab_size)

    async def close(self) -> None:
        for watcher in self.watchers:
            watcher.cancel()
        for verifier in self.verifiers:
            verifier.close_session()
        await asyncio.gather(*(v.channel.close() for v in self.verifiers))
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def model_info(self) -> verifier_pb2.VerifierServiceGetInfoResponse:
        """The served model's info; RequestFailed (UNAVAILABLE) while no verifier has answered."""
        if self.info is None and not await self.refresh_info():
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                "no verifier answered: " + ", ".join(v.address for v in self.verifiers))
        return self.info

    async def GetModelInfo(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error())
        try:
            info = await self.model_info()
        except RequestFailed as failure:
            await context.abort(failure.code, failure.message)
        return gateway_pb2.GetModelInfoResponse(model=info.model, max_context=info.max_context,
                                                max_new_tokens_limit=info.max_context - 1, max_budget=info.max_budget)

    async def _prepare(self, request) -> tuple[verifier_pb2.VerifierServiceGenerateRequest, TextStream]:
        """The verifier request and the text stream for a valid request; RequestFailed (INVALID_ARGUMENT, or
        UNAVAILABLE while no verifier answered) otherwise."""
        try:
            if isinstance(request, Undecodable):
                raise TreeserveError(request.error())
            check_prompt(request)
            params = params_from_proto(request.sampling, request.stop, self.default_max_new_tokens)
            params.validate()
            info = await self.model_info()
            budget = request.speculation.budget
            if not request.speculation.disabled and budget > info.max_budget:
                raise TreeserveError(f"budget must be at most {info.max_budget}, got {budget}")
            self._check_prompt_bytes(prompt_text(request), params.max_new_tokens, info.max_context)
            ids = await self._tokenize(request)
            if len(ids) + params.max_new_tokens > info.max_context:
                raise TreeserveError(f"prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                                     f"exceeds the model's context of {info.max_context} tokens")
        except TreeserveError as error:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        sampling, stop = params_to_proto(params)
        verifier_request = verifier_pb2.VerifierServiceGenerateRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=sampling, stop=stop,
            speculation=request.speculation)
        eos = () if params.ignore_eos else (info.eos_token_ids or self.tokenizer.eos_ids)
        return verifier_request, TextStream(self.tokenizer, {*params.stop_token_ids, *eos}, params.stop_strings)

    def _check_prompt_bytes(self, prompt: str, max_new_tokens: int, max_context: int) -> None:
        """Refuses, without tokenizing, a prompt of more bytes than the context's room for it could hold."""
        limit = max(max_context - max_new_tokens, 0) * self.bytes_per_token
        # Characters never outnumber bytes: a prompt of more characters than the limit is refused unencoded.
        size = len(prompt) if len(prompt) > limit else len(prompt.encode())
        if size > limit:
            raise TreeserveError(f"prompt ({size} bytes or more) plus max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {max_context} tokens: at most {limit} prompt bytes can fit")

    async def _tokenize(self, request) -> list[int]:
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            encode = functools.partial(self.tokenizer.encode_messages, messages)
        else:
            encode = functools.partial(self.tokenizer.encode_prompt, request.prompt, request.chat)
        if len(prompt_text(request)) <= INLINE_TOKENIZE_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, encode)

    def _ranked(self) -> list[Verifier]:
        return sorted(self.verifiers, key=lambda v: (v.failed, v.inflight, v.last_pick))

    async def Generate(self, request, context):
        """The gRPC front door."""
        replies = self.generate(request, context.time_remaining(), context.invocation_metadata() or ())
        async with contextlib.aclosing(replies):  # a client that leaves mid-stream cancels the verifier's call too
            try:
                async for response in replies:
                    yield response
            except RequestFailed as failure:
                await context.abort(failure.code, failure.message)

    async def generate(self, request, time_remaining: float | None = None,
                       trace_headers: Mapping[str, str] | Iterable[tuple[str, str]] = ()
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One request through the least busy verifier, whichever front door it came in by: its responses, the
        last with the finish reason, usage and speculation stats. `time_remaining`: its deadline in seconds
        (None: none); `trace_headers`: W3C trace context. Raises RequestFailed. Counts and traces the request
        around `_generate`, which does the work."""
        span = self.tracing.tracer.start_span("gateway.generate", kind=trace.SpanKind.SERVER,
                                              context=self.tracing.parent(trace_headers))
        outcome = "OK"
        try:
            async for response in self._generate(request, time_remaining, span):
                yield response
        except RequestFailed as failure:
            outcome = failure.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, left or ran out of time
            outcome = "CANCELLED"
            raise
        except BaseException:
            outcome = "UNKNOWN"
            raise
        finally:
            self.metrics.requests.labels(code=outcome).inc()
            span.set_attribute("rpc.grpc.status_code", outcome)
            span.end()

    async def _generate(self, request, time_remaining: float | None, span: trace.Span):
        if self.inflight >= self.max_inflight:
            raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the gateway is at its limit of {self.max_inflight} requests in flight; retry later")
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            started = time.perf_counter()
            verifier_request, stream = await self._prepare(request)
            span.set_attributes({"treeserve.request_id": verifier_request.request_id,
                                 "treeserve.prompt_tokens": len(verifier_request.prompt_token_ids)})
            trace_context = self.tracing.carrier(span)
            candidates = self._ranked()
            for attempt, verifier in enumerate(candidates):
                verifier.inflight += 1
                verifier.last_pick = next(self.picks)
                session = await verifier.session()
                updates = session.start(verifier_request, trace_context)
                timer = None if deadline is None else asyncio.get_running_loop().call_later(
                    seconds_left(deadline), updates.put_nowait, DEADLINE_PASSED)
                replies, ended = 0, False
                try:
                    while True:
                        update = await updates.get()
                        if update is DEADLINE_PASSED:
                            raise TimeoutError
                        if isinstance(update, VerifierFailed):
                            ended = True
                            raise update
                        if update.error_code:
                            ended = True
                            raise VerifierFailed(STATUS_CODES.get(update.error_code, grpc.StatusCode.UNKNOWN),
                                                 update.error_message)
                        reply = update.response
                        if replies == 0:
                            self.metrics.time_to_first_token.observe(time.perf_counter() - started)
                        replies += 1
                        self.metrics.output_tokens.inc(len(reply.token_ids))
                        ended = bool(reply.finish_reason)
                        yield self._response(reply, stream)
                        if ended:
                            break
                    verifier.failed = False
                    elapsed = time.perf_counter() - started
                    self.metrics.request_seconds.observe(elapsed)
                    span.set_attributes({"treeserve.verifier": verifier.address,
                                         "treeserve.completion_tokens": reply.usage.completion_tokens,
                                         "treeserve.mean_accepted": reply.stats.mean_accepted})
                    log.info("request %s: %d prompt + %d tokens on %s in %.2f s, %s",
                             verifier_request.request_id, reply.usage.prompt_tokens, reply.usage.completion_tokens,
                             verifier.address, elapsed, generation_pb2.FinishReason.Name(reply.finish_reason))
                    return
                except VerifierFailed as error:
                    code = error.code
                    verifier.failed = code == grpc.StatusCode.UNAVAILABLE
                    if replies == 0 and code in TRY_NEXT and attempt + 1 < len(candidates):
                        log.warning("verifier %s: %s: %s; trying the next one", verifier.address, code.name,
                                    error.details)
                        continue
                    if code in PASSED_THROUGH:
                        status = (code, error.details or code.name)
                    else:
                        status = (grpc.StatusCode.UNAVAILABLE,
                                  f"verifier {verifier.address} failed: {code.name}: {error.details}")
                except TimeoutError:
                    status = (grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline passed after {replies} replies")
                except (asyncio.CancelledError, GeneratorExit):  # the client cancelled, left or ran out of time
                    log.info("request %s: cancelled after %d replies", verifier_request.request_id, replies)
                    raise
                finally:
                    session.end(verifier_request.request_id, cancel=not ended)  # frees the verifier's work
                    verifier.inflight -= 1
                    if timer is not None:
                        timer.cancel()
                log.warning("request %s: %s", verifier_request.request_id, status[1])
                raise RequestFailed(*status)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()

    @staticmethod
    def _response(reply: verifier_pb2.VerifierServiceGenerateResponse, stream: TextStream):
        response = gateway_pb2.GenerateResponse(text=stream.push(reply.token_ids, final=bool(reply.finish_reason)),
                                                token_ids=reply.token_ids)
        if reply.finish_reason:
            response.finish_reason = reply.finish_reason
            response.usage.CopyFrom(reply.usage)
            response.stats.CopyFrom(reply.stats)
            response.seed = reply.seed
        return response


def check_prompt(request: gateway_pb2.GenerateRequest) -> None:
    """A prompt, or a conversation of known roles; raises TreeserveError otherwise."""
    if request.prompt and request.messages:
        raise TreeserveError("give a prompt or messages, not both")
    if not request.prompt and not request.messages:
        raise TreeserveError("the prompt is empty")
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise TreeserveError(f"messages[{i}]: the role must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {message.role!r}")


def prompt_text(request: gateway_pb2.GenerateRequest) -> str:
    """The request's own text, without any chat template: what its prompt's size in bytes is checked on."""
    return request.prompt or "".join(message.content for message in request.messages)


def seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def register(servicer: GatewayServicer):
    """The generated handlers, but with deserializers that pass undecodable bytes on as Undecodable."""
    def add(server: grpc.aio.Server) -> list[str]:
        name = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, request_deserializer=tolerant(gateway_pb2.GenerateRequest),
                response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo, request_deserializer=tolerant(gateway_pb2.GetModelInfoRequest),
                response_serializer=gateway_pb2.GetModelInfoResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
        return [name]

    return add


async def serve(listen: str, servicer: GatewayServicer) -> tuple[Service, asyncio.Task]:
    """Starts the gateway; the returned task ends once health first turns SERVING. From then on health follows
    the verifiers': SERVING while one of them is."""
    service = await start(listen, register(servicer))
    first_serving = asyncio.Event()
    reported = [False]  # what health says now

    async def follow_verifiers():
        serving = servicer.serving
        if serving == reported[0]:
            return
        reported[0] = serving
        await service.set_serving(serving)
        if serving:
            first_serving.set()
        log.info("gateway %s: %s", service.address, "SERVING" if serving else "NOT_SERVING: no verifier is SERVING")

    async def become_ready():
        await servicer.wait_for_verifiers()
        freeze_startup_objects()
        servicer.watch_verifiers(follow_verifiers)
        await first_serving.wait()
        log.info("gateway ready on %s", service.address)

    return service, asyncio.ensure_future(become_ready())
