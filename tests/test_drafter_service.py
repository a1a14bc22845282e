"""The drafter gRPC service: in-process on a Unix socket (its Draft stream over gRPC and as frames on the socket
beside it), and `python -m treeserve.drafter` as a subprocess."""

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from treeserve import serving
from treeserve.drafter.__main__ import main, parse_args
from treeserve.serving import default_address
from treeserve.drafter.ngram import NgramDrafter
from treeserve import framing
from treeserve.drafter import server as drafter_server
from treeserve.drafter.server import SERVICE_NAME, DrafterServicer
from treeserve.tree import MAX_BUDGET
from treeserve.v1 import drafter_pb2, drafter_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def with_drafter(tmp_path, test, max_budget=MAX_BUDGET, serving_now=True):
    """Run `await test(service, channel, stub)` against a drafter served in-process on a Unix socket."""
    async def serve_and_test():
        servicer = DrafterServicer(NgramDrafter(), max_budget=max_budget)
        service = await drafter_server.start(f"unix://{tmp_path}/d.sock", servicer)
        if serving_now:
            await service.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(service.address) as channel:
                await test(service, channel, drafter_pb2_grpc.DrafterServiceStub(channel))
        finally:
            await service.stop(None)
    asyncio.run(serve_and_test())


def item(request_id, tokens=(), budget=0, finished=False):
    return drafter_pb2.DraftItem(request_id=request_id, new_token_ids=tokens, budget=budget, finished=finished)


async def draft_round(stream, round_, *items):
    await stream.write(drafter_pb2.DraftRequest(round=round_, items=items))
    response = await stream.read()
    assert response.round == round_
    return {tree.request_id: (list(tree.token_ids), list(tree.parents)) for tree in response.trees}


def expected(context, budget):
    tree = NgramDrafter().tree(context, budget)
    return tree.tokens, tree.parents


def test_get_info(tmp_path):
    async def test(service, channel, stub):
        info = await stub.GetInfo(drafter_pb2.DrafterServiceGetInfoRequest())
        assert (info.kind, info.max_budget, list(info.feature_layer_ids)) == ("ngram", 32, [])
        assert info.draft_socket == f"{tmp_path}/d.sock.draft"
        assert not info.lookup_trees  # its own trees are lookup's: it takes no lookup_only items
    with_drafter(tmp_path, test, max_budget=32)


def test_a_drafter_on_tcp_has_no_draft_socket():
    async def main():
        service = await drafter_server.start(f"127.0.0.1:{serving.free_port()}", DrafterServicer(NgramDrafter()))
        async with grpc.aio.insecure_channel(service.address) as channel:
            info = await drafter_pb2_grpc.DrafterServiceStub(channel).GetInfo(
                drafter_pb2.DrafterServiceGetInfoRequest())
        await service.stop(0)
        return info
    assert asyncio.run(main()).draft_socket == ""


async def framed_stream(stub) -> framing.FramedCall:
    info = await stub.GetInfo(drafter_pb2.DrafterServiceGetInfoRequest())
    return await framing.FramedCall.open(info.draft_socket, drafter_pb2.DraftResponse)


def test_the_draft_socket_serves_the_stream_as_grpc_does(tmp_path):
    """The same rounds through both doors give the same trees, and each keeps its own contexts."""
    context = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]

    async def test(service, channel, stub):
        framed, streamed = await framed_stream(stub), stub.Draft()
        for stream in (framed, streamed):
            assert await draft_round(stream, 1, item("a", context, budget=8)) == {"a": expected(context, 8)}
            assert await draft_round(stream, 2, item("a", [3], budget=16)) == {"a": expected(context + [3], 16)}
        assert await draft_round(framed, 3, item("a", finished=True), item("b", [4, 4, 4], budget=2)) == {
            "b": expected([4, 4, 4], 2)}
        # "a" finished on the framed stream only: the gRPC stream's "a" goes on from its own context.
        assert await draft_round(streamed, 3, item("a", budget=4)) == {"a": expected(context + [3], 4)}
        framed.cancel()
        await streamed.done_writing()
    with_drafter(tmp_path, test)


@pytest.mark.parametrize("frame, reason", [
    (drafter_pb2.DraftRequest(round=7, items=[item("", [1], budget=2)]).SerializeToString(),
     "round 7: an item has no request_id"),
    (b"\xff\xff\xff", "no DraftRequest"),
])
def test_a_bad_frame_is_refused_with_its_reason_and_the_drafter_carries_on(tmp_path, frame, reason):
    async def test(service, channel, stub):
        stream = await framed_stream(stub)
        framing.write_frame(stream.writer, frame)
        with pytest.raises(framing.Refused, match=reason):
            await stream.read()
        stream.cancel()
        assert await draft_round(await framed_stream(stub), 1, item("a", [3], budget=8)) == {"a": ([3], [-1])}
    with_drafter(tmp_path, test, max_budget=8)


