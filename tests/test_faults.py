"""Faults without surprises, on the real services (processes on Unix sockets, a tiny model on the CPU): a drafter
killed under `treeserve up` and behind a verifier, a verifier killed and restarted behind its gateway, storms of
clients that vanish mid-stream, oversize prompts beside a live stream. Each case checks the tokens of every request
that completes against plain greedy decoding, the health the services report on the way, and that everything they
held is given back once it is over.

(The same faults against fake peers, in process: tests/test_gateway.py, tests/test_verifier_service.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import grpc
import pytest

from helpers import (NOT_SERVING, PROMPTS, SERVING, HealthWatch, Services, collect, counter, expected, health,
                     request, run_all, scrape, service_pid, start_up, stop_up, wait_for)
from treeserve.serving import free_port
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_path):
    """Drafter, verifier and gateway, shared by the tests below; a test that kills one brings it back."""
    services = Services(tmp_path_factory.mktemp("run"), model_path)
    services.start_drafter()
    services.start_gateway(services.start_verifier())
    wait_for(lambda: health(services.gateway) == SERVING, what="the stack to serve")
    yield services
    services.stack.stop(grace_s=1)


@pytest.fixture
def services(stack):
    """The shared stack, checked to be serving and idle before a test uses it."""
    for address in (stack.drafter, stack.verifier, stack.gateway):
        assert health(address) == SERVING, f"a test before this one left {address} down"
    stack.wait_idle()
    return stack


async def read_all(call, tokens: list[int]) -> tuple[object, grpc.StatusCode | None]:
    """The rest of a stream into `tokens`: (its final message or None, the status it failed with or None)."""
    final = None
    try:
        while (reply := await call.read()) is not grpc.aio.EOF:
            tokens.extend(reply.token_ids)
            final = reply if reply.finish_reason else final
    except grpc.aio.AioRpcError as error:
        return final, error.code()
    return final, None


# -------------------------------------------------------------------------------------------- the drafter


def test_drafter_killed_under_up_mid_stream(tmp_path, model_path, target):
    """`treeserve up`'s drafter SIGKILLed during a stream: the stream and every later request are exact, the
    gateway's socket and health never falter, `up` restarts the drafter and requests are drafted again."""
    runtime = tmp_path / "run"
    drafter_metrics = free_port()
    up, address = start_up(model_path, "--drafter", "ngram", "--speculation", "fixed", "--runtime-dir", str(runtime),
                           "--drafter-metrics-listen", f"127.0.0.1:{drafter_metrics}")
    prompt = PROMPTS[0]
    watch = HealthWatch(address)
    try:
        drafter = service_pid("drafter", runtime)
        assert drafter is not None

        async def kill_mid_stream():
            async with grpc.aio.insecure_channel(address) as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(prompt, 150))
                tokens = list((await call.read()).token_ids)
                os.kill(drafter, signal.SIGKILL)
                before_kill = len(tokens)
                final, failed = await read_all(call, tokens)
                return tokens, before_kill, final, failed

        tokens, before_kill, final, failed = asyncio.run(kill_mid_stream())
        assert failed is None and tokens == expected(target, prompt, 150)
        assert before_kill < 100, "the stream had nearly ended when the drafter was killed"

        def drafting_again():
            # Every request meanwhile is exact, drafted or not; the new drafter's own metrics say it drafted.
            tokens, final = run_all(address, [request(prompt, 40)])[0]
            assert tokens == expected(target, prompt, 40)
            if final.stats.drafted_tokens == 0 or service_pid("drafter", runtime) in (drafter, None):
                return False
            return counter(scrape(drafter_metrics), "treeserve_drafter_trees") > 0

        wait_for(drafting_again, timeout_s=30, what="requests drafted by the restarted drafter")
        assert up.poll() is None
    finally:
        watch.stop()
        code, errors = stop_up(up)
    assert watch.checks > 10 and not watch.lapses, watch.lapses
    assert code == 0, errors
    assert "the drafter exited (code -9); restarting it in 0.5 s" in errors
    assert "restarted the drafter (restart 1)" in errors and "the drafter is serving again" in errors
    assert "restarts: drafter 1" in errors


