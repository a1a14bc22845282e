"""Torch profiler traces of a service's rounds, and what a trace says of each round's timeline.

Where TREESERVE_TRACE_DIR names a folder, SIGUSR1 has a verifier or drafter record its next rounds under torch's
profiler (host ops, CUDA runtime calls and the device's kernels and copies, each round marked "round") and SIGUSR2
write them there, as a gzipped Chrome trace <service>-<pid>-<n>.json.gz; a trace also ends by itself after
TRACED_ROUNDS rounds. A bench sends the signals around a steady stretch of its load
(`treeserve.bench.service_profile --torch-trace`). Unset, the default, a round pays one attribute read. The
profiler slows the host's side of a round; the device's side and the gaps between them are what a trace is for.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import signal
import statistics
from pathlib import Path

TRACE_DIR_ENV = "TREESERVE_TRACE_DIR"
TRACED_ROUNDS = 50

log = logging.getLogger("treeserve")


class RoundTraces:
    """A service's round tracing: `round()` around each round; `listen()` once, on its event loop."""

    def __init__(self, service: str, folder: str | None = None, rounds: int = TRACED_ROUNDS):
        folder = folder if folder is not None else os.environ.get(TRACE_DIR_ENV)
        self.service, self.rounds = service, rounds
        self.folder = Path(folder) if folder else None
        self.pending = 0  # rounds this trace is to hold; 0: tracing is off
        self.traced = 0  # rounds traced so far
        self.in_round = False
        self.profiler = None
        self.written = 0  # traces written

    def listen(self) -> None:
        """Arm on SIGUSR1 and finish on SIGUSR2, where a trace folder is set (call from the running event loop)."""
        if self.folder is not None:
            import asyncio

            self.folder.mkdir(parents=True, exist_ok=True)
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR1, self.arm)
            loop.add_signal_handler(signal.SIGUSR2, self.finish)

    def arm(self) -> None:
        """Trace the next `rounds` rounds (unless a trace is under way)."""
        if self.folder is not None and not self.pending:
            self.pending = self.rounds

    def finish(self) -> None:
        """Write the trace under way, if any, once its round under way ends (now if none is), and trace no more."""
        if self.in_round:
            self.pending = self.traced + 1
            return
        self.pending = 0
        if self.profiler is not None:
            self._write()

    def round(self):
        """A context manager around one round: nothing unless armed."""
        return _NOTHING if not self.pending else self._traced_round()

    @contextlib.contextmanager
    def _traced_round(self):
        import torch

        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        self.in_round = True
        try:
            with torch.profiler.record_function("round"):
                yield
        finally:
            self.in_round = False
            self.traced += 1
            if self.traced >= self.pending:
                self.finish()

    def _write(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = self.folder / f"{self.service}-{os.getpid()}-{self.written}.json.gz"
        self.written += 1
        export_trace(profiler, path)
        log.info("%s: wrote a trace of %d rounds to %s", self.service, self.traced, path)
        self.traced = 0


_NOTHING = contextlib.nullcontext()


def export_trace(profiler, path: Path) -> list[dict]:
    """A stopped torch profiler's Chrome trace, written gzipped to `path`; returns its events."""
    raw = path.with_name(path.name + ".json")
    profiler.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    raw.unlink()
    partial = path.with_name(path.name + ".partial")  # renamed once whole: a reader never sees half a trace
    with gzip.open(partial, "wt") as out:
        json.dump({"traceEvents": events}, out)
    partial.rename(path)
    return events


def read_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def timeline_of(events: list[dict], span: str = "round") -> list[dict]:
    """Per `span`-marked stretch of a Chrome trace: its length (host_ms), the union of the device's kernels and
    copies that began from its start until the next stretch began (device_busy_ms: work it launched may run past
    its end), when the first of them began and the last ended after the stretch began (device_first_ms,
    device_last_ms), and the CUDA runtime calls made inside it, ms by name."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("name") == span and e.get("cat") == "user_annotation")
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    rounds = []
    for index, (start, end) in enumerate(spans):
        following = spans[index + 1][0] if index + 1 < len(spans) else float("inf")
        work = [(s, e) for s, e in device if start <= s < following]
        busy, reach = 0.0, start
        for s, e in work:
            busy += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        calls: dict[str, float] = {}
        for e in runtime:
            if start <= e["ts"] < end:
                calls[e["name"]] = calls.get(e["name"], 0.0) + e.get("dur", 0) / 1000
        rounds.append({"host_ms": (end - start) / 1000, "device_busy_ms": busy / 1000,
                       "device_first_ms": (work[0][0] - start) / 1000 if work else 0.0,
                       "device_last_ms": (max(e for _, e in work) - start) / 1000 if work else 0.0,
                       "runtime_ms": calls})
    return rounds


def device_time_by_name(work: list[tuple[str, float]], calls: int, top: int) -> dict[str, float]:
    """The device's time per call by kernel (or copy) name, µs, from (name, µs) pairs recorded over `calls`
    calls: the `top` longest, longest first, and the rest summed as "(the rest)"."""
    totals: dict[str, float] = {}
    for name, microseconds in work:
        totals[name] = totals.get(name, 0.0) + microseconds
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    found = {name: round(total / calls, 1) for name, total in ranked[:top]}
    if len(ranked) > top:
        found["(the rest)"] = round(sum(total for _, total in ranked[top:]) / calls, 1)
    return found


def timeline_medians(rounds: list[dict]) -> dict:
    """The medians of timeline_of's figures over its stretches (runtime calls: by name, 0 where a stretch made
    none); {} for none."""
    if not rounds:
        return {}
    calls = sorted({name for round_ in rounds for name in round_["runtime_ms"]})
    return {"rounds": len(rounds),
            **{key: round(statistics.median(r[key] for r in rounds), 3)
               for key in ("host_ms", "device_busy_ms", "device_first_ms", "device_last_ms")},
            "runtime_ms": {name: round(statistics.median(r["runtime_ms"].get(name, 0.0) for r in rounds), 3)
                           for name in calls}}
