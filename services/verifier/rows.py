"""A request's rows of an output that one forward's requests share (their logits, their features), named without a
tensor op per request."""

from __future__ import annotations

import numpy as np
import torch


class Rows:
    """Rows `index` (a range, or a list of row numbers) of a tensor whose first dimension is rows, shared by the
    requests of one forward.

    A forward's outputs hold every request's rows. Slicing out each request's part cost one tensor op per request
    and round, and joining the parts again (for the round's picks, for the kept features) another, on the round's
    critical path. A Rows is a Python object; `gather` makes one tensor of many in one op."""

    __slots__ = ("source", "index")

    def __init__(self, source: torch.Tensor, index: range | list[int] | None = None):
        self.source = source
        self.index = range(len(source)) if index is None else index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, part: slice) -> "Rows":
        """A slice of these rows (of a range, a range: gathered as a view)."""
        return Rows(self.source, self.index[part])

    def select(self, positions: list[int]) -> "Rows":
        """These rows of this part, in this order (positions within the part)."""
        return Rows(self.source, [self.index[p] for p in positions])

    def tensor(self) -> torch.Tensor:
        """The rows as a tensor (a view of the source where they are one run of it)."""
        return gather([self])


def gather(parts: list[Rows], copy: bool = False) -> torch.Tensor:
    """The parts' rows one after another, in one tensor: a view of their source where they are one run of its rows
    (copied with `copy`, for rows that must outlive the source's next overwrite, such as a CUDA graph's outputs),
    else one gather per source."""
    if not parts:
        raise ValueError("gather needs at least one part")
    joined, start = [], 0
    while start < len(parts):
        source, end = parts[start].source, start + 1
        while end < len(parts) and parts[end].source is source:
            end += 1
        joined.append(_gather_from(source, parts[start:end], copy))
        start = end
    return joined[0] if len(joined) == 1 else torch.cat(joined)


def is_run(index: range | list[int]) -> bool:
    """Whether an index is one run of consecutive rows (a slice of the source, not a gather)."""
    return type(index) is range and index.step == 1


def _gather_from(source: torch.Tensor, parts: list[Rows], copy: bool) -> torch.Tensor:
    if all(is_run(part.index) for part in parts):
        starts = [part.index.start for part in parts]
        stops = [part.index.stop for part in parts]
        if starts[1:] == stops[:-1]:  # one run of the source's rows: a plain round's, or one request's
            view = source[starts[0]:stops[-1]]
            return view.clone() if copy else view
        index = run_index(np.asarray(starts), np.subtract(stops, starts))
    else:
        index = np.concatenate([np.asarray(part.index, dtype=np.int64) for part in parts])
    return select_rows(source, index)


def run_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The row numbers of runs starting at `starts`, `counts` long, one run after another, without a NumPy call
    per run."""
    return np.arange(counts.sum()) + np.repeat(starts - (np.cumsum(counts) - counts), counts)


def select_rows(source: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """source.index_select(0, index), the index copied from page-locked memory to a GPU: a copy from pageable
    memory would wait for the device's queued work first."""
    index = torch.from_numpy(index.astype(np.int64))
    if source.is_cuda:
        index = index.pin_memory().to(source.device, non_blocking=True)
    return source.index_select(0, index)
