"""The OpenAI-compatible HTTP API: a second front door to `GatewayServicer.generate`, on Starlette, served by
uvicorn inside the gateway's own event loop.

POST /v1/chat/completions and /v1/completions (Server-Sent Events with `stream: true`), GET /v1/models and
/health. A request becomes the gateway's GenerateRequest and goes through the validation, tokenizer, admission
and verifier balancing of the gRPC path. Every response carries its usage and the request's speculation stats,
under vLLM's names (`metrics.speculative_decoding`). Errors are OpenAI's error JSON, with the HTTP status of the
gRPC one; a field that would change the output and is not supported is refused by name, never ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
import uuid
from typing import Any, AsyncIterator

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from treeserve.errors import TreeserveError
from treeserve.gateway.server import GatewayServicer, RequestFailed
from treeserve.settings import split_host_port
from treeserve.v1 import gateway_pb2, generation_pb2
from treeserve.wire import FINISH_REASONS

log = logging.getLogger("treeserve.gateway")

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
MAX_BODY_BYTES = 64 << 20  # as large as a gRPC request may be
CLIENT_LEFT = 499  # nginx's "client closed request": what a request whose client left before its answer counts as
UINT32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38
FINISH_NAMES = {value: name for name, value in FINISH_REASONS.items()}
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")

# The request fields either endpoint reads; each changes the output as OpenAI (or, for top_k, ignore_eos,
# stop_token_ids and return_token_ids, vLLM) documents it, and `speculation` is treeserve's own.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k",
                 "ignore_eos", "stop_token_ids", "speculation", "return_token_ids"}
# Fields that never change the output: accepted and ignored.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier"}
# Fields accepted only at the values that leave the output as it is; any other value is refused by name.
NEUTRAL_VALUES = {"n": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
                  "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "suffix": ("",),
                  "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
                  "response_format": ({"type": "text"},), "modalities": (["text"],)}
# OpenAI's developer role is the system role of models without one of their own.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An answer in OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @staticmethod
    def of(failure: RequestFailed) -> "ApiError":
        return ApiError(HTTP_STATUS.get(failure.code, 503), failure.message, code=failure.code.name.lower())

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def unsupported(name: str, value: Any = None) -> ApiError:
    if value is None:
        return ApiError(400, f"unsupported field: {name}", param=name, code="unsupported_parameter")
    return ApiError(400, f"unsupported value of {name}: {json.dumps(value)}", param=name, code="unsupported_value")


def invalid(name: str, message: str) -> ApiError:
    return ApiError(400, f"{name}: {message}", param=name, code="invalid_value")


# ------------------------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class Endpoint:
    chat: bool
    fields: frozenset[str]
    id_prefix: str
    response_object: str
    chunk_object: str


CHAT = Endpoint(True, frozenset(COMMON_FIELDS | {"messages", "max_completion_tokens"}), "chatcmpl-",
                "chat.completion", "chat.completion.chunk")
COMPLETIONS = Endpoint(False, frozenset(COMMON_FIELDS | {"prompt"}), "cmpl-", "text_completion", "text_completion")


@dataclasses.dataclass(frozen=True)
class Options:
    """What a request asks of its HTTP answer rather than of the generation."""

    model: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool


def typed(body: dict, name: str, kinds: tuple[type, ...], what: str, within: str = ""):
    """body[name] (None when absent or null), refused unless one of `kinds`; booleans are no numbers here.
    `within`: the enclosing field, for the message (speculation.budget)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise invalid(within + name, f"must be {what}")
    return value


def integer(body: dict, name: str, low: int, high: int = UINT32_MAX, within: str = "") -> int | None:
    value = typed(body, name, (int,), "an integer", within)
    if value is not None and not low <= value <= high:
        raise invalid(within + name, f"must be between {low} and {high}, got {value}")
    return value


def number(body: dict, name: str) -> float | None:
    """A number that a float32 field holds as it is (no infinity)."""
    value = typed(body, name, (int, float), "a number")
    if value is not None and not abs(value) <= FLOAT32_MAX:
        raise invalid(name, f"must be a finite number, at most {FLOAT32_MAX:.4g} in size")
    return value