def test_drafter_killed_behind_the_verifier(services, target):
    """Eight streams while the drafter is SIGKILLed (no `up` to restart it): all exact; requests decode plainly
    until a drafter is back on the address, then the verifier reconnects and drafting resumes."""
    long = [request(p, 120) for p in PROMPTS]

    async def kill_during_streams():
        async with grpc.aio.insecure_channel(services.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            calls = [stub.Generate(message) for message in long]
            streams = [list((await call.read()).token_ids) for call in calls]  # every stream is under way
            services.process("drafter").kill()
            endings = await asyncio.gather(*(read_all(call, tokens) for call, tokens in zip(calls, streams)))
            return streams, endings

    streams, endings = asyncio.run(kill_during_streams())
    for prompt, tokens, (final, failed) in zip(PROMPTS, streams, endings):
        assert failed is None and tokens == expected(target, prompt, 120)
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    # With the drafter gone, requests decode plainly: one token per round, and health stays SERVING.
    tokens, final = run_all(services.gateway, [request(PROMPTS[0], 40)])[0]
    assert tokens == expected(target, PROMPTS[0], 40) and final.stats.mean_accepted == 1.0
    assert health(services.verifier) == SERVING and health(services.gateway) == SERVING
    services.start_drafter()

    def drafting_again():
        tokens, final = run_all(services.gateway, [request(PROMPTS[0], 40)])[0]
        assert tokens == expected(target, PROMPTS[0], 40)
        return final.stats.drafted_tokens > 0

    wait_for(drafting_again, timeout_s=30, what="drafting to resume")
    services.wait_idle()


# ------------------------------------------------------------------------------------------- the verifier


def test_verifier_killed_and_restarted_behind_the_gateway(services, target):
    """The only verifier SIGKILLed mid-stream: that stream fails UNAVAILABLE after an exact prefix, the drafter
    frees the dead verifier's contexts, the gateway turns NOT_SERVING and refuses requests with UNAVAILABLE;
    a verifier restarted on the address turns it SERVING again, and later requests are exact and drafted."""
    prompt, plain = PROMPTS[2], {"disabled": True}  # plain decoding: many rounds, so the stream outlives the kill

    async def killed_mid_stream():
        async with grpc.aio.insecure_channel(services.gateway) as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(prompt, 200, **plain))
            tokens = list((await call.read()).token_ids)
            services.process("verifier").kill()
            _, failed = await read_all(call, tokens)
            return tokens, failed

    tokens, failed = asyncio.run(killed_mid_stream())
    assert failed == grpc.StatusCode.UNAVAILABLE
    assert 0 < len(tokens) < 200 and tokens == expected(target, prompt, 200)[:len(tokens)]
    wait_for(lambda: health(services.gateway) == NOT_SERVING, timeout_s=10, what="the gateway to turn NOT_SERVING")
    with pytest.raises(grpc.RpcError) as refused:
        run_all(services.gateway, [request(prompt, 8)])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: scrape(services.drafter_metrics)[("treeserve_drafter_contexts", ())] == 0, timeout_s=10,
             what="the drafter to free the dead verifier's contexts")
    services.start_verifier()
    wait_for(lambda: health(services.gateway) == SERVING, timeout_s=30, what="the gateway to turn SERVING again")
    results = run_all(services.gateway, [request(p, 40) for p in PROMPTS[:4]])
    for p, (tokens, final) in zip(PROMPTS, results):
        assert tokens == expected(target, p, 40)
    assert sum(final.stats.drafted_tokens for _, final in results) > 0  # linked to the drafter again
    services.wait_idle()


# --------------------------------------------------------------------------------------------- the clients

STORM = 24

# A client process that opens streams through the gateway, reads one message of each, says so, and waits to be
# killed: its connection vanishes without a single stream being cancelled.
VANISHING_CLIENT = """
import asyncio, json, sys
import grpc
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2

async def main(address, prompts, count):
    channel = grpc.aio.insecure_channel(address)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    stop = generation_pb2.StopConditions(max_new_tokens=200, ignore_eos=True)
    calls = [stub.Generate(gateway_pb2.GenerateRequest(prompt=prompts[i % len(prompts)], stop=stop))
             for i in range(count)]
    for call in calls:
        await call.read()
    print("open", flush=True)
    await asyncio.sleep(600)

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
"""