def test_a_frame_above_the_limit_is_refused_before_it_is_read(tmp_path):
    async def test(service, channel, stub):
        stream = await framed_stream(stub)
        stream.writer.write(framing.HEADER.pack(framing.MESSAGE, framing.MAX_FRAME_BYTES + 1))
        with pytest.raises(framing.Refused, match="above the limit"):
            await stream.read()
    with_drafter(tmp_path, test)


def test_stream_trees_match_ngram_drafter_on_accumulated_contexts(tmp_path):
    # Repetitive contexts, so the trees have several branches, not just the root.
    prompts = {"a": [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2], "b": [9, 8, 9, 7, 9, 8, 6, 9]}
    rounds = [  # per round: request -> (new tokens, budget)
        {"a": (prompts["a"], 8), "b": (prompts["b"], 5)},
        {"a": ([3, 4], 16), "b": ([8], 0)},
        {"a": ([1], 3), "b": ([9, 8], 12)},
        {"a": ([2, 5, 6, 1, 2], 128)},  # b sends nothing this round: its context waits
        {"a": ([3], 1), "b": ([9], 7)},
    ]

    async def test(service, channel, stub):
        stream = stub.Draft()
        contexts, largest_tree = {"a": [], "b": []}, 0
        for round_, updates in enumerate(rounds, start=100):
            trees = await draft_round(stream, round_, *(item(r, new, budget) for r, (new, budget) in updates.items()))
            for request_id, (new, _) in updates.items():
                contexts[request_id] += new
            want = {r: expected(contexts[r], budget) for r, (_, budget) in updates.items() if budget > 0}
            assert trees == want
            largest_tree = max([largest_tree] + [len(tokens) for tokens, _ in trees.values()])
        assert largest_tree > 5  # the contexts did exercise real trees
        await stream.done_writing()
        assert await stream.read() == grpc.aio.EOF
        assert await stream.code() == grpc.StatusCode.OK
    with_drafter(tmp_path, test)


def test_budget_zero_updates_context_without_a_tree(tmp_path):
    async def test(service, channel, stub):
        stream = stub.Draft()
        assert await draft_round(stream, 1, item("a", [5, 6, 7, 5], budget=0)) == {}
        assert await draft_round(stream, 2, item("a", [6], budget=0)) == {}
        assert await draft_round(stream, 3, item("a", budget=4)) == {"a": expected([5, 6, 7, 5, 6], 4)}
        await stream.done_writing()
    with_drafter(tmp_path, test)


def test_finished_drops_the_context(tmp_path):
    async def test(service, channel, stub):
        stream = stub.Draft()
        await draft_round(stream, 1, item("a", [1, 2, 3, 1, 2], budget=4), item("b", [4, 4, 4], budget=2))
        assert await draft_round(stream, 2, item("a", [3], budget=4, finished=True), item("b", budget=2)) == {
            "b": expected([4, 4, 4], 2)}
        # The id starts over: the old tokens no longer count.
        assert await draft_round(stream, 3, item("a", [2], budget=4)) == {"a": ([2], [-1])}
        await stream.done_writing()
    with_drafter(tmp_path, test)


def test_contexts_belong_to_their_stream(tmp_path):
    async def test(service, channel, stub):
        first, second = stub.Draft(), stub.Draft()
        await draft_round(first, 1, item("a", [1, 2, 1], budget=2))
        assert await draft_round(second, 1, item("a", [1], budget=2)) == {"a": ([1], [-1])}
        assert await draft_round(first, 2, item("a", budget=2)) == {"a": expected([1, 2, 1], 2)}
        first.cancel()
        await second.done_writing()
    with_drafter(tmp_path, test)


def test_health_and_reflection(tmp_path):
    async def test(service, channel, stub):
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        await service.set_serving(True)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await reflection.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in (await reflection.read()).list_services_response.service}
        assert SERVICE_NAME == "treeserve.v1.DrafterService" and SERVICE_NAME in names
        await reflection.done_writing()
    with_drafter(tmp_path, test, serving_now=False)


