"""The three services as real processes on Unix sockets, on a tiny model: lossless streams, cancellation,
a drafter that dies and comes back, bad requests, health, and draining on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import tiny_models
from treeserve.cli.launcher import Stack
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.serving import free_port
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.verifier import generate

pytestmark = pytest.mark.slow

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "one two three one two three one two three", "def f(x):\n    return x * 2\n",
           "for i in range(10):\n\tprint(i)\n", "a b a b a b a b", "if (a != b) { return -1; }",
           "hello hello hello world", "x = [1, 2, 3, 1, 2, 3]"]


def health(address: str) -> int | None:
    """The health status, or None while nothing listens there."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
        except grpc.RpcError:
            return None


def wait_for(condition, timeout_s: float = 60.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while (value := condition()) is None or value is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def request(prompt: str, max_new_tokens: int, **speculation) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, stop=generation_pb2.StopConditions(
        max_new_tokens=max_new_tokens, ignore_eos=True), speculation=generation_pb2.SpeculationParams(**speculation))


async def collect(address: str, message) -> tuple[list[int], gateway_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        tokens, final = [], None
        async for reply in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(message):
            tokens.extend(reply.token_ids)
            final = reply
        return tokens, final


def run_all(address: str, messages) -> list[tuple[list[int], gateway_pb2.GenerateResponse]]:
    async def main():
        return await asyncio.gather(*(collect(address, m) for m in messages))
    return asyncio.run(main())


class Services:
    def __init__(self, runtime, target_path):
        self.stack = Stack(runtime)
        self.target_path = target_path
        self.verifier_metrics = free_port()

    def start_drafter(self) -> str:
        self.drafter = self.stack.start("drafter", ["--kind", "ngram", "--grace-s", "1"])
        wait_for(lambda: health(self.drafter) == SERVING, what="the drafter")
        return self.drafter

    def start_verifier(self, *extra: str) -> str:
        self.verifier = self.stack.start("verifier", [
            "--target", self.target_path, "--drafter", self.drafter, "--default-budget", "8",
            "--draft-timeout-s", "1", "--metrics-listen", f"127.0.0.1:{self.verifier_metrics}", *extra])
        return self.verifier

    def start_gateway(self, verifier: str) -> str:
        self.gateway = self.stack.start("gateway", ["--target", self.target_path, "--verifier", verifier])
        return self.gateway

    def process(self, name: str):
        return self.stack.children[name][0]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(tiny_models.write_hf_folder("qwen3", tmp_path_factory.mktemp("model"), seed=0))


@pytest.fixture(scope="module")
def target(model_path):
    return load_target(model_path)


@pytest.fixture(scope="module")
def services(tmp_path_factory, model_path):
    services = Services(tmp_path_factory.mktemp("run"), model_path)
    yield services
    services.stack.stop(grace_s=1)


def expected(target, prompt: str, max_new_tokens: int) -> list[int]:
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return generate(target.model, target.tokenizer, target.tokenizer.encode(prompt), params).token_ids


def test_gateway_health_goes_from_not_serving_to_serving(services):
    # The gateway first, with no verifier yet: it listens, but reports NOT_SERVING until a verifier answers.
    gateway = services.start_gateway(f"unix://{services.stack.runtime}/verifier.sock")
    assert wait_for(lambda: health(gateway), what="the gateway to listen") == NOT_SERVING
    services.start_drafter()
    verifier = services.start_verifier()
    wait_for(lambda: health(verifier) == SERVING, what="the verifier")
    wait_for(lambda: health(gateway) == SERVING, what="the gateway to see the verifier")


@pytest.mark.parametrize("concurrency", [1, 8])
def test_streams_are_lossless(services, target, concurrency):
    prompts = PROMPTS[:concurrency]
    results = run_all(services.gateway, [request(p, 40) for p in prompts])
    for prompt, (tokens, final) in zip(prompts, results):
        assert tokens == expected(target, prompt, 40)
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert max(final.stats.mean_accepted for _, final in results) > 1.2  # the drafter was used


def test_bad_requests_get_invalid_argument(services):
    bad = [gateway_pb2.GenerateRequest(prompt=""),
           gateway_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(temperature=-1)),
           gateway_pb2.GenerateRequest(prompt="x", sampling=generation_pb2.SamplingParams(top_p=1.5)),
           request("x", 10, budget=100000),
           request("x " * 300, 10)]  # longer than the model's context
    for message in bad:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            run_all(services.gateway, [message])
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert raised.value.details()

    async def out_of_vocabulary():
        async with grpc.aio.insecure_channel(services.verifier) as channel:
            call = verifier_pb2_grpc.VerifierServiceStub(channel).Generate(
                verifier_pb2.VerifierServiceGenerateRequest(prompt_token_ids=[1, 10 ** 6]))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call.read()
            return raised.value

    error = asyncio.run(out_of_vocabulary())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab" in error.details()


