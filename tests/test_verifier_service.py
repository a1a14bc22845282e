"""The verifier service over gRPC with a real drafter service: concurrent requests batched together give the
target's own output, with or without a working drafter, and cancellation frees what a request held."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from random_targets import random_target, word_tokenizer
from treeserve import framing, serving
from treeserve.drafter import NgramDrafter
from treeserve.drafter import server as drafter_server
from treeserve.drafter.server import DrafterServicer
from treeserve.framing import FramedCall
from treeserve.loading import LoadedModel
from treeserve.params import GenerationParams
from treeserve.v1 import generation_pb2, verifier_pb2, verifier_pb2_grpc
from treeserve.verifier import generate
from treeserve.verifier.drafter_link import DrafterLink
from treeserve.verifier.graphs import build_verifier
from treeserve.verifier import round as verifier_round
from treeserve.verifier.adaptive import AdaptiveSpeculation
from treeserve.verifier import server as verifier_server
from treeserve.verifier.server import VerifierServicer

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return LoadedModel("tiny", random_target("llama", seed=7, vocab_size=VOCAB, weight_scale=2.0), word_tokenizer(VOCAB))


async def start_verifier(tmp_path, target, drafter_addresses, timeout_s=1.0, max_batch=8, kv_cache_tokens=0):
    links = [DrafterLink(address, timeout_s) for address in drafter_addresses]
    servicer = VerifierServicer("tiny", links, default_budget=8, default_max_new_tokens=16, max_batch=max_batch)
    service = await verifier_server.start(f"unix://{tmp_path}/verifier.sock", servicer)
    scheduler = servicer.attach(target, build_verifier(target.model, max_batch, False, kv_cache_tokens, block_size=4))
    task = asyncio.ensure_future(scheduler.run())
    for link in links:
        await scheduler.connect(link)
    return service, scheduler, task


async def start_drafter(tmp_path, name="drafter"):
    """On a Unix socket, as `treeserve up` runs it: the verifier's link takes the Draft stream as frames."""
    return await drafter_server.start(f"unix://{tmp_path}/{name}.sock", DrafterServicer(NgramDrafter()))


def request(prompt, max_new_tokens=24, **speculation):
    return verifier_pb2.VerifierServiceGenerateRequest(
        prompt_token_ids=prompt, stop=generation_pb2.StopConditions(max_new_tokens=max_new_tokens),
        speculation=generation_pb2.SpeculationParams(**speculation))


async def collect(stub, message):
    tokens, final = [], None
    async for reply in stub.Generate(message):
        tokens.extend(reply.token_ids)
        final = reply
    return tokens, final


def repetitive_prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))] * 3 for _ in range(count)]


def expected(target, prompt, max_new_tokens=24):
    return generate(target.model, target.tokenizer, prompt, GenerationParams(max_new_tokens=max_new_tokens)).token_ids


def test_concurrent_requests_with_a_drafter_give_the_target_output(tmp_path, target):
    prompts = repetitive_prompts(6, seed=1)

    async def main():
        drafter = await start_drafter(tmp_path)
        service, scheduler, task = await start_verifier(tmp_path, target, [drafter.address])
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            results = await asyncio.gather(*(collect(stub, request(p)) for p in prompts))
            info = await stub.GetInfo(verifier_pb2.VerifierServiceGetInfoRequest())
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return results, info, scheduler

    results, info, scheduler = asyncio.run(main())
    for prompt, (tokens, final) in zip(prompts, results):
        assert tokens == expected(target, prompt)
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 24
    assert max(final.stats.mean_accepted for _, final in results) > 1.5  # the repetition was found
    assert info.vocab_size == VOCAB and info.drafters
    assert not scheduler.running and not scheduler.waiting


def test_a_drafter_that_is_down_or_dies_costs_speed_not_tokens(tmp_path, target):
    prompts = repetitive_prompts(3, seed=2)

    async def main():
        drafter = await start_drafter(tmp_path, "alive")
        # The first address never answers; the second dies half way through.
        service, scheduler, task = await start_verifier(
            tmp_path, target, [f"unix://{tmp_path}/nobody.sock", drafter.address], timeout_s=0.5)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            pending = [asyncio.ensure_future(collect(stub, request(p, max_new_tokens=40))) for p in prompts]
            await asyncio.sleep(0.05)
            await drafter.stop(0)
            results = await asyncio.gather(*pending)
        task.cancel()
        await service.stop(0)
        return results

    for prompt, (tokens, _) in zip(prompts, asyncio.run(main())):
        assert tokens == expected(target, prompt, 40)