def strings(body: dict, name: str) -> list[str]:
    """A string or a list of strings, as a list."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise invalid(name, "must be a string or a list of strings")


def check_fields(body: dict, endpoint: Endpoint) -> None:
    for name, value in body.items():
        if name in endpoint.fields or name in IGNORED_FIELDS or value is None:
            continue
        if name not in NEUTRAL_VALUES:
            raise unsupported(name)
        if value not in NEUTRAL_VALUES[name]:
            raise unsupported(name, value)


def chat_messages(body: dict) -> list[gateway_pb2.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages")
    return [chat_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def chat_message(message, where: str) -> gateway_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise invalid(where, "must be an object with a role and a content")
    for key in message:
        if key not in ("role", "content"):
            raise unsupported(f"{where}.{key}")
    role = message.get("role")
    if role not in ROLES:
        raise unsupported(f"{where}.role", role) if isinstance(role, str) else invalid(f"{where}.role", "is missing")
    return gateway_pb2.ChatMessage(role=ROLES[role], content=message_text(message.get("content"), where))


def message_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise unsupported(f"{where}.content[{j}]", part.get("type"))
        return "".join(part["text"] for part in content)
    raise invalid(f"{where}.content", "must be a string or a list of text parts")


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "must be one string (lists of prompts and token ids are not supported)")
    return prompt


def max_tokens(body: dict, endpoint: Endpoint) -> int:
    """max_tokens, or the chat endpoint's max_completion_tokens; 0 when neither (the gateway's default)."""
    given = {name: integer(body, name, 1) for name in ("max_tokens", "max_completion_tokens")
             if name in endpoint.fields and body.get(name) is not None}
    if len(given) > 1:
        raise invalid("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    return next(iter(given.values()), 0)


def speculation(body: dict) -> generation_pb2.SpeculationParams:
    """treeserve's own field: {"budget": drafted nodes per round} or {"disabled": true}."""
    given = typed(body, "speculation", (dict,), 'an object such as {"budget": 8} or {"disabled": true}') or {}
    for key in given:
        if key not in ("budget", "disabled"):
            raise unsupported(f"speculation.{key}")
    budget = integer(given, "budget", 1, within="speculation.")
    disabled = typed(given, "disabled", (bool,), "true or false", within="speculation.")
    return generation_pb2.SpeculationParams(disabled=bool(disabled), budget=budget or 0)


def sampling(body: dict) -> generation_pb2.SamplingParams:
    """OpenAI's defaults where a field is absent: temperature 1, top_p 1. The gateway checks the values."""
    temperature, top_p = number(body, "temperature"), number(body, "top_p")
    params = generation_pb2.SamplingParams(temperature=1.0 if temperature is None else temperature,
                                           top_p=1.0 if top_p is None else top_p, top_k=integer(body, "top_k", 0) or 0)
    seed = integer(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        params.seed = seed
    return params


def stop_conditions(body: dict, endpoint: Endpoint) -> generation_pb2.StopConditions:
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= UINT32_MAX
                                            for i in ids):
        raise invalid("stop_token_ids", "must be a list of token ids")
    return generation_pb2.StopConditions(max_new_tokens=max_tokens(body, endpoint), stop_strings=strings(body, "stop"),
                                         stop_token_ids=ids,
                                         ignore_eos=bool(typed(body, "ignore_eos", (bool,), "true or false")))


def response_options(body: dict) -> Options:
    stream = bool(typed(body, "stream", (bool,), "true or false"))
    stream_options = typed(body, "stream_options", (dict,), "an object") or {}
    if stream_options and not stream:
        raise invalid("stream_options", "only allowed with stream: true")
    for key in stream_options:
        if key != "include_usage":
            raise unsupported(f"stream_options.{key}")
    return Options(model=typed(body, "model", (str,), "a string"), stream=stream,
                   include_usage=bool(typed(stream_options, "include_usage", (bool,), "true or false",
                                            within="stream_options.")),
                   return_token_ids=bool(typed(body, "return_token_ids", (bool,), "true or false")))


def translate(body: dict, endpoint: Endpoint) -> tuple[gateway_pb2.GenerateRequest, Options]:
    """The gateway's request for an OpenAI request body, and what it asks of the answer; raises ApiError."""
    check_fields(body, endpoint)
    request = gateway_pb2.GenerateRequest(sampling=sampling(body), stop=stop_conditions(body, endpoint),
                                          speculation=speculation(body))
    if endpoint.chat:
        request.messages.extend(chat_messages(body))
    else:
        request.prompt = completion_prompt(body)
    return request, response_options(body)


async def read_json(request: Request) -> dict:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
    try:
        parsed = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as error:  # bad JSON, bad UTF-8, nesting too deep
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return parsed


def refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


# ------------------------------------------------------------------------------------------- answers


def usage(final: gateway_pb2.GenerateResponse) -> dict:
    prompt, completion = final.usage.prompt_tokens, final.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation_metrics(stats: generation_pb2.SpeculationStats) -> dict:
    """The request's speculation, under vLLM's per-request names. A round emits the drafted tokens it accepted
    plus one of the target's own, so the tokens past one a round are the accepted drafts."""
    accepted = max(stats.round_tokens - stats.rounds, 0)
    return {"speculative_decoding": {
        "mean_acceptance_length": stats.mean_accepted,
        "draft_acceptance_rate": accepted / stats.drafted_tokens if stats.drafted_tokens else 0.0,
        "num_spec_steps": stats.rounds,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_draft_tokens": accepted,
    }}


class Answer:
    """One request's OpenAI objects, built from the gateway's responses."""

    def __init__(self, endpoint: Endpoint, model: str, options: Options):
        self.endpoint, self.model, self.options = endpoint, model, options
        self.id = endpoint.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, text: str, token_ids, finish_reason: str | None, stream: bool) -> dict:
        if not self.endpoint.chat:
            content = {"text": text}
        elif stream:
            content = {"delta": {"content": text} if text else {}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
        if self.options.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def complete(self, text: str, token_ids: list[int], final: gateway_pb2.GenerateResponse) -> dict:
        """The whole answer of a request that was not streamed."""
        choice = self._choice(text, token_ids, FINISH_NAMES[final.finish_reason], stream=False)
        return self._object(self.endpoint.response_object, [choice], usage=usage(final),
                            metrics=speculation_metrics(final.stats))

    def chunks(self, response: gateway_pb2.GenerateResponse) -> list[dict]:
        """The stream chunks of one gateway response: its text, then, with the last, the finish reason and the
        usage (or, unless asked for usage, the stats on the finish chunk: the last chunk carries them)."""
        chunks = []
        if response.text or (self.options.return_token_ids and response.token_ids):
            chunks.append(self._chunk([self._choice(response.text, response.token_ids, None, stream=True)]))
        if response.finish_reason:
            finish = self._choice("", (), FINISH_NAMES[response.finish_reason], stream=True)
            stats = {} if self.options.include_usage else {"metrics": speculation_metrics(response.stats)}
            chunks.append(self._chunk([finish], **stats))
            if self.options.include_usage:
                chunks.append(self._chunk([], usage=usage(response), metrics=speculation_metrics(response.stats)))
        return chunks

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role."""
        if not self.endpoint.chat:
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def _chunk(self, choices: list[dict], **extra) -> dict:
        if self.options.include_usage:
            extra.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
        return self._object(self.endpoint.chunk_object, choices, **extra)


def event(payload: dict | str) -> str:
    """One Server-Sent Event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """Server-Sent Events whose source is closed however the response ends: when the client leaves, closing it
    cancels the request at the verifier, which frees its KV."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def stream_events(answer: Answer, first: gateway_pb2.GenerateResponse,
                        replies: AsyncIterator[gateway_pb2.GenerateResponse]) -> AsyncIterator[str]:
    """A stream's events; a failure once it is under way (its status already sent) becomes an error event.
    `replies` is read to its end, past the final response, so that the request ends as complete."""
    async with contextlib.aclosing(replies):
        opening = answer.first_chunk()
        if opening is not None:
            yield event(opening)
        for chunk in answer.chunks(first):
            yield event(chunk)
        try:
            async for response in replies:
                for chunk in answer.chunks(response):
                    yield event(chunk)
        except RequestFailed as failure:
            yield event(ApiError.of(failure).body())
        yield event("[DONE]")


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone (the request's body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientLeft(Exception):
    """The client disconnected before its answer."""


async def unless_client_leaves(request: Request, work):
    """The result of the awaitable `work`, which is cancelled, raising ClientLeft, if the client disconnects
    first: a request that lost its client stops at the verifier too."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientLeft()
    return task.result()


async def collect(answer: Answer, first: gateway_pb2.GenerateResponse,
                  replies: AsyncIterator[gateway_pb2.GenerateResponse]) -> dict:
    """The whole answer, `replies` read to its end (the last response is the final one)."""
    texts, token_ids, final = [first.text], list(first.token_ids), first
    async for final in replies:
        texts.append(final.text)
        token_ids.extend(final.token_ids)
    return answer.complete("".join(texts), token_ids, final)


# ------------------------------------------------------------------------------------------- the application


class OpenAIApi:
    """The routes, over one gateway servicer."""

    def __init__(self, servicer: GatewayServicer, timeout_s: float = 0.0):
        self.servicer, self.timeout_s = servicer, timeout_s
        self.started = int(time.time())
        self.stopping = False

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, COMPLETIONS)

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        generate_request, options = translate(await read_json(request), endpoint)
        model = (await self.servicer.model_info()).model
        if options.model is not None and options.model != model:
            raise ApiError(404, f"the model {options.model!r} is not served here; this gateway serves {model!r}",
                           param="model", code="model_not_found")
        replies = self.servicer.generate(generate_request, self.timeout_s or None, request.headers)
        answer = Answer(endpoint, model, options)
        try:  # everything that can refuse the request happens before its first response: a status of its own
            first = await unless_client_leaves(request, anext(replies))
            if options.stream:
                return EventStream(stream_events(answer, first, replies))
            return JSONResponse(await unless_client_leaves(request, collect(answer, first, replies)))
        except ClientLeft:
            return Response(status_code=CLIENT_LEFT)  # sent to no one: counted
        finally:
            if not options.stream:
                await replies.aclose()

    async def models(self, request: Request) -> Response:
        info = await self.servicer.model_info()
        return JSONResponse({"object": "list", "data": [{
            "id": info.model, "object": "model", "created": self.started, "owned_by": "treeserve",
            "max_model_len": info.max_context}]})

    async def health(self, request: Request) -> Response:
        serving = self.servicer.serving and not self.stopping
        verifiers = [{"address": v.address, "serving": v.serving} for v in self.servicer.verifiers]
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING", "verifiers": verifiers},
                            status_code=200 if serving else 503)


