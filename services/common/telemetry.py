"""Tracing and metrics for the three services.

Tracing is OpenTelemetry, configured from the standard variables: OTEL_TRACES_EXPORTER (`otlp`, `console` or
`none`; unset means none, so tracing is off by default and costs one flag test per round), OTEL_SERVICE_NAME,
OTEL_SDK_DISABLED and the exporter's own OTEL_EXPORTER_OTLP_* settings. A trace crosses services as W3C trace
context: in gRPC metadata from gateway to verifier, and per request in each DraftItem from verifier to drafter
(the Draft stream is shared by many requests, so its metadata cannot carry one request's context).

Metrics are Prometheus, one registry per service, served over HTTP when the service is given --metrics-listen.
Counters carry no replica label, so rates sum across replicas; Prometheus adds the instance.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Iterable, Mapping, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from treeserve.errors import TreeserveError

log = logging.getLogger("treeserve")

PROPAGATOR = TraceContextTextMapPropagator()
EXPORTERS = ("otlp", "console", "none")


@dataclasses.dataclass(frozen=True)
class Tracing:
    """A tracer plus whether it records; code that builds per-round spans checks `enabled` first."""

    tracer: trace.Tracer
    enabled: bool
    provider: object = None  # the SDK TracerProvider when tracing is on

    @staticmethod
    def off() -> "Tracing":
        return Tracing(trace.NoOpTracer(), False)

    def shutdown(self) -> None:
        """Flush the spans still buffered in the batch processor; call before the process exits."""
        if self.provider is not None:
            self.provider.shutdown()

    def carrier(self, span: trace.Span) -> dict[str, str]:
        """The W3C headers (traceparent, tracestate) that make `span` the parent on the other side."""
        headers: dict[str, str] = {}
        if self.enabled:
            PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return headers

    @staticmethod
    def parent(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> otel_context.Context | None:
        """The context carried by headers (a mapping, or gRPC metadata pairs); None when there is none."""
        pairs = dict(headers.items() if isinstance(headers, Mapping) else headers)
        return PROPAGATOR.extract(pairs) if "traceparent" in pairs else None


def tracing_from_env(service: str) -> Tracing:
    """The process's tracing, as the OTEL_* variables ask. Raises TreeserveError for an unknown exporter, or
    for otlp without its exporter package."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() or "none"
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter_name == "none":
        return Tracing.off()
    if exporter_name not in EXPORTERS:
        raise TreeserveError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: use one of {', '.join(EXPORTERS)}")
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TreeserveError("OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install "
                                 "'treeserve[otlp]'") from None
        exporter = OTLPSpanExporter()
    else:
        exporter = ConsoleSpanExporter()
    # Attributes given here win over OTEL_SERVICE_NAME in Resource.create, so the variable is applied by hand.
    name = os.environ.get("OTEL_SERVICE_NAME") or f"treeserve-{service}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: %s exporter, service %s", exporter_name, name)
    return Tracing(provider.get_tracer("treeserve"), True, provider)


def serve_metrics(listen: str, registry: CollectorRegistry):
    """Serve `registry` at http://listen/metrics from a daemon thread; returns the HTTP server."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise TreeserveError(f"bad --metrics-listen {listen!r}: use host:port, e.g. 0.0.0.0:9464")
    try:
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
    except OSError as error:
        raise TreeserveError(f"cannot serve metrics on {listen}: {error}") from None
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", server.server_port)
    return server


def start_telemetry(service: str, metrics, metrics_listen: str) -> Tracing:
    """A service's telemetry at startup: its `metrics` served at `metrics_listen` (when given), and its tracing
    as the OTEL_* variables ask."""
    if metrics_listen:
        serve_metrics(metrics_listen, metrics.registry)
    return tracing_from_env(service)


# Round phases take from tens of microseconds (transport on a Unix socket) to seconds (a big CPU forward). The
# buckets are 0.05-1 ms wide from 0.1 to 5 ms, where a small target's phases lie on a GPU: a phase's median read
# from them (round_phase_medians) is within its bucket's width.
ROUND_PHASES = ("draft", "transport", "verify", "round", "round_with_prompts")
PHASE_BUCKETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 2.5e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4, 8e-4, 9e-4, 1e-3, 1.2e-3, 1.4e-3,
                 1.6e-3, 1.8e-3, 2e-3, 2.5e-3, 3e-3, 3.5e-3, 4e-3, 5e-3, 7.5e-3, 0.01, 0.015, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BudgetCounters(NamedTuple):
    """VerifierMetrics' counters of one round budget label."""

    rounds: Counter
    checked_rounds: Counter
    expected_tokens: Counter
    realized_tokens: Counter
    expected_seconds: Counter
    realized_seconds: Counter
    drafters_seconds: Counter  # of the realized: the wait on the drafters' round trips
    verify_seconds: Counter  # of the realized: the forward, the commits and the messages out


class VerifierMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.drafts = Counter("treeserve_drafts", "Draft trees verified", registry=r)
        self.draft_tokens = Counter("treeserve_draft_tokens", "Drafted tree nodes verified, roots excluded",
                                    registry=r)
        self.accepted_tokens = Counter("treeserve_accepted_tokens", "Drafted tokens the target accepted",
                                       registry=r)
        self.accepted_by_position = Counter(
            "treeserve_accepted_tokens_by_position",
            "Rounds whose accepted path reached this depth (1 = the first drafted token was accepted)",
            ["position"], registry=r)
        self.round_seconds = Histogram(
            "treeserve_round_seconds", "Round time by phase: draft (drafter compute), transport (round trip to "
            "the drafter minus its compute), verify (target forward and acceptance), round (the whole round, "
            "scheduling included), round_with_prompts (the same, of the rounds that prefill a prompt)", ["phase"],
            buckets=PHASE_BUCKETS, registry=r)
        # Bound once: a labels() lookup in every round is a visible part of a small target's round.
        self.phase_seconds = {phase: self.round_seconds.labels(phase=phase) for phase in ROUND_PHASES}
        self.generated_tokens = Counter("treeserve_generated_tokens", "Tokens committed to outputs", registry=r)
        self.requests = Counter("treeserve_verifier_requests", "Requests that ended, by how", ["outcome"],
                                registry=r)
        self.running = Gauge("treeserve_verifier_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("treeserve_verifier_waiting_requests", "Requests waiting for a batch slot",
                             registry=r)
        self.kv_slots = Gauge("treeserve_verifier_kv_slots", "KV cache token slots held by requests", registry=r)
        self.round_budget = Gauge("treeserve_verifier_round_budget",
                                  "The tree budget adaptive speculation chose for the last round (0: plain)",
                                  registry=r)
        self.rounds_by_budget = Counter("treeserve_verifier_rounds_by_budget",
                                        "Rounds by the tree budget adaptive speculation chose (0: plain; lookup-N: "
                                        "prompt lookup's trees alone)", ["budget"], registry=r)
        self.plain_admissions = Counter(
            "treeserve_verifier_plain_admissions", "Requests that asked for trees and decode plainly: adaptive "
            "speculation found drafting does not pay at the batch they joined", registry=r)
        self.drafting_stopped = Counter(
            "treeserve_verifier_drafting_stopped", "Requests that stopped drafting mid-stream and decode plainly: "
            "adaptive speculation found drafting does not pay at their batch", registry=r)
        # Adaptive speculation's model against what came of it, in the rounds it can be checked on (a round with a
        # prompt in it does other work besides): by the budget chosen, the tokens and seconds each round was
        # expected to take, and what it emitted and took.
        self.checked_rounds = Counter(
            "treeserve_verifier_checked_rounds", "Adaptive speculation: rounds without a prompt in them, by the "
            "budget chosen", ["budget"], registry=r)
        self.checked_tokens = Counter(
            "treeserve_verifier_checked_tokens", "Adaptive speculation: tokens those rounds were expected to emit "
            "(kind=expected) and emitted (kind=realized)", ["budget", "kind"], registry=r)
        self.checked_seconds = Counter(
            "treeserve_verifier_checked_seconds", "Adaptive speculation: seconds those rounds were expected to take "
            "(kind=expected) and took (kind=realized), and of what they took, the wait on the drafters "
            "(kind=drafters) and the forward with its commits (kind=verify)", ["budget", "kind"], registry=r)
        self._by_budget: dict[str, BudgetCounters] = {}
        self.realized_over_expected = Gauge(
            "treeserve_verifier_realized_over_expected", "Adaptive speculation: drafted tokens that recent "
            "speculative rounds at this batch bucket emitted over what its model expected (it scales the model)",
            ["batch"], registry=r)

    def by_budget(self, label: str) -> "BudgetCounters":
        """The counters of rounds at this budget label, bound once per label: six labels() lookups in every round
        are a visible part of a small target's round."""
        found = self._by_budget.get(label)
        if found is None:
            found = self._by_budget[label] = BudgetCounters(
                self.rounds_by_budget.labels(budget=label), self.checked_rounds.labels(budget=label),
                *(self.checked_tokens.labels(budget=label, kind=kind) for kind in ("expected", "realized")),
                *(self.checked_seconds.labels(budget=label, kind=kind)
                  for kind in ("expected", "realized", "drafters", "verify")))
        return found

    def record_trees(self, trees: list[tuple[int, int]]) -> None:
        """A round's verified trees, as (drafted nodes, accepted depth) per request (0 drafted: a plain step,
        not counted). Counted once per round, not per request: a counter update per request and accepted
        position is a visible part of a large batch's round."""
        drafted = [(nodes, accepted) for nodes, accepted in trees if nodes > 0]
        if not drafted:
            return
        self.drafts.inc(len(drafted))
        self.draft_tokens.inc(sum(nodes for nodes, _ in drafted))
        self.accepted_tokens.inc(sum(accepted for _, accepted in drafted))
        reached = collections.Counter(depth for _, accepted in drafted for depth in range(1, accepted + 1))
        for depth, count in reached.items():
            self.accepted_by_position.labels(position=str(depth)).inc(count)


class DrafterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.streams = Gauge("treeserve_drafter_streams", "Open Draft streams (one per verifier)", registry=r)
        self.contexts = Gauge("treeserve_drafter_contexts", "Request contexts held", registry=r)
        self.rounds = Counter("treeserve_drafter_rounds", "Batched draft rounds answered", registry=r)
        self.trees = Counter("treeserve_drafter_trees", "Trees proposed", registry=r)
        self.tree_nodes = Counter("treeserve_drafter_tree_nodes", "Tree nodes proposed, roots excluded", registry=r)
        self.propose_seconds = Histogram("treeserve_drafter_propose_seconds", "Compute time of one batched round",
                                         buckets=PHASE_BUCKETS, registry=r)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("treeserve_gateway_requests", "Requests that ended, by gRPC status (those that came "
                                "over HTTP too)", ["code"], registry=r)
        self.http_requests = Counter("treeserve_gateway_http_requests", "HTTP requests answered, by route and HTTP "
                                     "status", ["route", "status"], registry=r)
        self.inflight = Gauge("treeserve_gateway_inflight_requests", "Requests in flight", registry=r)
        self.output_tokens = Counter("treeserve_gateway_output_tokens", "Tokens streamed to clients", registry=r)
        self.time_to_first_token = Histogram("treeserve_gateway_time_to_first_token_seconds",
                                             "From request to the first streamed token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.request_seconds = Histogram("treeserve_gateway_request_seconds", "From request to its final message",
                                         buckets=LATENCY_BUCKETS, registry=r)


@dataclasses.dataclass
class RoundTotals:
    """A verifier's round counters at one moment, from one scrape of its Prometheus metrics."""

    phases: dict[str, tuple[float, float]]  # phase -> (seconds, rounds) so far, `treeserve_round_seconds`
    budgets: dict[str, float]  # adaptive speculation: rounds so far by its choice's label (empty without it)
    plain_admissions: float = 0.0  # adaptive speculation: requests that asked for trees and decode plainly
    drafting_stopped: float = 0.0  # adaptive speculation: requests that stopped drafting mid-stream
    # adaptive speculation, rounds without a prompt: choice label -> {"rounds", "expected_tokens",
    # "realized_tokens", "expected_s", "realized_s"} so far
    checked: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # phase -> {bucket's upper bound in seconds (inf last): rounds so far at or below it}
    phase_buckets: dict[str, dict[float, float]] = dataclasses.field(default_factory=dict)