def test_the_forwards_run_on_the_thread_that_loaded_the_target(tmp_path, target, monkeypatch):
    """On the CPU the forwards block, and run on the service's one compute thread (the one that loaded the target):
    a forward on a second thread starts a second OpenMP team, after which every round took 2.6x as long on the
    2-core CPU machine (docs/benchmarks.md)."""
    threads = []

    def forward_batch(*args):
        threads.append(threading.current_thread().name)
        return original(*args)
    original = verifier_round.forward_batch
    monkeypatch.setattr(verifier_round, "forward_batch", forward_batch)
    compute = ThreadPoolExecutor(1, "loaded-the-target")
    prompt = repetitive_prompts(1, seed=5)[0]

    async def main():
        drafter = await start_drafter(tmp_path)
        servicer = VerifierServicer("tiny", [DrafterLink(drafter.address, 1.0)], default_budget=8,
                                    default_max_new_tokens=16, max_batch=4)
        service = await serving.start(f"unix://{tmp_path}/verifier.sock", servicer.register)
        scheduler = servicer.attach(target, build_verifier(target.model, 4, False, 0, block_size=4),
                                    compute=compute)
        task = asyncio.ensure_future(scheduler.run())
        await scheduler.connect(servicer.links[0])
        async with grpc.aio.insecure_channel(service.address) as channel:
            tokens, _ = await collect(verifier_pb2_grpc.VerifierServiceStub(channel), request(prompt, 20))
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return tokens

    assert asyncio.run(main()) == expected(target, prompt, 20)
    assert len(threads) > 1 and set(threads) == {"loaded-the-target_0"}


def test_cancelling_a_request_frees_it_and_others_finish(tmp_path, target):
    prompts = repetitive_prompts(2, seed=3)

    async def main():
        drafter = await start_drafter(tmp_path)
        service, scheduler, task = await start_verifier(tmp_path, target, [drafter.address])
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            doomed = stub.Generate(request(prompts[0], max_new_tokens=400))
            survivor = asyncio.ensure_future(collect(stub, request(prompts[1], max_new_tokens=30)))
            await doomed.read()  # it is running
            doomed.cancel()
            tokens, _ = await survivor
            for _ in range(100):  # the cancellation reaches the scheduler asynchronously
                if not scheduler.running and not scheduler.waiting:
                    break
                await asyncio.sleep(0.01)
            leftover = len(scheduler.running) + len(scheduler.waiting)
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return tokens, leftover, scheduler.verifier.pool.allocator

    tokens, leftover, allocator = asyncio.run(main())
    assert tokens == expected(target, prompts[1], 30)
    assert leftover == 0
    assert allocator.free_count == allocator.num_blocks  # every KV block came back


def test_a_batch_never_grows_past_max_batch(tmp_path, target):
    """--max-batch is also the largest batch the CUDA graphs are captured for: requests beyond it wait for a place
    rather than make a forward no graph holds (TreeVerifier runs one eagerly; tests/test_graphs_at_scale.py)."""
    prompts = repetitive_prompts(7, seed=9)

    async def main():
        service, scheduler, task = await start_verifier(tmp_path, target, [], max_batch=3)
        batches = []
        forward = scheduler.runner.forward

        async def counting_forward(plans, generations):
            batches.append(len(plans))
            return await forward(plans, generations)

        scheduler.runner.forward = counting_forward
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            results = await asyncio.gather(*(collect(stub, request(p)) for p in prompts))
        task.cancel()
        await service.stop(0)
        return results, batches

    results, batches = asyncio.run(main())
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == expected(target, prompt)
    assert max(batches) == 3


def test_requests_wait_for_kv_room_and_one_too_large_is_refused(tmp_path, target):
    """A pool of 96 tokens holds one request of up to 96 (prompt + 40 new + budget 8) at a time: four
    requests each get the target's output, one after another, and one that could never fit is refused."""
    prompts = repetitive_prompts(4, seed=4)

    async def main():
        drafter = await start_drafter(tmp_path)
        service, scheduler, task = await start_verifier(tmp_path, target, [drafter.address], kv_cache_tokens=96)
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            results = await asyncio.gather(*(collect(stub, request(p, max_new_tokens=40)) for p in prompts))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub, request(prompts[0], max_new_tokens=90))
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return results, refused.value, scheduler.verifier.pool.allocator

    results, refused, allocator = asyncio.run(main())
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == expected(target, prompt, 40)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV cache" in refused.details()
    assert allocator.free_count == allocator.num_blocks