def build_app(api: OpenAIApi):
    """The ASGI application: the routes, OpenAI's error JSON for every error, and the requests counted."""
    routes = [Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/health", api.health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, RequestFailed: request_failed,
                                                       HTTPException: http_error, Exception: internal_error})
    return CountedRequests(app, api.servicer.metrics.http_requests)


# Async handlers: Starlette runs plain functions in a thread pool.
async def api_error(request: Request, error: ApiError) -> Response:
    return error.response()


async def request_failed(request: Request, failure: RequestFailed) -> Response:
    return ApiError.of(failure).response()


async def http_error(request: Request, error: HTTPException) -> Response:  # unknown routes, wrong methods
    return ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").response()


async def internal_error(request: Request, error: Exception) -> Response:
    # The traceback goes to the gateway's log (uvicorn logs the exception), never to the client.
    return ApiError(500, "internal error; the gateway's log says more", code="internal").response()


class CountedRequests:
    """ASGI middleware: counts every HTTP request by route (its path, or "other") and the status answered."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # what a response that never started counts as

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.counter.labels(route=route, status=str(status[0])).inc()


# ------------------------------------------------------------------------------------------- the listener


def bind(address: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT; raises TreeserveError when it cannot be bound. Bound before the
    gateway starts anything, so that a taken port stops it with one line."""
    host, port = split_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise TreeserveError(f"cannot serve HTTP on {address}: {error.strerror or error}") from None


def address_of(sock: socket.socket) -> str:
    """HOST:PORT where the socket listens (a port 0 it was bound on resolved)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url(sock: socket.socket) -> str:
    return f"http://{address_of(sock)}"


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway's loop handles SIGTERM and SIGINT and stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpListener:
    """The API served on an already bound socket by uvicorn, as a task of the running event loop."""

    def __init__(self, servicer: GatewayServicer, sock: socket.socket, timeout_s: float = 0.0, grace_s: float = 10.0):
        self.api = OpenAIApi(servicer, timeout_s)
        self.sock, self.url = sock, url(sock)
        config = uvicorn.Config(build_app(self.api), http="h11", ws="none", lifespan="off", log_config=None, access_log=False,
                                server_header=False, timeout_graceful_shutdown=grace_s)
        self.server = EmbeddedServer(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.01)
        if self.task.done():
            self.task.result()  # what stopped it
            raise TreeserveError(f"the HTTP server on {self.url} stopped as it started")
        log.info("OpenAI-compatible HTTP API on %s", self.url)

    async def stop(self) -> None:
        """Stops accepting at once; requests under way get the grace period to finish."""
        self.api.stopping = True
        if self.task is not None:
            self.server.should_exit = True
            await self.task
        self.sock.close()
