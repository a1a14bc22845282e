"""The three services as real processes on Unix sockets, on a tiny model: lossless streams, cancellation, bad
requests, health, and draining on SIGTERM. (Services that die, clients that vanish and oversize prompts:
tests/test_faults.py.)"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from helpers import NOT_SERVING, PROMPTS, SERVING, Services, expected, health, request, run_all, scrape, wait_for
from treeserve.serving import client_options
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow

GRACE_S = 30  # the gateway's and the verifier's drain period


@pytest.fixture(scope="module")
def services(tmp_path_factory, model_path):
    services = Services(tmp_path_factory.mktemp("run"), model_path)
    yield services
    services.stack.stop(grace_s=1)


def test_gateway_health_goes_from_not_serving_to_serving(services):
    # The gateway first, with no verifier yet: it listens, but reports NOT_SERVING until a verifier answers.
    # A grace period far longer than any stream here: the drain test tells a stop at a stream's end from one at
    # the grace period's, however slowly a loaded machine streams.
    gateway = services.start_gateway(f"unix://{services.stack.runtime}/verifier.sock", "--grace-s", str(GRACE_S))
    assert wait_for(lambda: health(gateway), what="the gateway to listen") == NOT_SERVING
    services.start_drafter()
    verifier = services.start_verifier("--grace-s", str(GRACE_S))
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
            # Plain decoding: one token a round, so that the request is still running when its KV is read (with
            # trees, a tiny target's 200 tokens can be done before the scrape).
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(PROMPTS[0], 200, disabled=True))
            await call.read()
            held = scrape(services.verifier_metrics)[("treeserve_verifier_kv_slots", ())]
            call.cancel()
            return held

    cancelled, finished = (("treeserve_verifier_requests_total", (("outcome", outcome),)) for outcome in
                           ("cancelled", "length"))
    # On a loaded machine the tiny target's 200 tokens can all be made before the cancel arrives (the request then
    # ends by its length, and frees its KV that way): such a try says nothing, and the scenario runs again.
    for _ in range(5):
        before = scrape(services.verifier_metrics)
        held = asyncio.run(cancel_after_first_message())
        after = wait_for(lambda: (m := scrape(services.verifier_metrics))[("treeserve_verifier_kv_slots", ())] == 0
                         and m, timeout_s=10, what="the verifier to free the cancelled request's KV")
        if after.get(finished, 0) == before.get(finished, 0):
            break
    assert held > 0 and after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert after[("treeserve_verifier_running_requests", ())] == 0


def test_the_drafter_frees_a_request_context_when_the_request_ends(services, target):
    trees_before = scrape(services.drafter_metrics).get(("treeserve_drafter_trees_total", ()), 0)
    tokens, _ = run_all(services.gateway, [request(PROMPTS[0], 40)])[0]
    assert tokens == expected(target, PROMPTS[0], 40)
    # No round follows the last request's end: the verifier sends its drop on its own.
    after = wait_for(lambda: (m := scrape(services.drafter_metrics))[("treeserve_drafter_contexts", ())] == 0 and m,
                     timeout_s=5, what="the drafter to free the finished request's context")
    assert after[("treeserve_drafter_trees_total", ())] > trees_before  # the request was drafted


async def drain_during_a_stream(process, address: str, stream) -> tuple[list[int], object, int, float]:
    """Read a stream's first message, SIGTERM `process`, check its health at `address` leaves SERVING, then read
    the stream to its end. Returns (tokens, final message, messages after the SIGTERM, when the stream ended)."""
    tokens = list((await stream.read()).token_ids)
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: health(address) != SERVING, timeout_s=5, what="health to leave SERVING")
    after_sigterm, final = 0, None
    while (reply := await stream.read()) is not grpc.aio.EOF:
        tokens.extend(reply.token_ids)
        after_sigterm += 1
        final = reply
    return tokens, final, after_sigterm, time.monotonic()


def test_sigterm_drains_in_flight_streams(services, target):
    """Runs last: it stops the module's gateway, then its verifier, each in the middle of a stream."""
    prompt, plain = PROMPTS[2], {"disabled": True}  # plain decoding: many rounds, so the stream outlives the signal
    want = expected(target, prompt, 200)

    async def stream_and_stop(name, address, stub_class, message):
        async with grpc.aio.insecure_channel(address, options=client_options()) as channel:
            return await drain_during_a_stream(services.process(name), address,
                                               stub_class(channel).Generate(message))

    verifier_request = verifier_pb2.VerifierServiceGenerateRequest(
        prompt_token_ids=target.tokenizer.encode(prompt), speculation=generation_pb2.SpeculationParams(**plain),
        stop=generation_pb2.StopConditions(max_new_tokens=200, ignore_eos=True))
    for name, address, stub_class, message in [
            ("gateway", services.gateway, gateway_pb2_grpc.GatewayServiceStub, request(prompt, 200, **plain)),
            ("verifier", services.verifier, verifier_pb2_grpc.VerifierServiceStub, verifier_request)]:
        tokens, final, after_sigterm, ended = asyncio.run(stream_and_stop(name, address, stub_class, message))
        assert after_sigterm > 1, f"the {name}'s stream was still running when SIGTERM came"
        assert tokens == want and final.finish_reason == generation_pb2.FINISH_REASON_LENGTH, name
        assert services.process(name).wait(timeout=GRACE_S) == 0, name
        stopped_after_s = time.monotonic() - ended
        assert stopped_after_s < GRACE_S / 3, f"the {name} stopped at the grace period, not once its stream ended"


