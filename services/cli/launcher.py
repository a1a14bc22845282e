"""`treeserve up`: the three services on Unix sockets in one runtime folder, on one machine.

Starts drafter, verifier and gateway as child processes (logs in the runtime folder), waits until each reports
SERVING on grpc.health.v1, prints `gateway: <address>` (and, with --http, `http: <url>` of the gateway's
OpenAI-compatible API), and stops them all on Ctrl-C or SIGTERM. A drafter that exits is restarted with backoff
(the verifier decodes without trees meanwhile); a verifier or gateway that exits stops the stack. A temporary
runtime folder (no --runtime-dir) is removed on a clean stop.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from treeserve.errors import TreeserveError
from treeserve.serving import normalize_address


def health_status(address: str, timeout_s: float = 1.0) -> str:
    """The grpc.health.v1 status (SERVING, NOT_SERVING, ...) of the server at `address`, for the server as a
    whole (service ""); raises TreeserveError when it does not answer within `timeout_s`."""
    with grpc.insecure_channel(normalize_address(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            raise TreeserveError(f"no answer from {address}: {error.code().name}: {error.details()}") from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(address: str) -> bool:
    try:
        return health_status(address) == "SERVING"
    except TreeserveError:
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_on_sigterm() -> None:
    """Where SIGTERM would kill this process outright (its default), have it raise SystemExit instead, so that
    the `finally` that stops a Stack runs: the services run in sessions of their own and would outlive a bench
    stopped by `timeout` or a job runner, holding their sockets and ports. (`treeserve up` handles it itself.)"""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


class Stack:
    def __init__(self, runtime: Path):
        self.runtime = runtime
        self.children: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        self.argv: dict[str, list[str]] = {}
        self.serving: set[str] = set()

    def start(self, name: str, args: list[str], restart: bool = False) -> str:
        stop_on_sigterm()
        address = f"unix://{self.runtime / name}.sock"
        log = self.runtime / f"{name}.log"
        self.argv[name] = args
        with log.open("a" if restart else "w") as out:  # a restart keeps the log of the run that exited
            process = subprocess.Popen([sys.executable, "-m", f"treeserve.{name}", "--listen", address, *args],
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.children[name] = (process, address, log)
        return address

    def wait_serving(self, timeout_s: float) -> None:
        """Wait until every child started so far serves (those seen serving before are not asked again)."""
        deadline = time.monotonic() + timeout_s
        for name, (process, address, log) in self.children.items():
            if name in self.serving:
                continue
            print(f"waiting for the {name} ...", file=sys.stderr, flush=True)
            while not is_serving(address):
                if process.poll() is not None:
                    raise TreeserveError(f"the {name} exited (code {process.returncode}); its log {log} ends:\n"
                                         f"{log_tail(log)}")
                if time.monotonic() > deadline:
                    raise TreeserveError(f"the {name} was not serving after {timeout_s:.0f} s; see {log}")
                time.sleep(0.2)
            self.serving.add(name)

    def stop(self, grace_s: float) -> None:
        for process, _, _ in self.children.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5
        for process, _, _ in self.children.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        for path in self.runtime.glob("*.sock"):
            path.unlink(missing_ok=True)


# A drafter that is down costs speed, never tokens (the verifier decodes without trees and reconnects), so `up`
# restarts it; without its verifier or gateway the stack serves nothing, so `up` stops and says why.
RESTARTED = ("drafter",)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 4.0
STEADY_S = 30.0  # a service that ran this long before exiting starts its backoff over


class Supervisor:
    """Watches a started Stack: restarts the services in RESTARTED that exit, with doubling backoff, and counts
    the restarts; `check` raises TreeserveError when any other service exits."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.restarts = {name: 0 for name in RESTARTED}
        self.backoff_s = {name: FIRST_BACKOFF_S for name in RESTARTED}
        self.started_at = {name: time.monotonic() for name in RESTARTED}
        self.restart_at: dict[str, float] = {}  # exited services waiting out their backoff
        self.coming_back: set[str] = set()  # restarted services not yet seen serving

    def check(self) -> None:
        for name, (process, address, log) in list(self.stack.children.items()):
            if process.poll() is None:
                self._note_serving(name, address)
            elif name not in RESTARTED:
                raise TreeserveError(f"the {name} exited (code {process.returncode}); stopping the stack "
                                     f"(its log: {log})")
            elif name in self.restart_at:
                self._restart_when_due(name)
            else:
                self._schedule_restart(name, process.returncode)

    def _schedule_restart(self, name: str, code: int) -> None:
        now = time.monotonic()
        if now - self.started_at[name] >= STEADY_S:
            self.backoff_s[name] = FIRST_BACKOFF_S
        delay = self.backoff_s[name]
        self.backoff_s[name] = min(delay * 2, MAX_BACKOFF_S)
        self.restart_at[name] = now + delay
        self.coming_back.discard(name)
        say(f"the {name} exited (code {code}); restarting it in {delay:.1f} s")

    def _restart_when_due(self, name: str) -> None:
        if time.monotonic() < self.restart_at[name]:
            return
        del self.restart_at[name]
        self.stack.start(name, self.stack.argv[name], restart=True)
        self.started_at[name] = time.monotonic()
        self.restarts[name] += 1
        self.coming_back.add(name)
        say(f"restarted the {name} (restart {self.restarts[name]})")

    def note_coming_back(self) -> None:
        """Say which restarted services serve again since the last check (before a stop, so that the log says so
        of one that came back between two checks)."""
        for name in list(self.coming_back):
            process, address, _ = self.stack.children[name]
            if process.poll() is None:
                self._note_serving(name, address)

    def _note_serving(self, name: str, address: str) -> None:
        if name in self.coming_back and is_serving(address):
            self.coming_back.discard(name)
            say(f"the {name} is serving again")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# The settings `treeserve up`'s own flags give each service (through service_argv); every other field of a
