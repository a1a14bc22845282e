"""The gateway against fake verifiers (in-process, Unix sockets) that stream scripted token ids.

Uses SmolLM2's real tokenizer; each test drives its own event loop with asyncio.run.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_fakes import MAX_CONTEXT, TEXT, FakeVerifier, running, smollm2_tokenizer, start_fake, steps_of
from treeserve.gateway.client import add_client_arguments, generate_via_gateway, main_client
from treeserve.detokenize import TextStream
from treeserve.framing import FramedCall
from treeserve.params import GenerationParams
from treeserve.v1 import gateway_pb2, generation_pb2

JSON_KEYS = {"token_ids", "text", "finish_reason", "prompt_tokens", "rounds", "mean_accepted", "tokens_per_s",
             "prefill_s", "elapsed_s", "seed"}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def eos(tok):
    return min(tok.eos_ids)


@pytest.fixture(scope="module")
def steps(tok):
    return steps_of(tok)


def request(prompt=TEXT, max_new_tokens=16, temperature=0.0, top_p=1.0, seed=None, **kwargs):
    sampling = generation_pb2.SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling,
                                       stop=generation_pb2.StopConditions(max_new_tokens=max_new_tokens), **kwargs)


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in call:
            pass
    return error.value.code(), error.value.details()


async def rest_of(call) -> list:
    """The remaining replies of a call already read with call.read() (the two styles do not mix)."""
    replies = []
    while (reply := await call.read()) != grpc.aio.EOF:
        replies.append(reply)
    return replies


# ------------------------------------------------------------------------------------------- text rules


def test_text_stream_never_emits_half_a_character(tok):
    ids = tok.encode(TEXT)
    stream = TextStream(tok)
    pieces = [stream.push([t]) for t in ids] + [stream.push([], final=True)]
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # The step that brings only the first bytes of 日 emits nothing of it.
    first = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith("\ufffd"))
    assert "日" not in "".join(pieces[:first + 1])


def test_text_stream_holds_back_and_drops_stop_strings(tok):
    ids = tok.encode("one two STOP three")
    stream = TextStream(tok, stop_strings=["STOP", "xyz"])
    pieces = [stream.push([t]) for t in ids]
    assert "".join(pieces) + stream.push([], final=True) == "one two "
    for i in range(len(ids)):  # until the stop string shows up, exactly the last len("STOP") - 1 wait
        if "STOP" not in (so_far := tok.decode(ids[:i + 1])):
            assert "".join(pieces[:i + 1]) == so_far[:max(0, len(so_far) - 3)]
    # A near miss is released once it can no longer become the stop string.
    stream = TextStream(tok, stop_strings=["STOP"])
    assert "".join(stream.push([t]) for t in tok.encode("a STOne")) + stream.push([], final=True) == "a STOne"


def test_text_stream_drops_a_stop_token_and_what_follows(tok, eos):
    ids = tok.encode("alpha beta gamma")
    stream = TextStream(tok, stop_ids={ids[1], eos})
    assert stream.push(ids) + stream.push([], final=True) == tok.decode(ids[:1])
    stream = TextStream(tok, stop_ids={eos})
    assert stream.push(ids + [eos], final=True) == "alpha beta gamma"


# --------------------------------------------------------------------------------------------- the service


def test_streams_settled_text_and_the_final_message(tmp_path, tok, eos, steps):
    async def main():
        fake = FakeVerifier(steps)
        async with running(tmp_path, tok, [fake]) as h:
            replies = [r async for r in h.stub.Generate(request(seed=7))]
            chat_replies = [r async for r in h.stub.Generate(request(prompt="Hi", chat=True))]
        return fake, replies, chat_replies

    fake, replies, chat_replies = asyncio.run(main())
    assert "".join(r.text for r in replies) == TEXT
    assert not any("\ufffd" in r.text for r in replies)
    assert [list(r.token_ids) for r in replies] == steps
    final = replies[-1]
    assert final.finish_reason == generation_pb2.FINISH_REASON_STOP and final.seed == 7
    assert final.usage.prompt_tokens == len(tok.encode(TEXT)) and final.stats.rounds == len(steps) - 1
    assert not any(r.finish_reason for r in replies[:-1])
    sent = fake.requests[0]
    assert list(sent.prompt_token_ids) == tok.encode(TEXT) and sent.request_id
    assert sent.stop.max_new_tokens == 16 and sent.sampling.seed == 7
    assert list(fake.requests[1].prompt_token_ids) == tok.encode_chat("Hi")
    assert fake.requests[0].request_id != fake.requests[1].request_id
    assert chat_replies[-1].seed == 1234  # the verifier's seed when the request had none


def test_bad_requests_are_invalid_argument(tmp_path, tok, steps):
    async def main():
        fake = FakeVerifier(steps)
        async with running(tmp_path, tok, [fake]) as h:
            bad = [request(prompt=""), request(temperature=-1.0), request(top_p=1.5),
                   request(prompt="word " * MAX_CONTEXT), request(max_new_tokens=MAX_CONTEXT),
                   request(speculation=generation_pb2.SpeculationParams(budget=33)),
                   request(temperature=float("inf")), request(temperature=float("nan")), request(top_p=float("nan"))]
            results = [await status_of(h.stub.Generate(r)) for r in bad]
        return fake, results

    fake, results = asyncio.run(main())
    assert [code for code, _ in results] == [grpc.StatusCode.INVALID_ARGUMENT] * 9
    messages = [message for _, message in results]
    assert "prompt is empty" in messages[0] and "temperature" in messages[1] and "top_p" in messages[2]
    assert "context of 64" in messages[3] and "context of 64" in messages[4] and "budget" in messages[5]
    assert "temperature must be a finite number" in messages[6] and "got inf" in messages[6]
    assert "got nan" in messages[7] and "top_p" in messages[8]
    assert fake.requests == []


def test_a_conversation_goes_through_the_chat_template(tmp_path, tok, steps):
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", TEXT)]
    messages = [gateway_pb2.ChatMessage(role=role, content=content) for role, content in turns]

    async def main():
        fake = FakeVerifier(steps)
        async with running(tmp_path, tok, [fake]) as h:
            replies = [r async for r in h.stub.Generate(request(prompt="", messages=messages))]
            refused = [await status_of(h.stub.Generate(r)) for r in (
                request(messages=messages), request(prompt="", messages=[gateway_pb2.ChatMessage(role="tool")]))]
        return fake, replies, refused

    fake, replies, refused = asyncio.run(main())
    assert "".join(r.text for r in replies) == TEXT
    assert list(fake.requests[0].prompt_token_ids) == tok.encode_messages(
        [{"role": role, "content": content} for role, content in turns])
    assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 2 and len(fake.requests) == 1
    assert "not both" in refused[0][1] and "messages[0]: the role" in refused[1][1]


def test_admission_limit_is_resource_exhausted(tmp_path, tok, steps):
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake], max_inflight=1) as h:
            first = h.stub.Generate(request())
            await first.read()
            refused = await status_of(h.stub.Generate(request()))
            fake.gate.set()
            rest = await rest_of(first)
            again = [r async for r in h.stub.Generate(request())]  # the slot is free again
        return refused, rest, again

    (code, message), rest, again = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 1" in message
    assert rest[-1].finish_reason and again[-1].finish_reason


def test_requests_spread_by_inflight_count(tmp_path, tok, steps):
    async def main():
        fakes = [FakeVerifier(steps, gated=True), FakeVerifier(steps, gated=True)]
        async with running(tmp_path, tok, fakes) as h:
            calls = [h.stub.Generate(request()) for _ in range(4)]
            for call in calls:
                await call.read()
            counts = [len(f.requests) for f in fakes]
            for fake in fakes:
                fake.gate.set()
            for call in calls:
                assert (await rest_of(call))[-1].finish_reason
            idle = [v.inflight for v in h.servicer.verifiers] + [h.servicer.inflight]
        return counts, idle

    counts, idle = asyncio.run(main())
    assert counts == [2, 2] and idle == [0, 0, 0]


def test_a_session_socket_that_cannot_be_opened_leaves_the_session_on_grpc(tmp_path, tok, steps, caplog):
    async def main():
        fake = FakeVerifier(steps, session_socket=f"{tmp_path}/gone.sock.session")
        async with running(tmp_path, tok, [fake]) as h:
            replies = [r async for r in h.stub.Generate(request())]
            return replies, h.servicer.verifiers[0]._session.call

    replies, call = asyncio.run(main())
    assert "".join(r.text for r in replies) == TEXT and not isinstance(call, FramedCall)
    assert "gone.sock.session" in caplog.text and "Session over gRPC" in caplog.text


def test_client_cancel_cancels_the_verifier_stream(tmp_path, tok, steps):
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake]) as h:
            call = h.stub.Generate(request())
            await call.read()
            call.cancel()
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            for _ in range(100):
                if h.servicer.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            return h.servicer.inflight, h.servicer.verifiers[0].inflight

    assert asyncio.run(main()) == (0, 0)


def test_verifier_down_or_failing(tmp_path, tok, steps):
    async def main():
        results = {}
        async with running(tmp_path / "a", tok, [], down=1) as h:
            results["none"] = await status_of(h.stub.Generate(request()))
        fake = FakeVerifier(steps)
        async with running(tmp_path / "b", tok, [fake]) as h:
            await h.ready
            await h.servers[0].stop(0)
            results["stopped"] = await status_of(h.stub.Generate(request()))
        fakes = [FakeVerifier(steps), FakeVerifier(steps)]
        async with running(tmp_path / "c", tok, fakes) as h:
            await h.ready
            await h.servers[0].stop(0)  # the first in line is gone: the request moves on to the second
            results["failover"] = [r async for r in h.stub.Generate(request())][-1].finish_reason
        for name, error in [("invalid", (grpc.StatusCode.INVALID_ARGUMENT, "bad ids")),
                            ("internal", (grpc.StatusCode.INTERNAL, "boom"))]:
            async with running(tmp_path / name, tok, [FakeVerifier(steps, error=error)]) as h:
                results[name] = await status_of(h.stub.Generate(request()))
        return results

    for sub in "abc":
        (tmp_path / sub).mkdir()
    (tmp_path / "invalid").mkdir()
    (tmp_path / "internal").mkdir()
    results = asyncio.run(main())
    assert results["none"][0] == grpc.StatusCode.UNAVAILABLE and "down0.sock" in results["none"][1]
    assert results["stopped"][0] == grpc.StatusCode.UNAVAILABLE and "v0.sock" in results["stopped"][1]
    assert results["failover"] == generation_pb2.FINISH_REASON_STOP
    assert results["invalid"] == (grpc.StatusCode.INVALID_ARGUMENT, "bad ids")
    assert results["internal"][0] == grpc.StatusCode.UNAVAILABLE and "INTERNAL: boom" in results["internal"][1]


def test_a_deadline_ends_the_request_and_its_verifier_work(tmp_path, tok, steps):
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake]) as h:
            late = await status_of(h.stub.Generate(request(), timeout=0.5))
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            fake.gate.set()
            replies = [r async for r in h.stub.Generate(request(), timeout=30)]
        return late, replies

    (code, _), replies = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and replies[-1].finish_reason


def test_model_info_and_health(tmp_path, tok, steps):
    async def main():
        async with running(tmp_path, tok, [FakeVerifier(steps)]) as h:
            await h.ready
            health = await health_pb2_grpc.HealthStub(h.channel).Check(health_pb2.HealthCheckRequest())
            info = await h.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
        return health, info

    health, info = asyncio.run(main())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert (info.model, info.max_context, info.max_new_tokens_limit, info.max_budget) == ("fake-smollm2", 64, 63, 32)


async def health_of(channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def wait_for_health(channel, status, timeout_s=10.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if await health_of(channel) == status:
            return True
        await asyncio.sleep(0.05)
    return False


def test_health_follows_the_only_verifier(tmp_path, tok, steps):
    async def main():
        async with running(tmp_path, tok, [FakeVerifier(steps)]) as h:
            await h.ready
            await h.servers[0].stop(0)
            went_down = await wait_for_health(h.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
            h.servers[0] = await start_fake(FakeVerifier(steps), h.servicer.verifiers[0].address)
            came_back = await wait_for_health(h.channel, health_pb2.HealthCheckResponse.SERVING)
            replies = [r async for r in h.stub.Generate(request())]
            by_name = await health_pb2_grpc.HealthStub(h.channel).Check(
                health_pb2.HealthCheckRequest(service="treeserve.v1.GatewayService"))
        return went_down, came_back, replies[-1].finish_reason, by_name.status

    assert asyncio.run(main()) == (True, True, generation_pb2.FINISH_REASON_STOP, health_pb2.HealthCheckResponse.SERVING)


def test_undecodable_requests_are_invalid_argument(tmp_path, tok, steps):
    # GenerateRequest field 1 (prompt): invalid UTF-8, then a length field promising more bytes than follow.
    bad = {"not utf-8": b"\x0a\x02\xff\xfe", "truncated": b"\x0a\x10abc"}

    async def main():
        async with running(tmp_path, tok, [FakeVerifier(steps)]) as h:
            generate = h.channel.unary_stream("/treeserve.v1.GatewayService/Generate",
                                              response_deserializer=gateway_pb2.GenerateResponse.FromString)
            return {name: await status_of(generate(data)) for name, data in bad.items()}

    for code, message in asyncio.run(main()).values():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid treeserve.v1.GenerateRequest" in message


async def largest_gap(call) -> float:
    gaps, last = [], None
    async for _ in call:
        now = asyncio.get_running_loop().time()
        if last is not None:
            gaps.append(now - last)
        last = now
    return max(gaps)


@pytest.mark.parametrize("max_context", [MAX_CONTEXT, 150_000], ids=["refused-by-bytes", "tokenized-in-a-thread"])
def test_large_prompts_do_not_stall_another_stream(tmp_path, tok, steps, max_context):
    """Four 1M-character prompts beside a stream: refused by their bytes, or (a context that fits their bytes but
    not their tokens) by their tokens, tokenized off the event loop; the stream's largest gap stays under 2x."""
    large = request(prompt="word " * 200_000, max_new_tokens=1)

    async def main():
        paced = FakeVerifier(steps * 5, interval_s=0.05, max_context=max_context)
        async with running(tmp_path, tok, [paced]) as h:
            unloaded = await largest_gap(h.stub.Generate(request(max_new_tokens=1)))
            stream = asyncio.ensure_future(largest_gap(h.stub.Generate(request(max_new_tokens=1))))
            await asyncio.sleep(0.1)
            refused = await asyncio.gather(*(status_of(h.stub.Generate(large)) for _ in range(4)))
            return unloaded, await stream, refused

    unloaded, loaded, refused = asyncio.run(main())
    assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert all("context of" in message for _, message in refused)
    assert loaded < 2 * unloaded, f"largest gap {loaded:.3f} s beside the large prompts, {unloaded:.3f} s without"


