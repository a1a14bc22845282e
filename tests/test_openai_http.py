"""The gateway's OpenAI-compatible HTTP API against fake verifiers (in-process): the shape of its answers and
streams, what reaches the verifier, every refusal with OpenAI's error JSON and its status, clients that leave,
and the requests counted. The HTTP calls block, so they run in a thread while the gateway serves in the loop."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gateway_fakes import MAX_CONTEXT, TEXT, FakeVerifier, running, smollm2_tokenizer, steps_of


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def steps(tok):
    return steps_of(tok)


def post(url: str, body, timeout: float = 30) -> tuple[int, dict]:
    """POST a JSON body (or raw bytes): the status and the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def events(url: str, body: dict) -> list:
    """A streamed answer's events: each JSON payload parsed, then "[DONE]"."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        payloads = [line[len(b"data: "):].strip().decode() for line in reply if line.startswith(b"data: ")]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


def serve_and_call(tmp_path, tok, fakes, call, **kwargs):
    """`call(harness)` in a thread while the gateway (HTTP door open) serves `fakes` in this thread's loop."""
    async def main():
        async with running(tmp_path, tok, fakes, http=True, **kwargs) as h:
            return await asyncio.to_thread(call, h)
    return asyncio.run(main())


def chat(content=TEXT, **fields) -> dict:
    """A chat request that fits the fakes' context of 64 (16 new tokens unless it says otherwise)."""
    room = {} if {"max_tokens", "max_completion_tokens"} & set(fields) else {"max_tokens": 16}
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **room, **fields}


def test_a_chat_stream_is_shaped_as_openais(tmp_path, tok, steps):
    fake = FakeVerifier(steps)
    body = {"model": "fake-smollm2", "messages": [{"role": "developer", "content": "Be brief."},
                                                  {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": 16}
    got = serve_and_call(tmp_path, tok, [fake], lambda h: events(f"{h.http_url}/v1/chat/completions", body))
    *chunks, done = got
    assert done == "[DONE]"
    assert {(c["object"], c["model"], c["id"]) for c in chunks} == {("chat.completion.chunk", "fake-smollm2",
                                                                     chunks[0]["id"])}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:] if c["choices"] and c["choices"][0]["delta"]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == TEXT
    finish, last = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1]) and "metrics" not in finish
    n = sum(map(len, steps))
    prompt_ids = tok.encode_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
                                                       "total_tokens": len(prompt_ids) + n}
    stats = last["metrics"]["speculative_decoding"]
    assert stats["num_spec_steps"] == len(steps) - 1 and stats["mean_acceptance_length"] == pytest.approx(
        (n - 2) / (len(steps) - 1))
    assert list(fake.requests[0].prompt_token_ids) == prompt_ids


def test_answers_not_streamed_and_completions(tmp_path, tok, steps):
    fake = FakeVerifier(steps)

    def call(h):
        return (post(f"{h.http_url}/v1/chat/completions", chat(return_token_ids=True)),
                post(f"{h.http_url}/v1/completions", {"prompt": TEXT, "temperature": 0, "max_tokens": 16}),
                events(f"{h.http_url}/v1/completions", {"prompt": [TEXT], "max_tokens": 16, "stream": True}))

    (status, answer), (completion_status, completion), streamed = serve_and_call(tmp_path, tok, [fake], call)
    assert status == 200 and answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    [choice] = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT} and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == sum(steps, [])
    assert answer["usage"]["completion_tokens"] == sum(map(len, steps))
    assert answer["metrics"]["speculative_decoding"]["num_spec_steps"] == len(steps) - 1
    assert completion_status == 200 and completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == TEXT and "metrics" in completion
    assert streamed[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in streamed[:-1]) == TEXT
    assert "metrics" in streamed[-2]  # without include_usage, the finish chunk (the last) carries the stats
    assert list(fake.requests[1].prompt_token_ids) == tok.encode(TEXT) == list(fake.requests[2].prompt_token_ids)


