"""Fake verifiers (in-process gRPC servers on Unix sockets that stream scripted token ids) and a gateway in front
of them, its gRPC and, when asked, its HTTP door: what the gateway's tests and its HTTP API's tests share."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from treeserve.errors import RequestFailed, TreeserveError
from treeserve.gateway.server import GatewayServicer, serve
from treeserve.v1 import gateway_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc

TEXT = "Hello 日本語 🙂 world"  # multi-byte characters that SmolLM2 splits over several tokens
MAX_CONTEXT = 64


def smollm2_tokenizer():
    """SmolLM2's real tokenizer; the test is skipped where its package is missing."""
    from treeserve.loading import load_tokenizer

    try:
        return load_tokenizer("smollm2-135m")
    except TreeserveError as error:
        pytest.skip(str(error))


def steps_of(tok) -> list[list[int]]:
    """TEXT's tokens two per step, then EOS."""
    ids = tok.encode(TEXT)
    return [ids[i:i + 2] for i in range(0, len(ids), 2)] + [[min(tok.eos_ids)]]


class FakeVerifier(verifier_pb2_grpc.VerifierServiceServicer):
    """Streams `steps` (the last one with the final message), optionally waiting for `gate` before the last,
    or aborts with `error`, on the Session stream the gateway keeps. Records the requests and whether one was
    cancelled."""

    def __init__(self, steps, gated=False, error=None, interval_s=0.0, max_context=MAX_CONTEXT, session_socket=""):
        self.steps, self.error, self.interval_s, self.max_context = steps, error, interval_s, max_context
        self.session_socket = session_socket  # what GetInfo names (the fake itself serves Session over gRPC only)
        self.gate = asyncio.Event() if gated else None
        self.requests = []
        self.cancelled = asyncio.Event()

    async def GetInfo(self, request, context):
        return verifier_pb2.VerifierServiceGetInfoResponse(model="fake-smollm2", vocab_size=49152,
                                                           max_context=self.max_context, eos_token_ids=[2], max_budget=32,
                                                           default_budget=16, session_socket=self.session_socket)

    async def Session(self, request_iterator, context):
        """Each started request runs `replies` on its own; one message an update."""
        outgoing, running = asyncio.Queue(), {}

        async def run(request):
            name = request.request_id
            try:
                async for message in self.replies(request):
                    outgoing.put_nowait(verifier_pb2.VerifierServiceSessionResponse(
                        updates=[verifier_pb2.SessionUpdate(request_id=name, response=message)]))
            except RequestFailed as refused:
                outgoing.put_nowait(verifier_pb2.VerifierServiceSessionResponse(updates=[verifier_pb2.SessionUpdate(
                    request_id=name, error_code=refused.code.value[0], error_message=refused.message)]))

        async def read():
            async for message in request_iterator:
                if message.HasField("start"):
                    running[message.start.request.request_id] = asyncio.ensure_future(run(message.start.request))
                elif message.cancel in running:
                    running.pop(message.cancel).cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await outgoing.get()
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def replies(self, request):
        self.requests.append(request)
        if self.error:
            raise RequestFailed(*self.error)
        try:
            for step in self.steps[:-1]:
                yield verifier_pb2.VerifierServiceGenerateResponse(token_ids=step)
                if self.interval_s:
                    await asyncio.sleep(self.interval_s)
            if self.gate is not None:
                await self.gate.wait()
            n = sum(map(len, self.steps))
            yield verifier_pb2.VerifierServiceGenerateResponse(
                token_ids=self.steps[-1], finish_reason=generation_pb2.FINISH_REASON_STOP,
                usage=generation_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n),
                stats=generation_pb2.SpeculationStats(rounds=len(self.steps) - 1, round_tokens=n - 2,
                                                      mean_accepted=(n - 2) / (len(self.steps) - 1)),
                seed=request.sampling.seed if request.sampling.HasField("seed") else 1234)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@dataclasses.dataclass
class Harness:
    stub: gateway_pb2_grpc.GatewayServiceStub
    servicer: GatewayServicer
    address: str
    channel: grpc.aio.Channel
    servers: list
    ready: asyncio.Task
    http_url: str | None = None  # the HTTP API's base URL, when running(http=True)


async def start_fake(fake, address: str) -> grpc.aio.Server:
    """A fake verifier at `address`, its health SERVING as a real verifier's is once loaded."""
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(address)
    await server.start()
    return server


@contextlib.asynccontextmanager
async def running(tmp_path, tok, fakes, down=0, http=False, http_timeout_s=0.0, **kwargs):
    """The gateway in front of `fakes` plus `down` addresses where nothing listens; with `http`, its HTTP API
    too, on a free loopback port."""
    addresses = [f"unix://{tmp_path}/v{i}.sock" for i in range(len(fakes))]
    servers = [await start_fake(fake, address) for fake, address in zip(fakes, addresses)]
    addresses += [f"unix://{tmp_path}/down{i}.sock" for i in range(down)]
    servicer = GatewayServicer(tok, addresses, **kwargs)
    service, ready = await serve(f"unix://{tmp_path}/g.sock", servicer)
    listener = None
    if http:
        from treeserve.gateway.openai_api import HttpListener, bind

        listener = HttpListener(servicer, bind("127.0.0.1:0"), http_timeout_s, grace_s=1.0)
        await listener.start()
    channel = grpc.aio.insecure_channel(service.address)
    try:
        yield Harness(gateway_pb2_grpc.GatewayServiceStub(channel), servicer, service.address, channel, servers, ready,
                      listener.url if listener else None)
    finally:
        ready.cancel()
        await channel.close()
        if listener is not None:
            await listener.stop()
        await service.stop(0)
        await servicer.close()
        for server in servers:
            await server.stop(0)
