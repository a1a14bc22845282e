"""The official `openai` package against the three services (real processes, a tiny model on the CPU), the
gateway's HTTP API open: the same tokens as `treeserve client` at temperature 0, streamed or not, with usage and
speculation stats; bad requests refused; 429 past --max-inflight; a client that leaves frees its KV."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

import tiny_models
from helpers import PROMPTS, SERVING, Services, health, scrape, wait_for
from treeserve.serving import free_port

pytestmark = pytest.mark.slow

PROMPT = PROMPTS[0]
MAX_TOKENS = 24
MAX_INFLIGHT = 2
CONTEXT = 8192  # room for a stream the verifier takes seconds to finish, so that it is cancelled midway
LONG = 4000


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    model = tiny_models.write_hf_folder("qwen3", tmp_path_factory.mktemp("model"), seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    services = Services(tmp_path_factory.mktemp("run"), str(model))
    services.http_port = free_port()
    services.start_drafter()
    services.start_verifier()
    # A long grace period: the stream that the last test drains must end within it on a loaded machine.
    services.start_gateway(services.verifier, "--http", f"127.0.0.1:{services.http_port}", "--max-inflight",
                           str(MAX_INFLIGHT), "--grace-s", "60")
    wait_for(lambda: health(services.gateway) == SERVING, what="the gateway")
    yield services
    services.stack.stop(grace_s=1)


@pytest.fixture(scope="module")
def client(services):
    # No retries: a 429 is to be seen, not retried.
    with openai.OpenAI(base_url=f"http://127.0.0.1:{services.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(client, services):
    [served] = client.models.list().data
    assert served.id == services.target_path and served.model_extra["max_model_len"] == CONTEXT
    return served.id


def treeserve_client(address: str, *flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "treeserve", "client", "--address", address, "--prompt", PROMPT,
                           "--max-new-tokens", str(MAX_TOKENS), "--json", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def reference(services):
    """What `treeserve client --chat` (the gRPC door) yields for PROMPT, and without --chat."""
    return {"chat": treeserve_client(services.gateway, "--chat"), "plain": treeserve_client(services.gateway)}


def check_stats(metrics: dict, completion_tokens: int) -> None:
    """The speculation stats, under vLLM's names: the prefill emits the first token, the rounds the rest."""
    stats = metrics["speculative_decoding"]
    assert stats["num_spec_steps"] >= 1 and stats["num_draft_tokens"] >= 0
    assert stats["mean_acceptance_length"] * stats["num_spec_steps"] == pytest.approx(completion_tokens - 1)
    assert stats["num_accepted_draft_tokens"] == completion_tokens - 1 - stats["num_spec_steps"]
    assert 0 <= stats["draft_acceptance_rate"] <= 1


def test_a_streamed_chat_completion_yields_the_tokens_of_the_grpc_client(client, model, reference):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(d.delta.content or "" for d in deltas) == reference["chat"]["text"]
    assert sum((d.model_extra.get("token_ids", []) for d in deltas), []) == reference["chat"]["token_ids"]
    assert [d.finish_reason for d in deltas if d.finish_reason] == [reference["chat"]["finish_reason"]]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(reference["chat"]["token_ids"])
    assert last.usage.prompt_tokens == reference["chat"]["prompt_tokens"]
    check_stats(last.model_extra["metrics"], last.usage.completion_tokens)


def test_a_chat_completion_not_streamed_likewise(client, model, reference):
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"return_token_ids": True})
    [choice] = answer.choices
    assert choice.message.content == reference["chat"]["text"] and choice.finish_reason == reference["chat"][
        "finish_reason"]
    assert choice.model_extra["token_ids"] == reference["chat"]["token_ids"]
    assert answer.usage.completion_tokens == len(reference["chat"]["token_ids"])
    check_stats(answer.model_extra["metrics"], answer.usage.completion_tokens)


def test_a_completion_yields_the_tokens_of_the_grpc_client_without_chat(client, model, reference):
    answer = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"return_token_ids": True})
    assert answer.choices[0].text == reference["plain"]["text"]
    assert answer.choices[0].model_extra["token_ids"] == reference["plain"]["token_ids"]
    check_stats(answer.model_extra["metrics"], answer.usage.completion_tokens)


