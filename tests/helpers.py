"""Helpers that several test modules share (imported as `helpers`; test modules import no other test module):
the three services as local processes on Unix sockets, or under `treeserve up`, with requests through the gateway
and their metrics, and the comparison of two greedy outputs up to a near-tie of the target."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
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
        """The verifier, drafting every request's trees (fixed speculation) unless `extra` says otherwise: what
        these tests check of trees and drafters must not wait on the adaptive policy choosing to draft."""
        speculation = [] if "--speculation" in extra else ["--speculation", "fixed"]
        self.verifier = self.stack.start("verifier", [
            "--target", self.target_path, "--drafter", self.drafter, "--default-budget", "8",
            "--draft-timeout-s", "1", "--metrics-listen", f"127.0.0.1:{self.verifier_metrics}", *speculation, *extra])
        return self.verifier

    def start_gateway(self, verifier: str, *extra: str) -> str:
        self.gateway_metrics = free_port()
        self.gateway = self.stack.start("gateway", ["--target", self.target_path, "--verifier", verifier,
                                                    "--metrics-listen", f"127.0.0.1:{self.gateway_metrics}", *extra])
        return self.gateway

    def process(self, name: str):
        return self.stack.children[name][0]

    def idle(self) -> tuple[dict, dict, dict] | None:
        """The verifier's, drafter's and gateway's metrics once nothing is held: no request running or waiting,
        no KV slot, no drafter context, nothing in flight at the gateway; None while something is (or a service
        does not answer)."""
        try:
            verifier, drafter, gateway = (scrape(port) for port in (
                self.verifier_metrics, self.drafter_metrics, self.gateway_metrics))
        except (OSError, urllib.error.URLError):
            return None
        held = [verifier[("treeserve_verifier_kv_slots", ())], verifier[("treeserve_verifier_running_requests", ())],
                verifier[("treeserve_verifier_waiting_requests", ())], drafter[("treeserve_drafter_contexts", ())],
                gateway[("treeserve_gateway_inflight_requests", ())]]
        return None if any(held) else (verifier, drafter, gateway)

    def wait_idle(self, timeout_s: float = 10.0) -> tuple[dict, dict, dict]:
        return wait_for(self.idle, timeout_s, what="every service to hold nothing")


def counter(metrics: dict, name: str, **labels) -> float:
    """A counter's value in a scrape (0 before its first increment)."""
    return metrics.get((f"{name}_total", tuple(sorted(labels.items()))), 0.0)


class HealthWatch:
    """Checks a gateway every 50 ms from another thread until stopped: that its Unix socket exists and its health
    is SERVING. `lapses` lists what was seen otherwise."""

    def __init__(self, address: str):
        self.address, self.socket = address, address.removeprefix("unix://")
        self.lapses: list[str] = []
        self.checks = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            if not os.path.exists(self.socket):
                self.lapses.append("socket gone")
            elif (status := health(self.address)) != SERVING:
                self.lapses.append(f"health {status}")
            self.checks += 1

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def expected(target, prompt: str, max_new_tokens: int) -> list[int]:
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return generate(target.model, target.tokenizer, target.tokenizer.encode(prompt), params).token_ids


# ------------------------------------------------------------------------------------------ treeserve up


def start_up(target: str, *flags: str, **kwargs) -> tuple[subprocess.Popen, str]:
    """`treeserve up` on `target`, once it prints the gateway's address: (the process, that address)."""
    up = subprocess.Popen([sys.executable, "-m", "treeserve", "up", "--target", target, "--grace-s", "2",
                           "--max-batch", "4", "--cuda-graphs", "off", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    line = up.stdout.readline()  # printed once all three serve
    assert line.startswith("gateway: unix://"), (line, up.stderr.read() if up.poll() is not None else "")
    return up, line.split(": ", 1)[1].strip()


def stop_up(up: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM to `up`: its exit code and what it wrote on stderr."""
    up.send_signal(signal.SIGTERM)
    _, errors = up.communicate(timeout=60)
    return up.returncode, errors


def service_pid(service: str, runtime) -> int | None:
    """The process id of the `service` that `up` started in `runtime` (None while there is none)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"treeserve.{service}" in argv and any(str(runtime) in arg for arg in argv):
            return int(entry)
    return None


# ------------------------------------------------------------------------------------------ greedy outputs


def assert_equal_or_near_tie(model, prompt, reference, output, tolerance):
    """Outputs agree up to the first difference, and there the two tokens' logits are within tolerance."""
    same = first_divergence(reference, output)
    if same is None:
        return
    assert same < min(len(reference), len(output)), f"one output ended at {same} where the other went on"
    gap = logit_gap(model, prompt + reference[:same], reference[same], output[same])
    assert gap.near_tie(tolerance), f"divergence at {same} with logit gap {gap.gap}"