@pytest.mark.parametrize("bad_items, message", [
    ([item("a", [1, 2], budget=9)], "budget 9 is above this drafter's maximum 8"),
    ([item("new", [], budget=2)], "unknown on this stream"),
    ([item("", [1], budget=2)], "no request_id"),
    ([item("a", [1]), item("a", [2])], "more than one item"),
    ([drafter_pb2.DraftItem(request_id="a", new_token_ids=[1], features=drafter_pb2.Features(dtype="float32"))],
     "features sent"),
    ([drafter_pb2.DraftItem(request_id="a", new_token_ids=[1], budget=2, lookup_only=True)],
     "asks for prompt lookup's tree alone, which the ngram drafter does not draft"),
])
def test_bad_input_aborts_the_stream_with_invalid_argument(tmp_path, bad_items, message):
    async def test(service, channel, stub):
        stream = stub.Draft()
        await stream.write(drafter_pb2.DraftRequest(round=7, items=bad_items))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.read()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details() and "round 7" in error.value.details()
        # The service itself carries on.
        assert await draft_round(stub.Draft(), 1, item("a", [3], budget=8)) == {"a": ([3], [-1])}
    with_drafter(tmp_path, test, max_budget=8)


def test_flags_from_the_environment(monkeypatch):
    monkeypatch.setenv("TREESERVE_DRAFTER_LISTEN", "unix:///run/x.sock")
    monkeypatch.setenv("TREESERVE_DRAFTER_MAX_BUDGET", "64")
    args = parse_args(["--grace-s", "2.5"])
    # --kind auto resolves to prompt lookup merged with the DFlash drafter shipped for the default target.
    assert (args.listen, args.max_budget, args.grace_s, args.kind) == ("unix:///run/x.sock", 64, 2.5, "merged")
    monkeypatch.setenv("TREESERVE_DRAFTER_TARGET", "some/hf-folder")
    assert parse_args([]).kind == "ngram"  # no drafter ships for it
    assert parse_args(["--max-budget", "3"]).max_budget == 3  # the command line wins
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert default_address("drafter") == "unix:///run/user/7/treeserve/drafter.sock"


@pytest.mark.parametrize("argv, code", [
    (["--max-budget", "0"], 2), (["--kind", "model"], 2), (["--kind", "medusa"], 2),
    (["--tree", "bush"], 2), (["--grace-s", "soon"], 2), (["--bogus"], 2), (["--listen", "nowhere"], 2),
    (["--kind", "dflash", "--drafter-path", "/nonexistent", "--listen", "unix:///tmp/ts-bad-flags.sock"], 1),
])
def test_bad_flags_exit_with_one_line(argv, code, capsys):
    try:
        returned = main(argv)
    except SystemExit as exit_:  # argparse exits on its own
        returned = exit_.code
    stderr = capsys.readouterr().err
    assert returned == code
    assert stderr.count("\n") == 1 and "error:" in stderr


@pytest.mark.slow  # a few seconds: the subprocess imports torch, and the drain waits out the grace period
def test_subprocess_serves_then_drains_on_sigterm(tmp_path):
    socket = tmp_path / "d.sock"
    grace_s = 2.0  # leaves time for a round during the drain, even on a busy machine
    process = subprocess.Popen([sys.executable, "-m", "treeserve.drafter", "--listen", f"unix://{socket}",
                                "--kind", "ngram", "--grace-s", str(grace_s)], stderr=subprocess.PIPE, text=True)

    async def client():
        # Retry the connection every 0.1 s while the socket is not there yet (gRPC's default backoff grows to 2 min).
        quick_retries = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                         ("grpc.max_reconnect_backoff_ms", 100)]
        async with grpc.aio.insecure_channel(f"unix://{socket}", options=quick_retries) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60  # startup imports torch: seconds on a slow machine
            while True:
                assert process.poll() is None, "the drafter exited during startup"
                try:
                    if (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass  # not listening yet
                assert time.monotonic() < deadline, "the drafter did not become SERVING"
                await asyncio.sleep(0.1)

            # A verifier's stream stays open across the SIGTERM: it keeps working while the server drains, and
            # is cancelled once the grace period is over.
            stream = drafter_pb2_grpc.DrafterServiceStub(channel).Draft()
            assert await draft_round(stream, 1, item("a", [1, 2, 1], budget=2)) == {"a": expected([1, 2, 1], 2)}
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.2)
            assert await draft_round(stream, 2, item("a", [2], budget=2)) == {"a": expected([1, 2, 1, 2], 2)}
            with pytest.raises(grpc.aio.AioRpcError):
                await stream.read()
            assert time.monotonic() - sent > grace_s * 0.8
            return sent

    try:
        sigterm_sent = asyncio.run(client())
        assert process.wait(timeout=grace_s + 10) == 0
        assert time.monotonic() - sigterm_sent < grace_s + 5
        log = process.stderr.read()
        assert f"listening on unix://{socket}" in log and "Traceback" not in log
        assert not socket.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