@pytest.mark.parametrize("how", ["cancelled", "client-killed"])
def test_a_disconnect_storm_leaves_nothing_behind(services, target, how):
    """STORM streams end by their clients mid-stream (each cancelled after 0, 1 or 2 messages, or all at once by
    SIGKILLing the client process that holds them) while one stream runs beside them: that stream is exact, every
    stream that had reached the verifier is counted cancelled there, and no KV slot, running request, drafter
    context or gateway request is left."""
    before = scrape(services.verifier_metrics)
    survivor_prompt = PROMPTS[5]

    async def storm() -> tuple[list[int], object, int]:
        survivor = asyncio.ensure_future(collect(services.gateway, request(survivor_prompt, 120)))
        if how == "cancelled":
            async with grpc.aio.insecure_channel(services.gateway) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                calls = [stub.Generate(request(PROMPTS[i % len(PROMPTS)], 200)) for i in range(STORM)]
                reached = 0
                for i, call in enumerate(calls):
                    for _ in range(i % 3):
                        await call.read()
                    reached += i % 3 > 0
                for call in calls:
                    call.cancel()
        else:
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", VANISHING_CLIENT, services.gateway, json.dumps(PROMPTS), str(STORM),
                stdout=subprocess.PIPE)
            assert await asyncio.wait_for(client.stdout.readline(), 30) == b"open\n"
            client.kill()
            await client.wait()
            reached = STORM
        tokens, final = await survivor
        return tokens, final, reached

    tokens, final, reached = asyncio.run(storm())
    assert tokens == expected(target, survivor_prompt, 120)
    assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    verifier, drafter, gateway = services.wait_idle()
    cancelled = (counter(verifier, "treeserve_verifier_requests", outcome="cancelled")
                 - counter(before, "treeserve_verifier_requests", outcome="cancelled"))
    assert reached <= cancelled <= STORM
    assert drafter[("treeserve_drafter_streams", ())] == 1  # the verifier's own stream, nothing else
    # The stack serves on as before.
    assert run_all(services.gateway, [request(PROMPTS[1], 30)])[0][0] == expected(target, PROMPTS[1], 30)


async def largest_gap(call, tokens: list[int], on_first=None) -> float:
    """Reads a stream into `tokens`; returns its largest gap between messages, in seconds. `on_first` is awaited
    (as a task) once the first message is in."""
    loop = asyncio.get_running_loop()
    gaps, last, beside = [], None, None
    async for reply in call:
        tokens.extend(reply.token_ids)
        now = loop.time()
        if last is None and on_first is not None:
            beside = asyncio.ensure_future(on_first())
        elif last is not None:
            gaps.append(now - last)
        last = now
    if beside is not None:
        await beside
    return max(gaps)


def test_oversize_prompts_beside_a_live_stream(services, target):
    """Four 1M-character prompts while a stream runs: each is refused with INVALID_ARGUMENT, and the stream is
    exact with its largest gap near what it is alone (the gateway tokenizing them on its event loop stalled every
    stream by a large fraction of a second per prompt)."""
    prompt, plain = PROMPTS[3], {"disabled": True}  # plain decoding: a steady message per round
    large = gateway_pb2.GenerateRequest(prompt="word " * 200_000, stop=generation_pb2.StopConditions(max_new_tokens=1))
    refused = []

    async def main():
        async with grpc.aio.insecure_channel(services.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)

            async def oversize():
                async def one():
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await stub.Generate(large).read()
                    refused.append((error.value.code(), error.value.details()))
                await asyncio.gather(*(one() for _ in range(4)))

            alone, beside = [], []
            unloaded = await largest_gap(stub.Generate(request(prompt, 150, **plain)), alone)
            loaded = await largest_gap(stub.Generate(request(prompt, 150, **plain)), beside, on_first=oversize)
            return alone, beside, unloaded, loaded

    alone, beside, unloaded, loaded = asyncio.run(main())
    assert alone == beside == expected(target, prompt, 150)
    assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 4, refused
    assert all("context" in details for _, details in refused), refused
    assert loaded < max(2 * unloaded, unloaded + 0.2), f"largest gap {loaded:.3f} s beside them, {unloaded:.3f} s alone"
    services.wait_idle()