@pytest.mark.parametrize("message, text", [
    (request([], 8), "empty"),
    (request([1, VOCAB + 5], 8), "outside the vocabulary"),
    (verifier_pb2.VerifierServiceGenerateRequest(prompt_token_ids=[1], sampling=generation_pb2.SamplingParams(
        temperature=-1)), "temperature"),
    (request([1], 8, budget=1000), "budget"),
    (request([1], 100_000), "context"),
])
def test_bad_requests_are_invalid_argument(tmp_path, target, message, text):
    async def main():
        service, scheduler, task = await start_verifier(tmp_path, target, [])
        async with grpc.aio.insecure_channel(service.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await collect(verifier_pb2_grpc.VerifierServiceStub(channel), message)
        task.cancel()
        await service.stop(0)
        return error.value

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and text in error.details()


async def until_none(queue: asyncio.Queue):
    """A Session stream's messages, as they are put in `queue`, until None."""
    while (message := await queue.get()) is not None:
        yield message


def start(name, prompt, max_new_tokens=24, **speculation):
    message = request(prompt, max_new_tokens, **speculation)
    message.request_id = name
    return verifier_pb2.VerifierServiceSessionRequest(start=verifier_pb2.SessionStart(request=message))


@contextlib.asynccontextmanager
async def session_call(service, transport, outgoing: asyncio.Queue):
    """A Session stream to the verifier, over gRPC or as frames on the socket its GetInfo names: `outgoing`'s
    messages go out (None: no more); yields (read, cancel), read() giving each message, then grpc.aio.EOF."""
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        if transport == "grpc":
            call = stub.Session(until_none(outgoing))
            yield call.read, call.cancel
            return
        info = await stub.GetInfo(verifier_pb2.VerifierServiceGetInfoRequest())
        assert info.session_socket == service.address[len("unix://"):] + ".session"
        call = await FramedCall.open(info.session_socket, verifier_pb2.VerifierServiceSessionResponse)

        async def send():
            while (message := await outgoing.get()) is not None:
                call.send(message)
        sending = asyncio.ensure_future(send())
        try:
            yield call.read, call.cancel
        finally:
            sending.cancel()
            call.cancel()


@pytest.mark.parametrize("transport", ["grpc", "frames"])
def test_a_session_carries_many_requests_one_message_a_round(tmp_path, target, transport):
    """A gateway's Session stream, over gRPC or as frames on the socket beside the verifier's: each round's tokens
    for all of its requests in one message, every output the target's own; a bad start is refused on its own, a
    cancel frees its request, the stream's end the rest."""
    prompts = repetitive_prompts(4, seed=5)

    async def main():
        drafter = await start_drafter(tmp_path)
        service, scheduler, task = await start_verifier(tmp_path, target, [drafter.address])
        rounds = []
        observe = scheduler._observe
        scheduler._observe = lambda report, *rest: (rounds.append(report.forward_batch), observe(report, *rest))
        outgoing = asyncio.Queue()
        for i, prompt in enumerate(prompts):
            outgoing.put_nowait(start(f"r{i}", prompt))
        outgoing.put_nowait(start("r0", prompts[0]))  # already running on this stream
        outgoing.put_nowait(start("bad", [], 8))
        outgoing.put_nowait(start("doomed", prompts[0], 400))
        outgoing.put_nowait(start("left", prompts[1], 400))
        tokens, finals, errors, messages, in_a_message = {}, {}, {}, 0, []
        async with session_call(service, transport, outgoing) as (read, cancel):
            while (message := await read()) is not grpc.aio.EOF:
                messages += 1
                in_a_message.append(len(message.updates))
                for update in message.updates:
                    if update.error_code:
                        errors.setdefault(update.request_id, []).append(
                            (grpc.StatusCode.INVALID_ARGUMENT.value[0] == update.error_code, update.error_message))
                        continue
                    tokens.setdefault(update.request_id, []).extend(update.response.token_ids)
                    if update.response.finish_reason:
                        finals[update.request_id] = update.response
                if update.request_id == "doomed" and "doomed" in tokens and len(tokens["doomed"]) >= 8:
                    outgoing.put_nowait(verifier_pb2.VerifierServiceSessionRequest(cancel="doomed"))
                if len(finals) == len(prompts):
                    break
            cancel()  # "left" is still running: the stream's end cancels it
            for _ in range(200):
                if not scheduler.running and not scheduler.waiting:
                    break
                await asyncio.sleep(0.01)
            leftover = len(scheduler.running) + len(scheduler.waiting)
        outgoing.put_nowait(None)
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return tokens, finals, errors, in_a_message, rounds, leftover, scheduler.verifier.pool.allocator

    tokens, finals, errors, in_a_message, rounds, leftover, allocator = asyncio.run(main())
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == expected(target, prompt) and finals[f"r{i}"].usage.completion_tokens == 24
    assert errors["r0"] == [(True, "request 'r0' is already running on this stream")]
    assert errors["bad"][0][0] and "empty" in errors["bad"][0][1]
    assert "doomed" not in finals and "left" not in finals
    # Rounds of several requests came as one message each, not one message a request.
    assert max(in_a_message) >= 4 and len(in_a_message) < sum(rounds)
    assert leftover == 0 and allocator.free_count == allocator.num_blocks


@pytest.mark.parametrize("frame, kind, reason", [
    (b"\xff\xff\xff", framing.MESSAGE, "no VerifierServiceSessionRequest"),
    (b"/dev/shm/region", framing.REGION, "a frame of kind 2 where a VerifierServiceSessionRequest was due"),
])
def test_a_bad_session_frame_is_refused_with_its_reason_and_ends_only_its_stream(tmp_path, target, frame, kind,
                                                                                reason):
    prompt = repetitive_prompts(1, seed=13)[0]

    async def main():
        service, scheduler, task = await start_verifier(tmp_path, target, [])
        path = service.address[len("unix://"):] + ".session"
        bad = await FramedCall.open(path, verifier_pb2.VerifierServiceSessionResponse)
        bad.send(start("running", prompt, 400))
        framing.write_frame(bad.writer, frame, kind)
        with pytest.raises(framing.Refused, match=reason):
            while True:  # (the running request's rounds may come first)
                await bad.read()
        for _ in range(200):  # its stream's request ended with it
            if not scheduler.running:
                break
            await asyncio.sleep(0.01)
        left = len(scheduler.running)
        good = await FramedCall.open(path, verifier_pb2.VerifierServiceSessionResponse)
        good.send(start("next", prompt))
        tokens, finished = [], False
        while not finished:
            for update in (await good.read()).updates:
                tokens.extend(update.response.token_ids)
                finished = bool(update.response.finish_reason)
        good.cancel()
        task.cancel()
        await service.stop(0)
        return left, tokens

    left, tokens = asyncio.run(main())
    assert left == 0 and tokens == expected(target, prompt)


def test_a_draining_verifier_finishes_its_requests_and_refuses_new_ones(tmp_path, target):
    """On SIGTERM the server stops taking calls, but a gateway's Session stream stays open through the drain: a
    request started on it then is refused with UNAVAILABLE (the gateway takes it to another verifier), while one
    already running finishes."""
    prompts = repetitive_prompts(2, seed=6)

    async def main():
        servicer = VerifierServicer("tiny", [], default_budget=8, default_max_new_tokens=16, max_batch=4)
        service = await serving.start(f"unix://{tmp_path}/verifier.sock", servicer.register)
        scheduler = servicer.attach(target, build_verifier(target.model, 4, False, 0, block_size=4))
        task = asyncio.ensure_future(scheduler.run())
        outgoing = asyncio.Queue()
        outgoing.put_nowait(start("before", prompts[0], 40))
        updates = {}
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            call = stub.Session(until_none(outgoing))
            async for message in call:
                for update in message.updates:
                    updates.setdefault(update.request_id, []).append(update)
                if "after" not in updates and len(updates["before"]) == 2:  # it is running: drain, then ask again
                    servicer.drain()
                    outgoing.put_nowait(start("after", prompts[1]))
                if "after" in updates and updates["before"][-1].response.finish_reason:
                    break
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub, request(prompts[1]))
            outgoing.put_nowait(None)
        task.cancel()
        await service.stop(0)
        return updates, refused.value

    updates, refused = asyncio.run(main())
    tokens = [t for update in updates["before"] for t in update.response.token_ids]
    assert tokens == expected(target, prompts[0], 40)
    [after] = updates["after"]
    assert after.error_code == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in after.error_message
    assert refused.code() == grpc.StatusCode.UNAVAILABLE