# service's settings has a --<service>-<flag> of its own in `up`.
UP_SETS = {
    "drafter": ("listen", "target", "device", "dtype", "grace_s", "max_batch", "cuda_graphs", "kind", "tree",
                "drafter_path"),
    "verifier": ("listen", "target", "device", "dtype", "grace_s", "max_batch", "cuda_graphs", "default_budget",
                 "tp", "speculation", "metrics_listen", "drafter"),
    "gateway": ("listen", "target", "grace_s", "verifier", "http"),
}


def service_argv(service: str, args, **addresses) -> list[str]:
    """The flags `treeserve up`'s `args` give a service (`addresses`: its peers' --drafter / --verifier), after
    checking them with the service's environment as the service will; raises TreeserveError for a bad value.
    What `up` sets always goes on the command line (where it wins over the environment)."""
    import os

    from treeserve.settings import SERVICE_SETTINGS

    common = {"target": args.target, "device": args.device, "dtype": args.dtype, "grace_s": args.grace_s,
              "max_batch": args.max_batch, "cuda_graphs": args.cuda_graphs}
    own = {
        "drafter": {"kind": args.drafter, "tree": args.tree, "drafter_path": args.drafter_path},
        "verifier": {"default_budget": args.budget, "tp": args.tp, "speculation": args.speculation,
                     "metrics_listen": args.verifier_metrics},
        "gateway": {"http": args.http},
    }[service]
    given = {name: value for name, value in {**common, **own, **addresses}.items() if name in UP_SETS[service]}
    given |= {name.split("__", 1)[1]: value for name, value in vars(args).items()
              if name.startswith(f"{service}__")}
    given = {name: value if isinstance(value, list) else str(value) for name, value in given.items()
             if value is not None}
    settings = SERVICE_SETTINGS[service]
    try:
        settings.read(given, os.environ)
    except TreeserveError as error:
        raise TreeserveError(f"the {service}: {error}") from None
    return [item for name, value in given.items()
            for one in (value if isinstance(value, list) else [value]) for item in (f"--{name.replace('_', '-')}", one)]


def check_settings(args) -> None:
    """Every service's settings from `treeserve up`'s `args`, checked before any service starts."""
    for service in ("drafter", "verifier", "gateway") if args.drafter != "none" else ("verifier", "gateway"):
        service_argv(service, args)


def start_stack(stack: Stack, args) -> str:
    """Start drafter (unless `args.drafter` is none), verifier and gateway with `treeserve up`'s settings in
    `args`, wait until all serve; returns the gateway's address. Every service's settings are checked before
    any starts."""
    check_settings(args)
    drafters = []
    if args.drafter != "none":
        drafters.append(stack.start("drafter", service_argv("drafter", args)))
        # A verifier learns at its drafter's connection which target features to keep; a request it takes
        # before then can never be drafted by a DFlash drafter. So the drafter serves first.
        stack.wait_serving(args.start_timeout_s)
    verifier = stack.start("verifier", service_argv("verifier", args, drafter=drafters))
    gateway = stack.start("gateway", service_argv("gateway", args, verifier=[verifier]))
    stack.wait_serving(args.start_timeout_s)
    return gateway


def claim_http(args) -> str | None:
    """The URL of the gateway's HTTP API, once `args.http` is checked free to listen on (a port 0 becomes a free
    port, so that the address can be printed); None without --http. Raises TreeserveError for a taken port, before
    anything starts."""
    if not args.http:
        return None
    from treeserve.gateway.openai_api import address_of, bind, url

    with bind(args.http) as probe:
        args.http = address_of(probe)
        return url(probe)


def run_up(args) -> int:
    check_settings(args)
    http_url = claim_http(args)
    runtime = Path(args.runtime_dir) if args.runtime_dir else Path(tempfile.mkdtemp(prefix="treeserve-"))
    runtime.mkdir(parents=True, exist_ok=True)
    stack = Stack(runtime)
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    clean = False
    try:
        gateway = start_stack(stack, args)
        print(f"gateway: {gateway}", flush=True)
        if http_url is not None:
            print(f"http: {http_url}", flush=True)
        say(f"(logs in {runtime}; Ctrl-C stops all)")
        if args.demo_prompt:
            from treeserve.gateway.client import stream_demo

            stream_demo(gateway, args.demo_prompt)
        supervise(Supervisor(stack), stopping)
        clean = True
        return 0
    finally:
        say("stopping ...")
        stack.stop(args.grace_s)
        if not args.runtime_dir:
            remove_own_runtime(runtime, clean)


def supervise(supervisor: Supervisor, stopping: list) -> None:
    """Until Ctrl-C or SIGTERM; raises TreeserveError when a service that is not restarted exits."""
    while not stopping:
        supervisor.check()
        time.sleep(0.2)
    supervisor.note_coming_back()
    counted = ", ".join(f"{name} {count}" for name, count in supervisor.restarts.items() if count)
    if counted:
        say(f"restarts: {counted}")


def remove_own_runtime(runtime: Path, clean: bool) -> None:
    """The temporary folder `up` made goes on a clean stop; after a failure its logs stay, to be read."""
    if clean:
        shutil.rmtree(runtime, ignore_errors=True)
    else:
        say(f"logs kept in {runtime}")
