"""What every treeserve gRPC service shares: listen addresses, health, reflection, graceful shutdown.

A service's main runs under `run(...)` (asyncio on uvloop), calls `start(...)`, which starts a grpc.aio server
with health (NOT_SERVING) and reflection, calls `ready()` once it has loaded what it serves, then
`run_until_signalled(...)`: on SIGTERM or SIGINT health goes back to NOT_SERVING and in-flight streams get
`grace_s` seconds to finish before they are cancelled.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treeserve.errors import TreeserveError

log = logging.getLogger("treeserve")

# Servers and clients alike: room for large messages (DFlash target features travel on the Draft stream).
MESSAGE_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
# Clients: no BDP probe, the PING a client writes as data arrives. Written just after a server that drained its last
# stream on SIGTERM has closed the connection, it fails the connection before the frames already received are
# read: that stream's final messages are lost and the call ends UNAVAILABLE ("Broken pipe"). What a treeserve
# client receives is small (tokens, trees), so probing for a larger window gains nothing.
NO_BDP_PROBE = [("grpc.http2.bdp_probe", 0)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_options(max_reconnect_backoff_s: float = 5.0) -> list[tuple[str, int]]:
    """Options for a channel to a peer service. gRPC's own reconnect backoff grows to minutes; capping it means
    a peer that comes back is found within seconds."""
    return MESSAGE_OPTIONS + NO_BDP_PROBE + [
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(max_reconnect_backoff_s * 1000))]


def default_address(service: str) -> str:
    """Where a service listens unless told otherwise: a Unix socket in the runtime (or temp) directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"unix://{runtime}/treeserve/{service}.sock"


def normalize_address(address: str) -> str:
    """Accepts unix:///abs/path, unix:relative/path, host:port or tcp://host:port; returns what gRPC takes."""
    if address.startswith("unix:"):
        path = address[len("unix://"):] if address.startswith("unix://") else address[len("unix:"):]
        if not path:
            raise TreeserveError(f"bad address {address!r}: no socket path")
        return f"unix://{Path(path).resolve()}" if not path.startswith("/") else f"unix://{path}"
    if address.startswith("tcp://"):
        address = address[len("tcp://"):]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TreeserveError(f"bad address {address!r}: use unix:///path/to.sock or host:port")
    return address


def unix_socket_path(address: str) -> Path | None:
    return Path(address[len("unix://"):]) if address.startswith("unix://") else None


def freeze_startup_objects() -> None:
    """Put every object alive now out of the garbage collector's reach: what a process keeps for its life (modules,
    model, tokenizer, graphs). A full collection walks every object it tracks and stops the whole process meanwhile,
    every stream of a service, and serving allocates enough to start one every few seconds (docs/benchmarks.md)."""
    gc.collect()  # startup's garbage goes now rather than staying frozen
    gc.freeze()


class Service:
    """A started server plus its health status, for the server ("") and each of its services by name;
    `ready()` flips health to SERVING."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, address: str,
                 names: list[str] = ()):
        self.server, self.health, self.address, self.names = server, health_servicer, address, list(names)
        # Other listeners of the service, each stopped with the server: `await stop(grace_s)`.
        self.listeners: list[Callable[[float], Awaitable[None]]] = []

    async def stop(self, grace_s: float | None) -> None:
        """Stop the server and the service's other listeners, giving open streams `grace_s` seconds."""
        await asyncio.gather(self.server.stop(grace_s), *(stop(grace_s or 0) for stop in self.listeners))

    async def ready(self, busy_loop: bool = False) -> None:
        """Startup is done: freeze what it made (freeze_startup_objects), keep the loop busy if asked
        (keep_loop_busy), then health SERVING."""
        freeze_startup_objects()
        if busy_loop:
            self.listeners.append(keep_loop_busy())
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def stopping(self) -> None:
        """NOT_SERVING for good: a later set_serving (a service whose health follows its peers') is ignored."""
        await self.health.enter_graceful_shutdown()


# keep_loop_busy polls for POLL_S at a time, then sleeps in checks of CHECK_S until one finds that the loop's thread
# worked meanwhile (more than WORK_S of CPU: a round's host work is most of that, a bare wake-up a tenth of it), so
# that an idle service gives its core back. POLL_S is long on purpose: a drafter that adaptive speculation asks for a
# tree only every few rounds must still be polling when asked; asleep, it answers late, and the policy, pricing trees
# by what they took, stops asking (docs/benchmarks.md, "The drafter's event loop asleep between seldom messages").
POLL_S, CHECK_S, WORK_S = 1.0, 0.02, 1e-3


def keep_loop_busy(poll_s: float = POLL_S) -> Callable[[float], Awaitable[None]]:
    """Keep the running loop's thread polling instead of asleep in epoll while the service works: a task that
    only yields. A round of a small target on a GPU is a few milliseconds in turns between processes, and a thread
    that sleeps between its turns pays a wake-up in each (docs/benchmarks.md, "Event loops that poll between
    rounds"). Costs a core while it polls. Returns the task's stop."""
    async def poll() -> None:
        loop = asyncio.get_running_loop()
        while True:
            polled_until = loop.time() + poll_s
            while loop.time() < polled_until:
                await asyncio.sleep(0)
            while True:
                cpu = time.thread_time()
                await asyncio.sleep(CHECK_S)
                if time.thread_time() - cpu > WORK_S:
                    break

    task = asyncio.get_running_loop().create_task(poll())

    async def stop(grace_s: float) -> None:
        task.cancel()
    return stop


async def start(listen: str, register: Callable[[grpc.aio.Server], list[str]]) -> Service:
    """Bind `listen`, add the servicers (`register` returns their full service names) plus health and
    reflection, and start serving with health NOT_SERVING."""
    address = normalize_address(listen)
    socket = unix_socket_path(address)
    if socket is not None:
        try:
            socket.parent.mkdir(parents=True, exist_ok=True)
            socket.unlink(missing_ok=True)  # a stale socket from a killed process would block the bind
        except OSError as error:
            raise TreeserveError(f"cannot listen on {address}: {error}") from None
    server = grpc.aio.server(options=MESSAGE_OPTIONS)
    names = register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises when the address cannot be bound
        raise TreeserveError(f"cannot listen on {address}") from None
    await server.start()
    service = Service(server, health_servicer, address, names)
    await service.set_serving(False)
    return service


async def run_until_signalled(service: Service, grace_s: float,
                              on_stop: Callable[[], Awaitable[None]] | None = None,
                              on_drain: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING, stop accepting (`on_drain()`: for work that comes on
    streams already open), let streams finish for grace_s (on the gRPC server and the service's other
    `listeners`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_done = asyncio.ensure_future(service.server.wait_for_termination())
    await asyncio.wait([server_done, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: draining in-flight streams for up to %.0f s", grace_s)
    await service.stopping()
    if on_drain is not None:
        on_drain()
    await service.stop(grace_s)
    if on_stop is not None:
        await on_stop()
    socket = unix_socket_path(service.address)
    if socket is not None:
        socket.unlink(missing_ok=True)


async def abandon(service: Service) -> None:
    """Stop at once and remove the socket: for a service whose startup failed after it began listening."""
    await service.stop(0)
    socket = unix_socket_path(service.address)
    if socket is not None:
        socket.unlink(missing_ok=True)


def run(main: Awaitable[None]) -> None:
    """asyncio on uvloop (the faster event loop) when it is installed."""
    try:
        import uvloop
    except ImportError:  # plain asyncio is correct, only slower
        asyncio.run(main)
        return
    uvloop.run(main)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