async def start_adaptive_verifier(tmp_path, target, adaptive):
    """A verifier with one n-gram drafter (no target features) and `adaptive` speculation."""
    drafter = await start_drafter(tmp_path)
    links = [DrafterLink(drafter.address, 1.0)]
    servicer = VerifierServicer("tiny", links, default_budget=8, default_max_new_tokens=16, max_batch=8)
    service = await serving.start(f"unix://{tmp_path}/verifier.sock", servicer.register)
    scheduler = servicer.attach(target, build_verifier(target.model, 8, False, 0, block_size=4), adaptive)
    task = asyncio.ensure_future(scheduler.run())
    await scheduler.connect(links[0])
    return drafter, service, scheduler, task


def test_a_lone_request_of_a_drafter_without_features_is_not_given_up(tmp_path, target):
    """The n-gram drafter keeps no target features, so a request that could draft costs nothing more in a plain
    round: the scheduler tells adaptive speculation so, and where drafting has been given up everywhere, requests
    that ask for trees one at a time are still admitted drafting and keep drafting (their rounds' choices, not a
    ban, decide)."""
    prompts = repetitive_prompts(3, seed=4)

    async def main():
        drafter, service, scheduler, task = await start_adaptive_verifier(
            tmp_path, target, AdaptiveSpeculation(give_up_after_s=0.0))
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            results = [await collect(stub, request(prompt)) for prompt in prompts]
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return results, scheduler

    results, scheduler = asyncio.run(main())
    assert scheduler.feature_layer_ids == ()  # what the scheduler tells the policy: no features kept
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == expected(target, prompt)
    # Each was admitted drafting and kept drafting (whether a round drafts is the choice's, round by round).
    registry = scheduler.metrics.registry
    assert registry.get_sample_value("treeserve_verifier_plain_admissions_total") == 0
    assert registry.get_sample_value("treeserve_verifier_drafting_stopped_total") == 0


