"""Target feature rows through shared memory, for a Draft stream between two processes on one host.

A DFlash drafter conditions on the target's hidden states, a few KB a token: megabytes in a round that catches
many requests' contexts up. Inside a protobuf message those bytes are copied about ten times on their way from
the verifier to the drafter (into the message, serialised, framed, through the socket, buffered, parsed,
decoded); through a region that both processes map they are copied once each way.

The verifier makes a region for each framed Draft stream (a file on the host's shared-memory filesystem,
unlinked once the drafter has mapped it) and offers it in a REGION frame (`treeserve.framing`). Each round it
writes its items' rows there from the start, and an item's Features says where they lie (`region_offset`)
instead of carrying them. The drafter copies the rows out as it reads the message, and answers every message of
a round before the verifier's next round writes the region again. Rows that do not fit travel in the message.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from treeserve.errors import TreeserveError

if TYPE_CHECKING:
    import torch

SHARED_MEMORY_DIR = Path("/dev/shm")
FILE_PREFIX = "treeserve-features-"
ALIGNMENT = 64  # each item's rows start at a multiple of this, so that any dtype can view them
# A verifier's region for one drafter, its memory taken up front: a steady round at 64 requests writes about 1 MB,
# a catch-up of many requests tens of MB. Rows of a round beyond it travel in the messages.
DEFAULT_REGION_BYTES = 64 << 20
SMALLEST_REGION_BYTES = 1 << 20  # where /dev/shm has less room than the size asked, halved down to this at most


class PlacedRows(NamedTuple):
    """Feature rows written to a feature region: where they start, their shape and dtype."""

    offset: int
    shape: tuple[int, int]
    dtype: torch.dtype


class FeatureRegion:
    """The verifier's end: rows written at offsets from the start of the round (`clear`), one item after another."""

    def __init__(self, size: int):
        """Raises OSError where /dev/shm has no room for `size` bytes. Its pages are reserved here: a write to a
        sparse file past what /dev/shm can hold would kill the process (SIGBUS) instead of failing."""
        fd, self.path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=SHARED_MEMORY_DIR)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.size, self.used = size, 0
        # The mapping's bytes, sliced and written through NumPy: a round writes a few rows a request, and torch's
        # calls on so few (a slice, views, a copy) cost more than the copy itself, on the round's path.
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> "FeatureRegion | None":
        """A region of `size` bytes, or half that where /dev/shm has no room for it (a container's is often 64 MB),
        and so on down to SMALLEST_REGION_BYTES; None below that, or where this host has no /dev/shm."""
        if size <= 0 or not SHARED_MEMORY_DIR.is_dir():
            return None
        while True:
            try:
                return cls(size)
            except OSError:
                if size // 2 < SMALLEST_REGION_BYTES:
                    return None
                size //= 2

    def clear(self) -> None:
        """A new round: every earlier row has been read."""
        self.used = 0

    def place(self, parts: list[torch.Tensor]) -> PlacedRows | None:
        """Writes these rows (one part after another, all of one dtype and width) at the next free offset; None,
        writing nothing, where they do not fit."""
        rows = sum(len(part) for part in parts)
        width, dtype = parts[0].shape[1], parts[0].dtype
        start = self._next_start()
        end = start + rows * width * dtype.itemsize
        if end > self.size:
            return None
        self._write(start, parts)
        self.used = end
        return PlacedRows(start, (rows, width), dtype)

    def place_items(self, items: list[list[torch.Tensor]]) -> list[PlacedRows | None]:
        """`place` for each item's parts, one item after another; where every item starts aligned anyway (rows of a
        multiple of ALIGNMENT bytes, as a target's features are) and all of them fit, in one write: a round of many
        requests writes a few rows each, and each write's torch calls cost more than its copy."""
        parts = [part for item in items for part in item]
        if len(items) < 2 or not parts:
            return [self.place(item) for item in items]
        width, dtype = parts[0].shape[1], parts[0].dtype
        row_bytes = width * dtype.itemsize
        counts = [sum(len(part) for part in item) for item in items]
        start = self._next_start()
        end = start + sum(counts) * row_bytes
        if row_bytes % ALIGNMENT or end > self.size:
            return [self.place(item) for item in items]
        import torch

        self._write(start, [torch.cat(parts)])
        self.used = end
        offsets = itertools.accumulate((count * row_bytes for count in counts), initial=start)
        return [PlacedRows(offset, (count, width), dtype) for offset, count in zip(offsets, counts)]

    def _next_start(self) -> int:
        return -(-self.used // ALIGNMENT) * ALIGNMENT

    def _write(self, offset: int, parts: list[torch.Tensor]) -> None:
        import torch  # here, not at the top: a drafter without features runs without torch

        for part in parts:  # each part's bytes, as NumPy takes any torch dtype's (bfloat16's too)
            part_bytes = (part if part.is_contiguous() else part.contiguous()).view(torch.uint8).numpy()
            self.array[offset:offset + part_bytes.size] = part_bytes.reshape(-1)
            offset += part_bytes.size

    def unlink(self) -> None:
        """Remove the file (the mappings stay): once the drafter has mapped it, or has refused it."""
        Path(self.path).unlink(missing_ok=True)

    def close(self) -> None:
        self.unlink()
        del self.array
        self.map.close()


class MappedRegion:
    """The drafter's end: a region a verifier offered, mapped, from which a message's rows are copied out."""

    def __init__(self, path: str):
        """Raises TreeserveError where `path` is not a region file this host's verifier could have made, or cannot be
        mapped."""
        where = Path(path)
        if where.parent != SHARED_MEMORY_DIR or not where.name.startswith(FILE_PREFIX):
            raise TreeserveError(f"a feature region must be a {FILE_PREFIX}* file in {SHARED_MEMORY_DIR}, not {path}")
        try:
            fd = os.open(where, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            raise TreeserveError(f"cannot open the feature region {path}: {error.strerror}") from None
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size)
        except (OSError, ValueError) as error:
            raise TreeserveError(f"cannot map the feature region {path}: {error}") from None
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.uint8)  # (as FeatureRegion's)

    def rows(self, offset: int, shape: tuple[int, int], dtype: torch.dtype, copy: bool = True) -> torch.Tensor:
        """The rows at `offset`: a copy, or with `copy=False` a view of the region, which the verifier writes again
        for its next round (so only for rows read before this round's answer goes back)."""
        end = offset + shape[0] * shape[1] * dtype.itemsize
        if offset % ALIGNMENT or end > self.size:
            raise TreeserveError(f"features at bytes {offset}..{end} of a feature region of {self.size} bytes "
                                 f"(offsets are multiples of {ALIGNMENT})")
        import torch

        rows = torch.from_numpy(self.array[offset:end]).view(dtype).view(shape)
        return rows.clone() if copy else rows

    def close(self) -> None:
        del self.array
        try:
            self.map.close()
        except BufferError:  # a view of it still lives (a stream that ended mid-round): unmapped with the last one
            pass