def test_request_fields_reach_the_verifier(tmp_path, tok, steps):
    fake = FakeVerifier(steps)
    bodies = [chat(temperature=0.5, top_p=0.9, top_k=5, seed=7, stop=["x", "y"], max_completion_tokens=10,
                   speculation={"budget": 8}, ignore_eos=True, stop_token_ids=[3], user="someone", n=1,
                   logprobs=False, presence_penalty=0),
              {"prompt": "x", "stop": "z", "max_tokens": 5, "speculation": {"disabled": True}}]
    statuses = serve_and_call(tmp_path, tok, [fake],
                              lambda h: [post(f"{h.http_url}/v1/{path}", body)[0]
                                         for path, body in zip(("chat/completions", "completions"), bodies)])
    assert statuses == [200, 200]
    asked, plain = fake.requests
    assert asked.sampling.temperature == pytest.approx(0.5) and asked.sampling.top_p == pytest.approx(0.9)
    assert (asked.sampling.top_k, asked.sampling.seed, list(asked.stop.stop_strings)) == (5, 7, ["x", "y"])
    assert (asked.stop.max_new_tokens, asked.speculation.budget, asked.stop.ignore_eos) == (10, 8, True)
    assert 3 in asked.stop.stop_token_ids
    # OpenAI's default temperature is 1; the gateway's default max_new_tokens fills in for max_tokens.
    assert plain.sampling.temperature == 1.0 and not plain.sampling.HasField("seed")
    assert (list(plain.stop.stop_strings), plain.stop.max_new_tokens, plain.speculation.disabled) == (["z"], 5, True)