class AdmitsEveryone(AdaptiveSpeculation):
    """Adaptive speculation that admits every request drafting, wherever it has given drafting up."""

    def admits_drafting(self, batch):
        return True


def test_where_drafting_has_stopped_paying_running_requests_stop_drafting(tmp_path, target):
    """Requests admitted drafting, in a batch where adaptive speculation has given drafting up, decode plainly
    from the next round on, but for the newest one (the batch's canary), and every request streams the target's
    own tokens."""
    prompts = repetitive_prompts(4, seed=5)

    async def main():
        drafter, service, scheduler, task = await start_adaptive_verifier(
            tmp_path, target, AdmitsEveryone(give_up_after_s=0.0))
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            results = await asyncio.gather(*(collect(stub, request(prompt)) for prompt in prompts))
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return results, scheduler

    results, scheduler = asyncio.run(main())
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == expected(target, prompt)
    assert scheduler.metrics.registry.get_sample_value("treeserve_verifier_drafting_stopped_total") == 3


class StallingDrafter(DrafterServicer):
    """Serves GetInfo, then reads Draft messages and never answers them."""

    def __init__(self):
        super().__init__(NgramDrafter())
        self.messages = 0

    async def Draft(self, request_iterator, context):
        async for _ in request_iterator:
            self.messages += 1
            await asyncio.sleep(60)


def test_a_stalled_drafter_does_not_price_the_rounds_verification(tmp_path, target):
    """A drafter that stops answering holds its round up until the link's timeout; adaptive speculation learns the
    round's verification from what the round spent besides that wait, and the request gets the target's tokens."""
    prompt = repetitive_prompts(1, seed=8)[0]
    timeout_s = 0.3

    async def main():
        stalling = StallingDrafter()
        drafter = await serving.start(f"unix://{tmp_path}/drafter.sock", stalling.register)
        links = [DrafterLink(drafter.address, timeout_s)]
        servicer = VerifierServicer("tiny", links, default_budget=8, default_max_new_tokens=16, max_batch=8)
        service = await serving.start(f"unix://{tmp_path}/verifier.sock", servicer.register)
        adaptive, learnt = AdaptiveSpeculation(), []  # every verification cost its cost model is taught
        observe = adaptive.costs.observe_verify
        adaptive.costs.observe_verify = lambda batch, nodes, seconds: (learnt.append(seconds),
                                                                       observe(batch, nodes, seconds))
        scheduler = servicer.attach(target, build_verifier(target.model, 8, False, 0, block_size=4), adaptive)
        task = asyncio.ensure_future(scheduler.run())
        await scheduler.connect(links[0])
        async with grpc.aio.insecure_channel(service.address) as channel:
            tokens, _ = await collect(verifier_pb2_grpc.VerifierServiceStub(channel), request(prompt))
        task.cancel()
        await service.stop(0)
        await drafter.stop(0)
        return tokens, stalling.messages, learnt

    tokens, stalled_rounds, learnt = asyncio.run(main())
    assert tokens == expected(target, prompt)
    assert stalled_rounds >= 1
    assert learnt and max(learnt) < timeout_s / 2


