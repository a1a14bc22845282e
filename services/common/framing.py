"""A stream of the round's path over a plain Unix socket, for a caller on the same host.

gRPC is each service's contract (GetInfo, health, reflection, and every stream for a caller on another host), but
each message through grpc.aio costs its core's threads and queues, several times what the same protobuf costs
written to a socket: at a small target that is a good part of a round. A service listening on a Unix socket
therefore also takes its round-by-round stream on a socket beside it (`local_frame_socket`, named in GetInfo): a
drafter its Draft stream, a verifier its Session stream. The same protobuf messages go each way, each in a frame of
a kind byte and a length. A verifier whose drafter takes target features first offers it a feature region
(`treeserve.feature_region`) in a REGION frame.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from pathlib import Path
from typing import Awaitable, Callable

from google.protobuf.message import DecodeError

from treeserve.errors import TreeserveError
from treeserve.serving import MESSAGE_OPTIONS, Service, unix_socket_path

log = logging.getLogger("treeserve.framing")

HEADER = struct.Struct("<BI")  # kind, payload length
# A protobuf message; the service's reason for ending the stream (UTF-8); a feature region's path from the
# verifier, answered by the drafter with an empty REGION frame once mapped, or with why it cannot (UTF-8).
MESSAGE, REFUSAL, REGION = 0, 1, 2
MAX_FRAME_BYTES = dict(MESSAGE_OPTIONS)["grpc.max_receive_message_length"]  # as over gRPC
# How much a stream's reader buffers before it stops reading the socket: a round's message at a large batch is
# about a megabyte (its target features).
READ_BUFFER_BYTES = 4 << 20


class FrameError(TreeserveError):
    """A frame that breaks the protocol (unknown kind, too long)."""


def local_frame_socket(grpc_address: str, stream: str) -> Path | None:
    """Where a service serving gRPC on `grpc_address` takes its `stream` ("draft", "session") as frames: beside its
    Unix socket (None for a TCP address, whose callers may be on other hosts)."""
    path = unix_socket_path(grpc_address)
    return None if path is None else path.with_name(f"{path.name}.{stream}")


def write_frame(writer: asyncio.StreamWriter, payload: bytes, kind: int = MESSAGE) -> None:
    writer.write(HEADER.pack(kind, len(payload)) + payload)


class Refused(ConnectionError):
    """The other end ended the stream with a refusal frame; the message is its reason."""


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """The next frame's kind and payload, or None where the stream ends between frames. Raises Refused for a
    refusal frame, and FrameError for a frame that breaks the protocol (or a stream cut inside one)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise FrameError("the stream ended inside a frame's header") from None
    kind, length = HEADER.unpack(header)
    if kind not in (MESSAGE, REFUSAL, REGION):
        raise FrameError(f"unknown frame kind {kind}")
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes is above the limit of {MAX_FRAME_BYTES}")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the stream ended inside a frame of {length} bytes") from None
    if kind == REFUSAL:
        raise Refused(payload.decode(errors="replace"))
    return kind, payload


def parse_message(kind: int, payload: bytes, message_type):
    """A MESSAGE frame's `message_type`; FrameError for another kind of frame, or bytes that are no such message."""
    if kind != MESSAGE:
        raise FrameError(f"a frame of kind {kind} where a {message_type.DESCRIPTOR.name} was due")
    try:
        return message_type.FromString(payload)
    except DecodeError as error:
        raise FrameError(f"a frame that is no {message_type.DESCRIPTOR.name}: {error}") from None


async def read_message(reader: asyncio.StreamReader, message_type):
    """The next frame's message (a `message_type`), or None where the stream ends between frames; raises as
    read_frame and parse_message do."""
    frame = await read_frame(reader)
    return None if frame is None else parse_message(*frame, message_type)


class FramedCall:
    """The caller's end of a stream over frames, used as a grpc.aio stream call is: `write` a request (or `send`
    it, unawaited: the socket buffers it), `read` a response (a `response_type`), `cancel`. A stream that ends,
    breaks the protocol or that the service refused raises ConnectionError."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response_type):
        self.reader, self.writer, self.response_type = reader, writer, response_type

    @classmethod
    async def open(cls, path: str, response_type) -> "FramedCall":
        reader, writer = await asyncio.open_unix_connection(path, limit=READ_BUFFER_BYTES)
        return cls(reader, writer, response_type)

    def send(self, message) -> None:
        write_frame(self.writer, message.SerializeToString())

    async def write(self, message) -> None:
        self.send(message)
        await self.writer.drain()

    async def read(self):
        kind, payload = await self._read_frame()
        try:
            return parse_message(kind, payload, self.response_type)
        except FrameError as error:
            raise ConnectionError(f"the stream's socket broke the protocol: {error}") from None

    async def share_region(self, path: str) -> str:
        """Offers the drafter the feature region at `path`; returns "" once it has mapped it, else why it cannot."""
        write_frame(self.writer, path.encode(), REGION)
        await self.writer.drain()
        kind, payload = await self._read_frame()
        if kind != REGION:
            raise ConnectionError(f"the draft socket answered a feature region with a frame of kind {kind}")
        return payload.decode(errors="replace")

    async def _read_frame(self) -> tuple[int, bytes]:
        try:
            frame = await read_frame(self.reader)
        except Refused as error:
            raise Refused(f"the service refused the stream: {error}") from None
        except FrameError as error:
            raise ConnectionError(f"the stream's socket broke the protocol: {error}") from None
        if frame is None:
            raise ConnectionError("the stream's socket closed")
        return frame

    def cancel(self) -> None:
        self.writer.close()


class FrameServer:
    """A service's streams taken as frames on a Unix socket beside its gRPC one: `handle(reader, writer)` serves
    one stream; a TreeserveError it raises (a bad frame, a request the service refuses) ends the stream with a
    refusal frame saying why, and the writer is closed when it returns. Stopped with the service (`stop`, a
    Service listener)."""

    def __init__(self, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]):
        self.handle = handle
        self.path = ""  # where it listens (named in GetInfo); "": nowhere
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()  # the streams open now

    async def listen(self, path: Path) -> bool:
        """Take streams on `path` too; True if it listens there."""
        try:
            path.unlink(missing_ok=True)
            self.server = await asyncio.start_unix_server(self._serve, str(path), limit=READ_BUFFER_BYTES)
        except OSError as error:  # a path too long for a socket, say: gRPC serves every caller then
            log.warning("cannot take streams as frames on %s (%s): gRPC only", path, error)
            return False
        self.path = str(path)
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            await self.handle(reader, writer)
        except TreeserveError as error:
            write_frame(writer, str(error).encode(), REFUSAL)
        except ConnectionError:  # the caller went away (or refused: it sends no such frame)
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def stop(self, grace_s: float) -> None:
        """Take no more streams, give the open ones `grace_s` seconds, then end them, as gRPC does its own."""
        if self.server is None:
            return
        self.server.close()
        self.path, path = "", self.path
        deadline = time.monotonic() + grace_s
        while self.writers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for writer in list(self.writers):
            writer.close()
        Path(path).unlink(missing_ok=True)


async def listen_beside(service: Service, frames: FrameServer, stream: str) -> None:
    """Have `frames` take `stream` on a socket beside the service's Unix socket (local_frame_socket), stopped with
    the service; nothing for a service on TCP."""
    path = local_frame_socket(service.address, stream)
    if path is not None and await frames.listen(path):
        service.listeners.append(frames.stop)