def test_a_cancelled_stream_frees_its_kv(services):
    async def cancel_after_first_message():
        async with grpc.aio.insecure_channel(services.gateway) as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(PROMPTS[0], 200))
            await call.read()
            held = scrape(services.verifier_metrics)[("treeserve_verifier_kv_slots", ())]
            call.cancel()
            return held

    before = scrape(services.verifier_metrics).get(("treeserve_verifier_requests_total", (("outcome", "cancelled"),)), 0)
    assert asyncio.run(cancel_after_first_message()) > 0
    after = wait_for(lambda: (m := scrape(services.verifier_metrics))[("treeserve_verifier_kv_slots", ())] == 0 and m,
                     timeout_s=10, what="the verifier to free the cancelled request's KV")
    assert after[("treeserve_verifier_requests_total", (("outcome", "cancelled"),))] == before + 1
    assert after[("treeserve_verifier_running_requests", ())] == 0


def test_drafter_killed_mid_stream_then_restarted(services, target):
    prompts = PROMPTS
    long = [request(p, 120) for p in prompts]

    async def kill_during_streams():
        pending = [asyncio.ensure_future(collect(services.gateway, m)) for m in long]
        await asyncio.sleep(0.3)  # every stream is under way
        services.process("drafter").kill()
        return await asyncio.gather(*pending)

    results = asyncio.run(kill_during_streams())
    for prompt, (tokens, final) in zip(prompts, results):
        assert tokens == expected(target, prompt, 120)
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    # With the drafter gone, requests decode plainly: one token per round.
    tokens, final = run_all(services.gateway, [request(PROMPTS[0], 40)])[0]
    assert tokens == expected(target, PROMPTS[0], 40) and final.stats.mean_accepted == 1.0
    # A drafter back on the same address: the verifier reconnects (with backoff) and drafting resumes.
    services.start_drafter()

    def drafting_again():
        tokens, final = run_all(services.gateway, [request(PROMPTS[0], 40)])[0]
        assert tokens == expected(target, PROMPTS[0], 40)
        return final.stats.mean_accepted > 1.2

    wait_for(drafting_again, timeout_s=30, what="drafting to resume")


async def drain_during_a_stream(process, address: str, stream) -> tuple[list[int], object, int, float]:
    """Read a stream's first message, SIGTERM `process`, check its health at `address` leaves SERVING, then read
    the stream to its end. Returns (tokens, final message, messages after the SIGTERM, when it was sent)."""
    tokens = list((await stream.read()).token_ids)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: health(address) != SERVING, timeout_s=5, what="health to leave SERVING")
    after_sigterm, final = 0, None
    while (reply := await stream.read()) is not grpc.aio.EOF:
        tokens.extend(reply.token_ids)
        after_sigterm += 1
        final = reply
    return tokens, final, after_sigterm, sent


def test_sigterm_drains_in_flight_streams(services, target):
    """Runs last: it stops the module's gateway, then its verifier, each in the middle of a stream."""
    prompt, plain = PROMPTS[2], {"disabled": True}  # plain decoding: many rounds, so the stream outlives the signal
    want = expected(target, prompt, 200)

    async def stream_and_stop(name, address, stub_class, message):
        async with grpc.aio.insecure_channel(address) as channel:
            return await drain_during_a_stream(services.process(name), address,
                                               stub_class(channel).Generate(message))

    verifier_request = verifier_pb2.VerifierServiceGenerateRequest(
        prompt_token_ids=target.tokenizer.encode(prompt), speculation=generation_pb2.SpeculationParams(**plain),
        stop=generation_pb2.StopConditions(max_new_tokens=200, ignore_eos=True))
    for name, address, stub_class, message in [
            ("gateway", services.gateway, gateway_pb2_grpc.GatewayServiceStub, request(prompt, 200, **plain)),
            ("verifier", services.verifier, verifier_pb2_grpc.VerifierServiceStub, verifier_request)]:
        tokens, final, after_sigterm, sent = asyncio.run(stream_and_stop(name, address, stub_class, message))
        assert after_sigterm > 1, f"the {name}'s stream was still running when SIGTERM came"
        assert tokens == want and final.finish_reason == generation_pb2.FINISH_REASON_LENGTH, name
        assert services.process(name).wait(timeout=15) == 0, name
        assert time.monotonic() - sent < 8, f"the {name} stopped once its stream ended, not after the grace period"