# ----------------------------------------------------------------------------------------------- the client


def test_client_returns_the_generate_json_keys(tmp_path, tok, steps):
    async def main():
        pieces = []
        async with running(tmp_path, tok, [FakeVerifier(steps)]) as h:
            result = await generate_via_gateway(h.address, TEXT, GenerationParams(max_new_tokens=16, seed=5),
                                                on_text=pieces.append)
        return result, pieces

    result, pieces = asyncio.run(main())
    assert set(result) == JSON_KEYS
    assert result["text"] == "".join(pieces) == TEXT
    assert result["token_ids"] == sum(steps, []) and result["finish_reason"] == "stop" and result["seed"] == 5
    assert result["prompt_tokens"] == len(tok.encode(TEXT)) and result["rounds"] == len(steps) - 1
    assert 0 < result["prefill_s"] <= result["elapsed_s"]


def test_client_errors_are_one_line(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_client_arguments(parser)
    assert main_client(parser.parse_args(["--address", f"unix://{tmp_path}/none.sock", "--prompt", "hi"])) == 1
    err = capsys.readouterr().err
    assert err.startswith("treeserve client: error: UNAVAILABLE: ") and err.count("\n") == 1
    assert main_client(parser.parse_args(["--prompt", "hi", "--top-p", "2"])) == 1
    assert capsys.readouterr().err == "treeserve client: error: top_p must be in (0, 1], got 2.0\n"


# ------------------------------------------------------------------------------------------ the entry point


def test_main_flags_env_and_errors(tmp_path, monkeypatch, capsys):
    from treeserve.gateway.__main__ import main, parse_args

    monkeypatch.setenv("TREESERVE_GATEWAY_VERIFIER", "unix:///tmp/a.sock, localhost:5000")
    monkeypatch.setenv("TREESERVE_GATEWAY_MAX_INFLIGHT", "8")
    args = parse_args(["--listen", "localhost:6000"])
    assert args.verifier == ["unix:///tmp/a.sock", "localhost:5000"] and args.max_inflight == 8
    assert parse_args(["--verifier", "localhost:1"]).verifier == ["localhost:1"]
    for argv in (["--max-inflight", "0"], ["--verifier", "nowhere"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    monkeypatch.setenv("TREESERVE_GATEWAY_MAX_INFLIGHT", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    monkeypatch.delenv("TREESERVE_GATEWAY_MAX_INFLIGHT")
    assert main(["--target", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("treeserve gateway: error: target") and err.count("\n") == 1