@pytest.mark.parametrize("fields, named", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                                                        "tools"),
    ({"messages": []}, "messages"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": CONTEXT}, "context"),
    ({"temperature": -0.5}, "temperature"),
], ids=["n", "logprobs", "tools", "empty-messages", "max-tokens-0", "max-tokens-over-context", "temperature"])
def test_bad_requests_get_400_with_a_message(client, model, fields, named):
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request)
    assert refused.value.status_code == 400 and named in refused.value.message


def test_malformed_json_gets_400(services):
    request = urllib.request.Request(f"http://127.0.0.1:{services.http_port}/v1/chat/completions",
                                     data=b'{"messages": [', headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert "not valid JSON" in json.loads(refused.value.read())["error"]["message"]


@contextlib.contextmanager
def verifier_paused(services):
    """The verifier stopped (SIGSTOP) meanwhile: what the gateway has in flight stays in flight, however fast the
    tiny model would finish it."""
    verifier = services.process("verifier")
    verifier.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        verifier.send_signal(signal.SIGCONT)


def gateway_inflight(services) -> float:
    return scrape(services.gateway_metrics)[("treeserve_gateway_inflight_requests", ())]


def kv_back_to_idle(services) -> dict:
    return wait_for(lambda: (m := scrape(services.verifier_metrics))[("treeserve_verifier_kv_slots", ())] == 0 and m,
                    timeout_s=10, what="the verifier to free the requests' KV")


def test_a_client_that_disconnects_mid_stream_frees_its_kv(services, client, model):
    cancelled = ("treeserve_verifier_requests_total", (("outcome", "cancelled"),))
    before = scrape(services.verifier_metrics).get(cancelled, 0)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            temperature=0, max_tokens=LONG, stream=True,
                                            extra_body={"ignore_eos": True, "speculation": {"disabled": True}})
    next(iter(stream))
    assert scrape(services.verifier_metrics)[("treeserve_verifier_kv_slots", ())] > 0
    stream.close()
    after = kv_back_to_idle(services)
    assert after[cancelled] == before + 1 and after[("treeserve_verifier_running_requests", ())] == 0


def test_past_max_inflight_is_429(services, client, model):
    ask = functools.partial(client.chat.completions.create, model=model, max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    with concurrent.futures.ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        with verifier_paused(services):
            held = [pool.submit(ask) for _ in range(MAX_INFLIGHT)]
            wait_for(lambda: gateway_inflight(services) == MAX_INFLIGHT, timeout_s=10, what="the requests admitted")
            with pytest.raises(openai.RateLimitError) as refused:
                ask()
        assert [future.result().choices[0].finish_reason for future in held] == ["length"] * MAX_INFLIGHT
    assert refused.value.status_code == 429 and f"limit of {MAX_INFLIGHT}" in refused.value.message
    assert ask().choices[0].finish_reason == "length"  # a slot is free again


def test_http_requests_are_counted_by_route_and_status(services):
    counted = scrape(services.gateway_metrics)
    for status in ("200", "400", "429"):
        key = ("treeserve_gateway_http_requests_total", (("route", "/v1/chat/completions"), ("status", status)))
        assert counted.get(key, 0) >= 1, status
    assert counted[("treeserve_gateway_http_requests_total", (("route", "/v1/models"), ("status", "200")))] >= 1


def test_sigterm_lets_an_http_stream_finish(services, client, model):
    """Runs last: it stops the module's gateway while a stream is in flight, which still ends complete. The
    verifier is stopped before the request goes out, so the tiny model cannot finish the stream before SIGTERM."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with verifier_paused(services):
            opened = pool.submit(client.chat.completions.create, model=model, temperature=0, max_tokens=60,
                                 messages=[{"role": "user", "content": PROMPT}], stream=True,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
            wait_for(lambda: gateway_inflight(services) == 1, timeout_s=10, what="the stream admitted")
            services.process("gateway").send_signal(signal.SIGTERM)
            wait_for(lambda: health(services.gateway) != SERVING, timeout_s=5, what="the gateway to stop serving")
            assert gateway_inflight(services) == 1  # the stream was under way when SIGTERM came
        chunks = list(opened.result(timeout=60))
    tokens = sum((c.choices[0].model_extra.get("token_ids", []) for c in chunks if c.choices), [])
    assert len(tokens) == 60 and chunks[-1].choices[0].finish_reason == "length"
    assert services.process("gateway").wait(timeout=15) == 0