BAD = [  # (path, body, what the message names)
    ("chat/completions", b"{not json", "not valid JSON"),
    ("chat/completions", b"[1, 2]", "JSON object"),
    ("chat/completions", chat(n=2), "n"),
    ("chat/completions", chat(logprobs=True), "logprobs"),
    ("chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("chat/completions", chat(response_format={"type": "json_object"}), "response_format"),
    ("chat/completions", chat(presence_penalty=0.5), "presence_penalty"),
    ("chat/completions", chat(frequency_penalty=1), "frequency_penalty"),
    ("chat/completions", chat(logit_bias={"1": 5}), "logit_bias"),
    ("chat/completions", chat(reasoning_effort="high"), "reasoning_effort"),
    ("chat/completions", chat(prompt="x"), "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ("chat/completions", chat(max_tokens=0), "max_tokens"),
    ("chat/completions", chat(max_tokens=MAX_CONTEXT), "context of 64"),
    ("chat/completions", chat(max_tokens=4, max_completion_tokens=4), "not both"),
    ("chat/completions", chat(temperature=-1), "temperature"),
    ("chat/completions", chat(temperature="hot"), "temperature"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', "finite"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "not valid JSON"),
    ("chat/completions", chat(temperature=1e300), "finite"),
    ("chat/completions", chat(top_p=10**400), "finite"),
    ("chat/completions", chat(top_p=1.5), "top_p"),
    ("chat/completions", chat(top_k=-1), "top_k"),
    ("chat/completions", chat(seed=-1), "seed"),
    ("chat/completions", chat(stop=[""]), "stop strings"),
    ("chat/completions", chat(stream_options={"include_usage": True}), "stream_options"),
    ("chat/completions", chat(stream=True, stream_options={"continuous_usage_stats": True}), "continuous_usage"),
    ("chat/completions", chat(speculation={"budget": 33}), "budget"),
    ("chat/completions", chat(speculation={"budget": 0}), "speculation"),
    ("completions", {"prompt": ""}, "prompt is empty"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
    ("completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens"),
]


def test_bad_requests_get_400_with_openais_error_naming_the_field(tmp_path, tok, steps):
    fake = FakeVerifier(steps)
    answers = serve_and_call(tmp_path, tok, [fake],
                             lambda h: [post(f"{h.http_url}/v1/{path}", body) for path, body, _ in BAD])
    for (path, body, named), (status, answer) in zip(BAD, answers):
        assert status == 400, (body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["type"] == "invalid_request_error"
        assert named in answer["error"]["message"], (named, answer)
    assert fake.requests == []


def test_errors_map_to_http_statuses(tmp_path, tok, steps):
    def call(h):
        return [post(f"{h.http_url}/v1/chat/completions", chat()),
                post(f"{h.http_url}/v1/chat/completions", chat(model="gpt-4o")),
                post(f"{h.http_url}/v1/nowhere", chat()), get(f"{h.http_url}/v1/chat/completions")]

    (tmp_path / "down").mkdir()
    [(down, down_answer), *_] = serve_and_call(tmp_path / "down", tok, [], call, down=1)
    assert down == 503 and "no verifier answered" in down_answer["error"]["message"]
    slow = FakeVerifier(steps, error=(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"))
    (tmp_path / "slow").mkdir()
    (late, late_answer), (model, model_answer), (route, _), (method, _) = serve_and_call(tmp_path / "slow", tok,
                                                                                          [slow], call)
    assert late == 504 and late_answer["error"]["code"] == "deadline_exceeded"
    assert model == 404 and model_answer["error"]["code"] == "model_not_found"
    assert "fake-smollm2" in model_answer["error"]["message"]
    assert (route, method) == (404, 405)


def test_the_deadline_of_http_requests(tmp_path, tok, steps):
    """--http-timeout-s: a request not finished by then gets 504, or, once its stream is under way, an error
    event; the verifier's stream is cancelled."""
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake], http=True, http_timeout_s=0.5) as h:
            url = f"{h.http_url}/v1/chat/completions"
            answered = await asyncio.to_thread(post, url, chat())
            streamed = await asyncio.to_thread(events, url, chat(stream=True))
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            return answered, streamed

    (status, answer), streamed = asyncio.run(main())
    assert status == 504 and answer["error"]["code"] == "deadline_exceeded"
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "deadline_exceeded"


def test_past_max_inflight_is_429(tmp_path, tok, steps):
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake], http=True, max_inflight=1) as h:
            url = f"{h.http_url}/v1/chat/completions"
            first = asyncio.ensure_future(asyncio.to_thread(post, url, chat()))
            while h.servicer.inflight == 0:
                await asyncio.sleep(0.01)
            refused = await asyncio.to_thread(post, url, chat())
            fake.gate.set()
            return refused, await first

    (status, answer), (first_status, _) = asyncio.run(main())
    assert status == 429 and answer["error"]["type"] == "rate_limit_error" and "limit of 1" in answer["error"]["message"]
    assert first_status == 200


def read_then_leave(url: str, body: dict, timeout: float) -> None:
    """Start a request and leave: a stream after its first event, an answer once `timeout` passed."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.readline()
    except TimeoutError:
        pass


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_leaves_cancels_the_verifier_stream(tmp_path, tok, steps, stream):
    async def main():
        fake = FakeVerifier(steps, gated=True)
        async with running(tmp_path, tok, [fake], http=True) as h:
            await asyncio.to_thread(read_then_leave, f"{h.http_url}/v1/chat/completions", chat(stream=stream), 0.5)
            await asyncio.wait_for(fake.cancelled.wait(), 5)
            for _ in range(100):
                if h.servicer.inflight == 0:
                    break
                await asyncio.sleep(0.01)
            count = h.servicer.metrics.registry.get_sample_value
            return (h.servicer.inflight, h.servicer.verifiers[0].inflight,
                    count("treeserve_gateway_requests_total", {"code": "CANCELLED"}),
                    count("treeserve_gateway_http_requests_total", {"route": "/v1/chat/completions", "status": status}))

    # A stream had its status sent; an answer that was never sent counts as 499 (client closed request).
    status = "200" if stream else "499"
    assert asyncio.run(main()) == (0, 0, 1.0, 1.0)


def test_models_health_and_counted_requests(tmp_path, tok, steps):
    def call(h):
        deadline = time.monotonic() + 10  # the gateway follows its verifier's health: until it has seen it serve
        while not h.servicer.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        return (get(f"{h.http_url}/v1/models"), get(f"{h.http_url}/health"),
                post(f"{h.http_url}/v1/chat/completions", chat(n=3)), get(f"{h.http_url}/nowhere"), h)

    models, health, _, _, h = serve_and_call(tmp_path, tok, [FakeVerifier(steps)], call)
    assert models[0] == 200 and models[1]["object"] == "list"
    [model] = models[1]["data"]
    assert (model["id"], model["object"], model["max_model_len"]) == ("fake-smollm2", "model", MAX_CONTEXT)
    assert health[0] == 200 and health[1]["status"] == "SERVING" and health[1]["verifiers"][0]["serving"]
    count = h.servicer.metrics.registry.get_sample_value
    for route, status in [("/v1/models", "200"), ("/health", "200"), ("/v1/chat/completions", "400"),
                          ("other", "404")]:
        assert count("treeserve_gateway_http_requests_total", {"route": route, "status": status}) == 1, route
    (tmp_path / "down").mkdir()
    status, down = serve_and_call(tmp_path / "down", tok, [], lambda h: get(f"{h.http_url}/health"), down=1)
    assert status == 503 and down["status"] == "NOT_SERVING" and not down["verifiers"][0]["serving"]


def test_a_taken_port_stops_the_gateway_with_one_line_before_it_listens(tmp_path, tok, capsys):
    from treeserve.gateway.__main__ import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        code = main(["--listen", f"unix://{tmp_path}/g.sock", "--verifier", f"unix://{tmp_path}/v.sock",
                     "--http", address])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"treeserve gateway: error: cannot serve HTTP on {address}: ")
    assert err.count("\n") == 1 and not (tmp_path / "g.sock").exists()
