"""Helpers that several test modules share (imported as `helpers`; test modules import no other test module):
the three services as local processes on Unix sockets, with requests through the gateway and their metrics, and
the comparison of two greedy outputs up to a near-tie of the target."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from treeserve.bench.near_ties import logit_gap
from treeserve.cli.launcher import Stack
from treeserve.divergence import first_divergence
from treeserve.params import GenerationParams
from treeserve.serving import client_options, free_port
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from treeserve.verifier import generate

# ------------------------------------------------------------------------------------------ the three services

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
    async with grpc.aio.insecure_channel(address, options=client_options()) as channel:
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
        self.drafter_metrics = free_port()

    def start_drafter(self) -> str:
        self.drafter = self.stack.start("drafter", ["--kind", "ngram", "--grace-s", "1",
                                                         "--metrics-listen", f"127.0.0.1:{self.drafter_metrics}"])
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


def expected(target, prompt: str, max_new_tokens: int) -> list[int]:
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return generate(target.model, target.tokenizer, target.tokenizer.encode(prompt), params).token_ids


# ------------------------------------------------------------------------------------------ greedy outputs


def assert_equal_or_near_tie(model, prompt, reference, output, tolerance):
    """Outputs agree up to the first difference, and there the two tokens' logits are within tolerance."""
    same = first_divergence(reference, output)
    if same is None:
        return
    assert same < min(len(reference), len(output)), f"one output ended at {same} where the other went on"
    gap = logit_gap(model, prompt + reference[:same], reference[same], output[same])
    assert gap.near_tie(tolerance), f"divergence at {same} with logit gap {gap.gap}"