def test_a_ready_service_serves_with_its_startup_objects_frozen(tmp_path):
    """`ready()` turns health SERVING, and the objects alive by then are out of the collector's reach: a full
    collection no longer walks the model, tokenizer and modules a process keeps for its life."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def main():
        service = await start_drafter(tmp_path)
        async with grpc.aio.insecure_channel(service.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await service.ready()
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        await serving.abandon(service)

    gc.unfreeze()
    try:
        asyncio.run(main())
        assert gc.get_freeze_count() > 10_000  # importing torch alone makes far more objects
    finally:
        gc.unfreeze()  # the tests after this one collect as usual


def test_a_drafters_reply_becomes_draft_trees_of_plain_lists():
    """DrafterLink._tree: a reply's tree, its tokens and parents as lists of ints (what validation, the plan and
    the walk index), and its lookup chain only where the drafter drafts by lookup and the round asked its own."""
    import types

    from treeserve.tree import DraftTree
    from treeserve.v1 import drafter_pb2

    reply = drafter_pb2.DraftResponse()
    reply.trees.add(request_id="a", token_ids=[7, 3, 9, 4], parents=[-1, 0, 0, 1], lookup_nodes=2)
    reply = drafter_pb2.DraftResponse.FromString(reply.SerializeToString())
    merged, ngram = types.SimpleNamespace(lookup_trees=True), types.SimpleNamespace(lookup_trees=False)
    tree = DrafterLink._tree(merged, reply.trees[0], False)
    assert tree == DraftTree([7, 3, 9, 4], [-1, 0, 0, 1], 2)
    assert type(tree.tokens) is list and type(tree.parents) is list and type(tree.parents[0]) is int
    assert DrafterLink._tree(merged, reply.trees[0], True).lookup_nodes is None
    assert DrafterLink._tree(ngram, reply.trees[0], False).lookup_nodes is None


class TokensOnly:
    """What a drafter link reads of a request that sends no features: its committed tokens and budget."""

    def __init__(self, tokens: list[int], budget: int):
        self.tokens, self.budget, self.last_accepted = tokens, budget, 0

    @property
    def committed_count(self) -> int:
        return len(self.tokens)

    def committed_since(self, start: int) -> list[int]:
        return self.tokens[start:]


def test_a_rounds_draft_messages_go_out_before_the_loop_runs_anything_else(tmp_path):
    """round.draft writes every drafter's messages before any task or callback the last round left ready runs (a
    gateway stream's message, the round's metrics, the held KV move), so that those run while the drafters draft;
    then it waits for the trees."""
    import types

    from treeserve.framing import FramedCall
    from treeserve.verifier.engine import FeatureCopies

    async def main():
        drafters = [await start_drafter(tmp_path, name) for name in ("one", "two")]
        links = [DrafterLink(drafter.address, 1.0) for drafter in drafters]
        order = []
        for name, link in zip(("one", "two"), links):
            assert await link.connect() and isinstance(link.call, FramedCall)
            write = link.call.write

            async def written(message, write=write, name=name):
                await write(message)
                order.append(f"{name} written")
            link.call.write = written
        asking = {request_id: types.SimpleNamespace(link=link, generation=TokensOnly([1, 2, 3, 1, 2], 4))
                  for request_id, link in (("a", links[0]), ("b", links[1]), ("c", links[0]))}
        for budgets in ({"a": 4, "b": 4, "c": 4}, {"a": 4, "c": 2}):  # two drafters, then one
            order.clear()
            asyncio.get_running_loop().call_soon(order.append, "ready before")
            drafts = await verifier_round.draft(asking, budgets, {}, FeatureCopies())
            assert order[-1] == "ready before" and len(order) == 1 + len(drafts)
            assert {request_id for found in drafts for request_id in found.trees} == set(budgets)
            assert all(tree.tokens[0] == 2 for found in drafts for tree in found.trees.values())
        for link in links:
            await link.close()
        for drafter in drafters:
            await drafter.stop(None)
    asyncio.run(main())