def test_a_busy_loop_polls_until_the_service_stops(tmp_path):
    """ready(busy_loop=True) keeps the loop's thread running between events (CPU time keeps pace with the wall
    clock while it waits), and stopping the service ends that; without it a waiting loop sleeps."""
    from treeserve import serving

    async def main() -> tuple[float, float, float]:
        service = await serving.start(f"unix://{tmp_path}/busy.sock", lambda server: [])
        await service.ready(busy_loop=True)
        busy = await cpu_share_while_waiting()
        await service.stop(0)
        after = await cpu_share_while_waiting()
        quiet = await serving.start(f"unix://{tmp_path}/quiet.sock", lambda server: [])
        await quiet.ready()
        sleeping = await cpu_share_while_waiting()
        await quiet.stop(0)
        return busy, after, sleeping

    busy, after, sleeping = asyncio.run(main())
    assert busy > 0.5, busy
    assert after < 0.2 and sleeping < 0.2, (after, sleeping)


def test_a_busy_loop_sleeps_when_idle_and_polls_again_on_work():
    """Past its polling time, with no other work on the loop, the poll gives its core back; work brings it back."""
    from treeserve import serving

    def work(seconds: float = 0.005) -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    async def main() -> tuple[float, float, float]:
        stop = serving.keep_loop_busy(poll_s=0.3)
        polling = await cpu_share_while_waiting(0.2)
        await asyncio.sleep(0.2)
        idle = await cpu_share_while_waiting()
        asyncio.get_running_loop().call_soon(work)
        await asyncio.sleep(2 * serving.CHECK_S)  # the poll's next check finds that work
        woken = await cpu_share_while_waiting(0.2)
        await stop(0)
        return polling, idle, woken

    polling, idle, woken = asyncio.run(main())
    assert polling > 0.5 and woken > 0.5, (polling, woken)
    assert idle < 0.2, idle


async def cpu_share_while_waiting(seconds: float = 0.3) -> float:
    """The loop thread's CPU time over the wall time of an asyncio sleep of `seconds`."""
    wall, cpu = time.perf_counter(), time.thread_time()
    await asyncio.sleep(seconds)
    return (time.thread_time() - cpu) / (time.perf_counter() - wall)
