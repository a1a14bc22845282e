"""Tracing and metrics: one trace across gateway, verifier and drafter (in-process, in-memory exporter), metrics
that add up, and exporters chosen by the standard OTEL_* variables."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

import tiny_models
from treeserve import telemetry
from treeserve.drafter import NgramDrafter
from treeserve.drafter import server as drafter_server
from treeserve.drafter.server import DrafterServicer
from treeserve.errors import TreeserveError
from treeserve.framing import FramedCall
from treeserve.gateway.server import GatewayServicer, serve as serve_gateway
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.telemetry import Tracing
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from treeserve.verifier import generate
from treeserve.verifier.drafter_link import DrafterLink
from treeserve.verifier import server as verifier_server
from treeserve.verifier.server import VerifierServicer

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(str(tiny_models.write_hf_folder("qwen3", tmp_path_factory.mktemp("model"), seed=0)))


class Stack:
    """Drafter, verifier and gateway served in this process on Unix sockets, sharing one tracing setup: the Draft
    and Session streams as frames on the sockets beside the drafter's and the verifier's, as `treeserve up` runs
    them."""

    def __init__(self, tmp_path, target, tracing: Tracing):
        self.tmp_path, self.target, self.tracing = tmp_path, target, tracing
        self.drafter_metrics = telemetry.DrafterMetrics()
        self.verifier_metrics = telemetry.VerifierMetrics()
        self.gateway_metrics = telemetry.GatewayMetrics()

    async def __aenter__(self):
        drafter = DrafterServicer(NgramDrafter(), tracing=self.tracing, metrics=self.drafter_metrics)
        self.drafter = await drafter_server.start(f"unix://{self.tmp_path}/drafter.sock", drafter)
        self.link = DrafterLink(self.drafter.address, timeout_s=5.0)
        verifier = VerifierServicer("tiny", [self.link], default_budget=8, default_max_new_tokens=16, max_batch=8,
                                    tracing=self.tracing, metrics=self.verifier_metrics)
        self.verifier = await verifier_server.start(f"unix://{self.tmp_path}/verifier.sock", verifier)
        self.scheduler = verifier.attach(self.target)
        self.scheduler_task = asyncio.ensure_future(self.scheduler.run())
        await self.scheduler.connect(self.link)
        await self.verifier.set_serving(True)  # as the verifier's main does once loaded: the gateway follows it
        self.gateway_servicer = GatewayServicer(self.target.tokenizer, [self.verifier.address], tracing=self.tracing,
                                                metrics=self.gateway_metrics)
        self.gateway, ready = await serve_gateway(f"unix://{self.tmp_path}/gateway.sock", self.gateway_servicer)
        await ready
        self.channel = grpc.aio.insecure_channel(self.gateway.address)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.gateway.stop(0)
        await self.gateway_servicer.close()
        self.scheduler_task.cancel()
        await self.verifier.stop(0)
        await self.link.close()
        await self.drafter.stop(0)

    async def generate(self, prompt: str, max_new_tokens: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(prompt=prompt, stop=generation_pb2.StopConditions(
            max_new_tokens=max_new_tokens, ignore_eos=True))
        return [t async for reply in self.stub.Generate(request) for t in reply.token_ids]


def expected(target, prompt: str, max_new_tokens: int) -> list[int]:
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return generate(target.model, target.tokenizer, target.tokenizer.encode(prompt), params).token_ids


def test_one_trace_holds_spans_of_all_three_services(tmp_path, target):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider.get_tracer("test"), True, provider)

    async def main():
        async with Stack(tmp_path, target, tracing) as stack:
            tokens = await stack.generate(PROMPT, 12)
            return tokens, stack.gateway_servicer.verifiers[0]._session.call, stack.link.call

    tokens, session, draft = asyncio.run(main())
    assert tokens == expected(target, PROMPT, 12)
    assert isinstance(session, FramedCall) and isinstance(draft, FramedCall)  # the trace went through frames
    spans = exporter.get_finished_spans()
    assert len({span.context.trace_id for span in spans}) == 1, "every span belongs to the request's trace"
    by_id = {span.context.span_id: span for span in spans}
    names = [span.name for span in spans]
    assert names.count("gateway.generate") == names.count("verifier.generate") == names.count("verifier.prefill") == 1
    rounds = [span for span in spans if span.name == "verifier.round"]
    proposes = [span for span in spans if span.name == "drafter.propose"]
    assert rounds and proposes
    parent = {span.name: by_id[span.parent.span_id].name for span in spans if span.parent is not None}
    assert "gateway.generate" not in parent  # the root
    assert parent == {"verifier.generate": "gateway.generate", "verifier.prefill": "verifier.generate",
                      "verifier.round": "verifier.generate", "drafter.propose": "verifier.round"}
    # Every round after the prefill committed tokens; together with the prefill's first token, the whole output.
    assert 1 + sum(span.attributes["treeserve.committed"] for span in rounds) == 12
    assert all(span.attributes["treeserve.accepted"] <= span.attributes["treeserve.tree_nodes"] for span in rounds)


def samples(registry) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as Prometheus would scrape them."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_add_up_and_a_cancelled_stream_frees_its_kv(tmp_path, target):
    prompts = [PROMPT, "one two three one two three one two three", "a b a b a b a b"]

    async def main():
        async with Stack(tmp_path, target, Tracing.off()) as stack:
            outputs = await asyncio.gather(*(stack.generate(p, 16) for p in prompts))
            # A stream cancelled after its first message: its KV and its drafter context are released.
            request = gateway_pb2.GenerateRequest(prompt=PROMPT, stop=generation_pb2.StopConditions(
                max_new_tokens=200, ignore_eos=True))
            call = stack.stub.Generate(request)
            await call.read()
            assert samples(stack.verifier_metrics.registry)[("treeserve_verifier_kv_slots", ())] > 0
            call.cancel()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not stack.scheduler.running and not stack.scheduler.waiting:
                    break
            await stack.generate("x y", 2)  # one more round tells the drafter to forget the cancelled request
            with pytest.raises(grpc.aio.AioRpcError):
                await stack.generate("", 2)
            return outputs, stack

    outputs, stack = asyncio.run(main())
    for prompt, output in zip(prompts, outputs):
        assert output == expected(target, prompt, 16)
    verifier = samples(stack.verifier_metrics.registry)
    drafter = samples(stack.drafter_metrics.registry)
    gateway = samples(stack.gateway_metrics.registry)
    assert verifier[("treeserve_verifier_kv_slots", ())] == 0
    assert verifier[("treeserve_verifier_running_requests", ())] == 0
    assert verifier[("treeserve_verifier_requests_total", (("outcome", "cancelled"),))] == 1
    assert verifier[("treeserve_verifier_requests_total", (("outcome", "length"),))] == 4
    assert drafter[("treeserve_drafter_contexts", ())] == 0
    by_position = {int(dict(labels)["position"]): value for (name, labels), value in verifier.items()
                   if name == "treeserve_accepted_tokens_by_position_total"}
    accepted = verifier[("treeserve_accepted_tokens_total", ())]
    assert accepted > 0 and sum(by_position.values()) == accepted
    assert all(by_position[k] >= by_position.get(k + 1, 0) for k in by_position)  # a depth needs the one above
    assert by_position[1] <= verifier[("treeserve_drafts_total", ())]
    # Verified nodes can be fewer than proposed: trees are cut near max_new_tokens, and a cancel drops one.
    assert 0 < verifier[("treeserve_draft_tokens_total", ())] <= drafter[("treeserve_drafter_tree_nodes_total", ())]
    for phase in ("draft", "transport", "verify"):
        assert verifier[("treeserve_round_seconds_count", (("phase", phase),))] > 0
    assert gateway[("treeserve_gateway_requests_total", (("code", "OK"),))] == 4
    assert gateway[("treeserve_gateway_requests_total", (("code", "CANCELLED"),))] == 1
    assert gateway[("treeserve_gateway_requests_total", (("code", "INVALID_ARGUMENT"),))] == 1
    assert gateway[("treeserve_gateway_inflight_requests", ())] == 0
    assert gateway[("treeserve_gateway_output_tokens_total", ())] >= 3 * 16 + 2


def test_a_rounds_trees_are_counted_together():
    metrics = telemetry.VerifierMetrics()
    metrics.record_trees([(4, 2), (0, 0), (3, 3), (1, 0)])  # the plain step (0 drafted) is not a tree
    metrics.record_trees([])
    value = metrics.registry.get_sample_value
    assert value("treeserve_drafts_total") == 3
    assert value("treeserve_draft_tokens_total") == 8
    assert value("treeserve_accepted_tokens_total") == 5
    assert {depth: value("treeserve_accepted_tokens_by_position_total", {"position": str(depth)})
            for depth in (1, 2, 3, 4)} == {1: 2, 2: 2, 3: 1, 4: None}


def test_metrics_are_served_over_http(tmp_path):
    metrics = telemetry.DrafterMetrics()
    metrics.trees.inc(3)
    server = telemetry.serve_metrics("127.0.0.1:0", metrics.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
    assert "treeserve_drafter_trees_total 3.0" in text
    with pytest.raises(TreeserveError, match="host:port"):
        telemetry.serve_metrics("nonsense", metrics.registry)


def test_round_totals_read_a_verifiers_rounds_from_its_metrics():
    """What `treeserve bench --verifier-metrics` reads: round phases, rounds by adaptive budget, plain admissions,
    requests that stopped drafting, and adaptive speculation's expectations beside its rounds."""
    metrics = telemetry.VerifierMetrics()
    for seconds in (0.010, 0.030):
        metrics.round_seconds.labels(phase="round").observe(seconds)
    metrics.rounds_by_budget.labels(budget="0").inc(2)
    metrics.rounds_by_budget.labels(budget="lookup-4").inc(4)
    metrics.rounds_by_budget.labels(budget="16").inc()
    metrics.plain_admissions.inc(5)
    metrics.drafting_stopped.inc(3)
    server = telemetry.serve_metrics("127.0.0.1:0", metrics.registry)
    try:
        before = telemetry.round_totals(f"127.0.0.1:{server.server_port}")
        for expected, realized in ((8.0, 9.0), (10.0, 7.0)):  # two checked rounds at budget 4
            metrics.checked_rounds.labels(budget="4").inc()
            metrics.checked_tokens.labels(budget="4", kind="expected").inc(expected)
            metrics.checked_tokens.labels(budget="4", kind="realized").inc(realized)
            metrics.checked_seconds.labels(budget="4", kind="expected").inc(0.002)
            metrics.checked_seconds.labels(budget="4", kind="realized").inc(0.003)
            metrics.checked_seconds.labels(budget="4", kind="drafters").inc(0.001)
            metrics.checked_seconds.labels(budget="4", kind="verify").inc(0.0015)
        totals = telemetry.round_totals(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert totals.phases["round"] == (pytest.approx(0.040), 2.0)
    assert totals.budgets == {"0": 2.0, "16": 1.0, "lookup-4": 4.0}
    assert totals.plain_admissions == 5.0 and totals.drafting_stopped == 3.0
    # In order: plain, the drafter's own trees by budget, then prompt lookup's.
    assert list(telemetry.rounds_by_budget(before, totals)) == []
    assert list(telemetry.rounds_by_budget(telemetry.RoundTotals({}, {}), totals)) == ["0", "16", "lookup-4"]
    assert before.checked == {}
    assert telemetry.checked_by_budget(before, totals) == {"4": {
        "rounds": 2, "expected_tokens": 9.0, "realized_tokens": 8.0, "expected_ms": 2.0, "realized_ms": 3.0,
        "drafters_ms": 1.0, "verify_ms": 1.5}}


def test_phase_medians_come_from_the_rounds_between_two_scrapes():
    """A phase's median, from the histogram's buckets: only the rounds between the scrapes count, and a few slow
    rounds move the mean but not the median."""
    metrics = telemetry.VerifierMetrics()
    draft = metrics.phase_seconds["draft"]
    for _ in range(9):
        draft.observe(0.050)  # before the first scrape: not the run's
    server = telemetry.serve_metrics("127.0.0.1:0", metrics.registry)
    try:
        before = telemetry.round_totals(f"127.0.0.1:{server.server_port}")
        for seconds in [0.00042] * 7 + [0.00048] * 4 + [0.020] * 2:
            draft.observe(seconds)
        metrics.phase_seconds["verify"].observe(9.0)  # past the last finite bucket
        after = telemetry.round_totals(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    medians, means = telemetry.round_phase_medians(before, after), telemetry.round_phase_means(before, after)
    # 13 rounds: the 6.5th lies in the (0.4, 0.5] ms bucket, which holds 11, at 6.5 / 11 of its width.
    assert medians["draft"] == pytest.approx(0.4 + 0.1 * 6.5 / 11, abs=1e-3)
    assert means["draft"] == pytest.approx((7 * 0.42 + 4 * 0.48 + 2 * 20) / 13, abs=1e-3)
    assert medians["verify"] == 5000.0  # all one can say: above the last finite bound
    assert "round" not in medians  # no rounds of it between the scrapes


@pytest.mark.parametrize("variables, enabled", [
    ({}, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, True),
])
def test_tracing_follows_the_otel_variables(monkeypatch, variables, enabled):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    tracing = telemetry.tracing_from_env("drafter")
    assert tracing.enabled == enabled
    if enabled:
        assert tracing.provider.resource.attributes["service.name"] == "treeserve-drafter"
    tracing.shutdown()


def test_unknown_exporter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(TreeserveError, match="OTEL_TRACES_EXPORTER"):
        telemetry.tracing_from_env("gateway")


def test_service_name_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    tracing = telemetry.tracing_from_env("gateway")
    assert tracing.provider.resource.attributes["service.name"] == "edge-gateway"
    tracing.shutdown()