def round_totals(metrics_address: str) -> RoundTotals:
    """The counters of the verifier serving its metrics at http://metrics_address/metrics."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    sums = dict(re.findall(r'treeserve_round_seconds_sum{phase="(\w+)"} (\S+)', text))
    counts = dict(re.findall(r'treeserve_round_seconds_count{phase="(\w+)"} (\S+)', text))
    budgets = re.findall(r'treeserve_verifier_rounds_by_budget_total{budget="([\w-]+)"} (\S+)', text)

    def total(name: str) -> float:  # a counter without labels; 0 when the verifier does not have it
        found = re.search(rf"^treeserve_verifier_{name}_total (\S+)", text, re.M)
        return float(found.group(1)) if found else 0.0

    checked: dict[str, dict[str, float]] = {}
    for budget, count in re.findall(r'treeserve_verifier_checked_rounds_total{budget="([\w-]+)"} (\S+)', text):
        checked.setdefault(budget, {})["rounds"] = float(count)
    for what, unit in (("tokens", "tokens"), ("seconds", "s")):
        for budget, kind, value in re.findall(
                rf'treeserve_verifier_checked_{what}_total{{budget="([\w-]+)",kind="(\w+)"}} (\S+)', text):
            checked.setdefault(budget, {})[f"{kind}_{unit}"] = float(value)
    phase_buckets: dict[str, dict[float, float]] = {}
    for bound, phase, count in re.findall(r'treeserve_round_seconds_bucket{le="([^"]+)",phase="(\w+)"} (\S+)', text):
        phase_buckets.setdefault(phase, {})[float(bound)] = float(count)
    return RoundTotals({phase: (float(sums[phase]), float(counts[phase])) for phase in sums},
                       {budget: float(count) for budget, count in budgets},
                       total("plain_admissions"), total("drafting_stopped"), checked, phase_buckets)


def round_phase_means(before: RoundTotals, after: RoundTotals) -> dict[str, float]:
    """Mean milliseconds per round of each phase between two snapshots."""
    means = {}
    for phase, (seconds, count) in after.phases.items():
        seconds0, count0 = before.phases.get(phase, (0.0, 0.0))
        if count > count0:
            means[phase] = round((seconds - seconds0) / (count - count0) * 1000, 3)
    return means


def round_phase_medians(before: RoundTotals, after: RoundTotals) -> dict[str, float]:
    """Median milliseconds of each phase's rounds between two snapshots, read from the histogram's buckets
    (linearly within the bucket that holds it). Beside the means: a few slow rounds (a new prompt's) move a mean,
    and a bound on a round's phase is a bound on its median."""
    medians = {}
    for phase, cumulative in after.phase_buckets.items():
        earlier = before.phase_buckets.get(phase, {})
        counts = [(bound, total - earlier.get(bound, 0.0)) for bound, total in sorted(cumulative.items())]
        rounds = counts[-1][1] if counts else 0.0
        if rounds <= 0:
            continue
        lower, below = 0.0, 0.0
        for bound, at_or_below in counts:
            if at_or_below >= rounds / 2:
                if bound == float("inf"):  # past the last finite bound: that bound is all one can say
                    medians[phase] = round(lower * 1000, 3)
                else:
                    share = (rounds / 2 - below) / (at_or_below - below)
                    medians[phase] = round((lower + share * (bound - lower)) * 1000, 3)
                break
            lower, below = bound, at_or_below
    return medians


def round_phases(before: RoundTotals, after: RoundTotals) -> dict[str, dict[str, float]]:
    """A bench row's round phases between two snapshots: `round_ms` (means) and `round_ms_p50` (medians)."""
    return {"round_ms": round_phase_means(before, after), "round_ms_p50": round_phase_medians(before, after)}


def choice_order(label: str) -> tuple[bool, int]:
    """Choice labels in order: the drafter's own budgets by size (0: plain), then lookup's."""
    lookup = label.startswith("lookup-")
    return lookup, int(label.removeprefix("lookup-"))


def rounds_by_budget(before: RoundTotals, after: RoundTotals) -> dict[str, int]:
    """Rounds between two snapshots by the choice adaptive speculation made (those it made at least once), by its
    label (`Choice.label`: the budget, `lookup-` before it for prompt lookup's trees alone)."""
    counts = {budget: int(count - before.budgets.get(budget, 0.0)) for budget, count in after.budgets.items()}
    return {budget: counts[budget] for budget in sorted(counts, key=choice_order) if counts[budget]}


def checked_by_budget(before: RoundTotals, after: RoundTotals) -> dict[str, dict[str, float]]:
    """Adaptive speculation's rounds without a prompt between two snapshots, by the choice's label: how many, and
    per round the tokens and milliseconds it expected of them and what they emitted and took; of what they took,
    the wait on the drafters and the forward with its commits (the rest: the choice, the plans, the Draft
    messages, the scheduling)."""
    found = {}
    for budget, totals in sorted(after.checked.items(), key=lambda item: choice_order(item[0])):
        earlier = before.checked.get(budget, {})
        change = {key: value - earlier.get(key, 0.0) for key, value in totals.items()}
        rounds = change.get("rounds", 0.0)
        if rounds:
            def per_round(key: str, scale: float = 1.0) -> float:
                return round(change.get(key, 0.0) / rounds * scale, 3)

            found[budget] = {"rounds": int(rounds),
                             "expected_tokens": per_round("expected_tokens"),
                             "realized_tokens": per_round("realized_tokens"),
                             "expected_ms": per_round("expected_s", 1000), "realized_ms": per_round("realized_s", 1000),
                             "drafters_ms": per_round("drafters_s", 1000), "verify_ms": per_round("verify_s", 1000)}
    return found


def percentile(values: list[float], percent: float) -> float | None:
    """The nearest-rank percentile of `values` (None when there are none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]
