"""Forwards over the paged KV pool in a fixed (batch, rows) layout, run eagerly or replayed from CUDA graphs
captured per (batch bucket x rows bucket): the target's tree verification (treeserve.verifier.graphs) and the
DFlash drafter's block forward both run through a PagedRunner.

A forward has the shape of its bucket: requests padded up to the batch bucket (zero new rows: they read and
write nothing) and each request's rows padded up to the rows bucket (slot -1: the row writes nowhere, and the
kernel's row bound hides it). Sampling stays outside the graph.

The rules from DESIGN.md ("What broke"): every static input of every graph is allocated here, before the first
capture, sized from the declared maxima (a bucket's inputs are views of those buffers, so none can be missing or
too small); the mask is rows x rows (the prefix is always visible); replay checks the sizes it is handed; and
a test replays every bucket against eager execution.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import time

import numpy as np
import torch

from treeserve.errors import TreeserveError
from treeserve.models.paged_kv import PagedInputs, PagedKVCache, PagedSequence, StagingEvents
from treeserve.tree import TreeShape


GRAPH_CHOICES = ("auto", "on", "off")  # auto: on with CUDA


def in_inference_mode(function):
    """`function` under torch.inference_mode(), entered only where the caller is not in it already: a forward's
    host work passes through several such methods (from forward_batch, itself under it), and entering the mode
    costs as much as some of that work."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return function(*args, **kwargs)
        with torch.inference_mode():
            return function(*args, **kwargs)
    return run


def graphs_wanted(choice: str, device: torch.device | str) -> bool:
    if choice not in GRAPH_CHOICES:
        raise TreeserveError(f"cuda graphs must be one of {', '.join(GRAPH_CHOICES)}, got {choice!r}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "on" and not on_cuda:
        raise TreeserveError("CUDA graphs need --device cuda")
    return on_cuda if choice == "auto" else choice == "on"


def buckets_up_to(maximum: int, sizes: tuple[int, ...]) -> list[int]:
    """The sizes below `maximum`, then `maximum` itself (so the maximum is always captured)."""
    return sorted({size for size in sizes if size < maximum} | {maximum})


def powers_of_two_up_to(maximum: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(maximum.bit_length()))


@dataclasses.dataclass
class TreeRows:
    """One forward's inputs, padded to (batch, rows); row b * rows + i is new row i of request b (a tree node,
    or a position of a DFlash block).

    `packed` is the one byte buffer all of them are views of, laid out for this (batch, rows) (`packed_rows`):
    a forward's inputs then reach the GPU in one copy of its first `packed_bytes` bytes rather than one copy each."""

    tokens: torch.Tensor  # (batch * rows,) int64
    positions: torch.Tensor  # (batch * rows,) int64
    paged: PagedInputs
    packed: torch.Tensor | None = None  # uint8, at least packed_bytes long
    # (target, its bytes, these bytes) of the last copy_into: a runner copies a staging view into its bucket's
    # static inputs every forward, and slicing both buffers anew each time is two torch calls on the round's path.
    copy_views: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(batch, rows, block-table width): what `packed_rows` lays a buffer out for."""
        batch = self.paged.batch
        return batch, self.tokens.shape[0] // batch, self.paged.tables.shape[1]

    @property
    def packed_bytes(self) -> int:
        return packed_size(*self.shape)

    def to(self, device: torch.device, non_blocking: bool = False) -> "TreeRows":
        if self.packed is not None:
            return packed_rows(self.packed[:self.packed_bytes].to(device, non_blocking=non_blocking), *self.shape)
        return TreeRows(self.tokens.to(device, non_blocking=non_blocking),
                        self.positions.to(device, non_blocking=non_blocking), self.paged.to(device, non_blocking))

    def view(self, batch: int, rows: int) -> "TreeRows":
        """Inputs of a forward of (batch, rows) in the buffer of these (sized for a larger batch and rows), laid out
        anew: what they held is not kept."""
        return packed_rows(self.packed, batch, rows, self.paged.tables.shape[1])

    def copy_into(self, target: "TreeRows") -> None:
        """Copy these inputs into `target`, of the same (batch, rows), in one copy (asynchronous from page-locked
        memory to a GPU)."""
        views = self.copy_views
        if views is None or views[0] is not target:
            size = self.packed_bytes
            if self.tokens.shape != target.tokens.shape or size != target.packed_bytes:
                raise TreeserveError(f"graph input of {self.tokens.shape[0]} rows ({size} bytes) for a bucket of "
                                     f"{target.tokens.shape[0]} rows ({target.packed_bytes} bytes)")
            views = self.copy_views = (target, target.packed[:size], self.packed[:size])
        views[1].copy_(views[2], non_blocking=True)


def packed_size(batch: int, rows: int, table_width: int) -> int:
    """Bytes of a (batch, rows) forward's inputs in `packed_rows`' layout."""
    n = batch * rows
    return 3 * n * 8 + (batch * table_width + 2 * batch) * 4 + batch * rows * rows


def packed_rows(buffer: torch.Tensor, batch: int, rows: int, table_width: int) -> TreeRows:
    """A (batch, rows) forward's inputs as views of the uint8 `buffer`: the int64 fields (tokens, positions,
    slots), then the int32 ones (tables, prefix_lens, new_counts), then the int8 mask, so that each starts at an
    offset its type aligns to. Their values are whatever the buffer holds."""
    n, taken = batch * rows, 0

    def field(count: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal taken
        size = count * dtype.itemsize
        view = buffer[taken:taken + size].view(dtype)
        taken += size
        return view

    tokens, positions, slots = field(n, torch.long), field(n, torch.long), field(n, torch.long)
    tables = field(batch * table_width, torch.int32).view(batch, table_width)
    prefix_lens, new_counts = field(batch, torch.int32), field(batch, torch.int32)
    mask = field(batch * rows * rows, torch.int8).view(batch, rows, rows)
    return TreeRows(tokens, positions, PagedInputs(slots, tables, prefix_lens, new_counts, mask), buffer)


def pad(rows: TreeRows) -> TreeRows:
    """Fill `rows` with padding: slot -1 (writes nowhere), everything else 0 (no request, nothing seen)."""
    rows.packed[:rows.packed_bytes].zero_()
    rows.paged.slots.fill_(-1)
    return rows


def padded_rows(batch: int, rows: int, table_width: int, pin: bool = False,
                device: torch.device | str = "cpu") -> TreeRows:
    """Inputs of a forward of (batch, rows), all padding, in one buffer (`pin`: page-locked host memory, so that
    copies to the GPU do not wait on it)."""
    buffer = torch.empty(packed_size(batch, rows, table_width), dtype=torch.uint8, pin_memory=pin, device=device)
    return pad(packed_rows(buffer, batch, rows, table_width))


def stage_trees(sequences: list[PagedSequence], tokens: list[list[int]], positions: list[np.ndarray],
                masks: list[torch.Tensor | np.ndarray | TreeShape], batch: int, rows: int, table_width: int,
                into: TreeRows | None = None) -> TreeRows:
    """Host tensors of one forward: each request's new rows (reserved here in its sequence) with their tokens,
    positions and mask among themselves (an (N, N) tensor or array, or a tree's TreeShape: its ancestor mask),
    padded to (batch, rows). Staged in new tensors, or `into`: host buffers at least that large (a PagedRunner's,
    page-locked, allocated once and reused every round)."""
    if into is not None and into.paged.tables.shape[1] != table_width:
        raise TreeserveError(f"staging buffers of block-table width {into.paged.tables.shape[1]}, not {table_width}")
    staged = padded_rows(batch, rows, table_width) if into is None else into.view(batch, rows)
    _stage_into(StagingView(staged), sequences, tokens, positions, masks, reused=into is not None)
    return staged


class StagingView:
    """Staged rows of one (batch, rows) and NumPy views of their tensors, which staging writes through: a
    PagedRunner keeps one per buffer set and bucket, rather than taking views of its buffers in every forward."""

    __slots__ = ("staged", "tokens", "positions", "slots", "tables", "mask", "prefix_lens", "new_counts", "zeroed")

    def __init__(self, staged: TreeRows):
        # Filled and padded through NumPy views, which cost a fraction of torch indexing per request; torch's fills
        # of the reused buffers also cost more between rounds than back to back.
        batch, rows = staged.paged.batch, staged.tokens.shape[0] // staged.paged.batch
        paged = staged.paged
        self.staged = staged
        self.tokens = staged.tokens.numpy().reshape(batch, rows)
        self.positions = staged.positions.numpy().reshape(batch, rows)
        self.slots = paged.slots.numpy().reshape(batch, rows)
        self.tables, self.mask = paged.tables.numpy(), paged.tree_mask.numpy()
        self.prefix_lens, self.new_counts = paged.prefix_lens.numpy(), paged.new_counts.numpy()
        self.zeroed = (self.tokens, self.positions, self.tables, self.mask, self.prefix_lens, self.new_counts)


def _stage_into(view: StagingView, sequences: list[PagedSequence], tokens: list[list[int]],
                positions: list[np.ndarray], masks: list[torch.Tensor | np.ndarray | TreeShape], reused: bool) -> None:
    """stage_trees' work, through `view`'s arrays (`reused`: buffers that may hold an earlier forward's rows)."""
    slots_np, tables_np, mask_np = view.slots, view.tables, view.mask
    tokens_np, positions_np, prefix_np, counts_np = view.tokens, view.positions, view.prefix_lens, view.new_counts
    table_width = tables_np.shape[1]
    if reused:  # every row padding, as padded_rows makes them
        slots_np.fill(-1)
        for array in view.zeroed:
            array.fill(0)
    shapes: list[tuple[int, TreeShape]] = []  # trees whose masks are unpacked from their ancestor bits together
    for b, (sequence, tree_tokens, tree_positions, mask) in enumerate(zip(sequences, tokens, positions, masks)):
        n = len(tree_tokens)
        prefix_np[b], counts_np[b] = sequence.length, n
        if n == 1:  # a plain step, most rows of a large batch: no array to make (a row always sees itself)
            slots_np[b, 0] = sequence.reserve_one()
            mask_np[b, 0, 0] = 1
        else:
            slots_np[b, :n] = sequence.reserve_array(n)
            if isinstance(mask, TreeShape):
                shapes.append((b, mask))
            else:
                mask_np[b, :n, :n] = mask.numpy() if isinstance(mask, torch.Tensor) else mask
        if len(sequence.blocks) > table_width:
            raise TreeserveError(f"a sequence of {len(sequence.blocks)} blocks exceeds the block table's "
                                 f"{table_width}")
        tables_np[b, :len(sequence.blocks)] = sequence.blocks
        tokens_np[b, :n] = tree_tokens
        positions_np[b, :n] = tree_positions
    if shapes:
        _stage_ancestor_masks(mask_np, shapes)


def _stage_ancestor_masks(mask_np: np.ndarray, shapes: list[tuple[int, TreeShape]]) -> None:
    """The ancestor masks of these trees (request b's TreeShape) into mask_np[b], all in one unpacking of their
    ancestor bits: each tree's rows padded with empty ones to the largest tree's, whose bits past a tree's size
    are 0, as padding's are."""
    requests = [b for b, _ in shapes]
    width = max(len(shape.ancestors) for _, shape in shapes)
    rows = [shape.ancestors + [0] * (width - len(shape.ancestors)) for _, shape in shapes]
    if width <= 64:  # each row's bits in one little-endian 64-bit word
        words = np.array(rows, dtype="<u8").view(np.uint8).reshape(len(rows), width, 8)
    else:
        size = (width + 7) // 8
        words = np.frombuffer(b"".join([bits.to_bytes(size, "little") for row in rows for bits in row]),
                              dtype=np.uint8).reshape(len(rows), width, size)
    masks = np.unpackbits(words, axis=2, count=width, bitorder="little")
    if requests == list(range(len(requests))):
        mask_np[:len(requests), :width, :width] = masks
    else:
        mask_np[requests, :width, :width] = masks


@dataclasses.dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor | None, ...]  # (batch * rows, ...) each, written by every replay


@contextlib.contextmanager
def cycle_collection_paused():
    """Around captures: Python's cycle collector must not run during one, since an unreachable CUDA graph from
    earlier (a runner and its forward refer to each other) destroyed mid-capture invalidates the capture. Collect
    now, and not again until the captures are done."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def capture_graph(function, memory_pool=None) -> CapturedGraph:
    """Run `function()` once (warm-up: Triton compiles, cuBLAS picks its kernels, cached index tables are made),
    then capture it into a graph that allocates from `memory_pool` (the graph's own pool, `graph.pool()`, when
    None); its outputs are the tuple `function` returns. Inside cycle_collection_paused()."""
    function()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        outputs = function()
    return CapturedGraph(graph, outputs)


class PagedRunner:
    """Runs one forward function over a paged pool in the padded (batch, rows) layout: with `graphs`, by
    replaying the smallest captured bucket that holds the batch (capture with `capture()`; a batch beyond the
    maxima runs eagerly); without, eagerly at the batch's own padded size, through the same staging.

    `forward(rows: TreeRows)` returns a tuple of tensors (or None) whose first dimension is the rows, except the
    last `request_outputs`, which have one row per request (a result the forward reduces each request's rows
    to, as a DFlash drafter's tree); it may only read `rows`, the pool and buffers its owner fills before each
    run, so that a graph captured on static inputs replays it."""

    # Forwards are staged in two sets of host buffers in turn: a forward that follows another one within a round
    # (a prompt's next piece) is staged while the copies of the one before are still queued behind that one's
    # own predecessor. With one set, the host waited for those copies.
    STAGING_BUFFERS = 2
    STAGING_VIEWS = 1024  # StagingViews kept at most

    def __init__(self, pool: PagedKVCache, forward, max_batch: int, row_buckets: list[int], max_length: int,
                 graphs: bool = False, request_outputs: int = 0):
        if max_batch < 1 or not row_buckets:
            raise TreeserveError(f"no buckets to run: batch up to {max_batch}, rows {row_buckets}")
        if graphs and pool.data.device.type != "cuda":
            raise TreeserveError("CUDA graphs need the model on a CUDA device")
        self.pool, self.forward, self.request_outputs = pool, forward, request_outputs
        self.device = pool.data.device
        self.max_batch, self.row_buckets = max_batch, sorted(row_buckets)
        self.max_rows = self.row_buckets[-1]
        # Wide enough for the longest sequence: `max_length` committed tokens plus the rows of one forward.
        self.table_width = pool.blocks_for(max_length + self.max_rows)
        self.use_graphs = graphs
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.memory_pool = None
        # Called with (bucket, staged rows) before each forward runs (how rank 0 of a tensor-parallel target
        # has the other ranks run the same forward).
        self.on_execute = None
        # Host buffers that forwards up to the maxima are staged in (`_staging`), used in turn, and on a GPU
        # each one's event that the copies out of it have finished.
        self.staging: list[TreeRows] = []
        self.staging_copies = StagingEvents(self.STAGING_BUFFERS, self.device)
        self.staged_in = 0  # the buffers the last forward was staged in
        # Made once, not per forward: each buffer set's StagingView of a (batch, rows), each bucket's views of the
        # static inputs and of its graph's outputs, and the bucket each (batch, rows) replays (the last three
        # forgotten when the graphs are captured again).
        self.staging_views: dict[tuple[int, int, int], StagingView] = {}
        self.static_views: dict[tuple[int, int], TreeRows] = {}
        self.output_views: dict[tuple[int, int], tuple[torch.Tensor | None, ...]] = {}
        self.buckets_of: dict[tuple[int, int], tuple[int, int] | None] = {}
        # Forwards run, by the bucket whose graph replayed them (None: eagerly), so that tests and benches can tell
        # which way a batch went.
        self.forwards: collections.Counter = collections.Counter()
        self.last_bucket: tuple[int, int] | None = None  # the bucket whose graph the last forward replayed, if any

    @property
    def buckets(self) -> list[tuple[int, int]]:
        batches = buckets_up_to(self.max_batch, powers_of_two_up_to(self.max_batch))
        return [(b, t) for b in batches for t in self.row_buckets]

    def _allocate_static(self) -> TreeRows:
        """Every graph's inputs, at the maxima, holding padding (nothing read, nothing written)."""
        return padded_rows(self.max_batch, self.max_rows, self.table_width, device=self.device)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first so the smaller ones fit in the memory pool the largest made;
        returns the seconds it took. The static inputs are reset to padding first: warm-up and capture run on
        them for real."""
        started = time.perf_counter()
        self.graphs.clear()
        self.buckets_of.clear()
        self.static_views.clear()
        self.output_views.clear()
        self.static = self._allocate_static()
        torch.cuda.synchronize()
        with cycle_collection_paused():
            for batch, rows in sorted(self.buckets, reverse=True):
                view = pad(self.static.view(batch, rows))  # each bucket lays the buffer out anew
                captured = capture_graph(lambda: self.forward(view), self.memory_pool)
                self.memory_pool = captured.graph.pool()
                self.graphs[(batch, rows)] = captured
        torch.cuda.synchronize()
        return time.perf_counter() - started

    @torch.inference_mode()
    def time_graphs(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of one replay of each captured graph (on its padding inputs: nothing is written)."""
        times = {}
        for key, captured in self.graphs.items():
            pad(self.static.view(*key))  # the buffer holds another bucket's layout
            samples = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                captured.graph.replay()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000)
            times[key] = sorted(samples)[len(samples) // 2]
        return times

    def bucket(self, batch: int, rows: int) -> tuple[int, int] | None:
        """The smallest captured (batch, rows) bucket that holds these sizes; None when none does."""
        fitting = [key for key in self.graphs if key[0] >= batch and key[1] >= rows]
        return min(fitting, default=None)

    @in_inference_mode
    def run(self, sequences: list[PagedSequence], tokens: list[list[int]], positions: list[np.ndarray],
            masks: list[torch.Tensor | np.ndarray | TreeShape]) -> tuple[torch.Tensor | None, ...]:
        """One forward over every request's new rows (reserved here in its sequence); returns the outputs
        viewed as (batch, rows, ...), padding included: request b's row i is [b, i] (a per-request output:
        (batch, ...), request b's at [b])."""
        if any(sequence.cache is not self.pool for sequence in sequences):
            raise TreeserveError("a sequence from another KV pool")
        batch, rows = len(sequences), max(len(t) for t in tokens)
        key = None  # graphs off, or beyond the maxima
        if self.use_graphs:
            key = self.buckets_of.get((batch, rows), ())  # (): not looked up yet (None is an answer)
            if key == ():
                key = self.buckets_of[(batch, rows)] = self.bucket(batch, rows)
        batch, rows = key or (batch, rows)
        view = self._staging(batch, rows)
        if view is None:
            staged = stage_trees(sequences, tokens, positions, masks, batch, rows, self.table_width)
        else:
            _stage_into(view, sequences, tokens, positions, masks, reused=True)
            staged = view.staged
        if self.on_execute is not None:
            self.on_execute(key, staged)
        return self.execute(key, staged)

    def _staging(self, batch: int, rows: int) -> StagingView | None:
        """Where to stage a forward of (batch, rows): a view of the next of STAGING_BUFFERS sets of host buffers,
        each allocated once at the maxima (page-locked on a GPU) and reused once the copies out of it have finished
        (queued two forwards back: normally long past); None beyond the maxima."""
        if batch > self.max_batch or rows > self.max_rows:
            return None
        if not self.staging:
            self.staging = [padded_rows(self.max_batch, self.max_rows, self.table_width, pin=self.device.type == "cuda")
                            for _ in range(self.STAGING_BUFFERS)]
        self.staged_in = (self.staged_in + 1) % self.STAGING_BUFFERS
        self.staging_copies.wait(self.staged_in)
        view = self.staging_views.get((self.staged_in, batch, rows))
        if view is None:
            if len(self.staging_views) >= self.STAGING_VIEWS:  # eagerly, any (batch, rows) up to the maxima comes
                self.staging_views.clear()
            view = self.staging_views[(self.staged_in, batch, rows)] = StagingView(
                self.staging[self.staged_in].view(batch, rows))
        return view

    @in_inference_mode
    def execute(self, key: tuple[int, int] | None, staged: TreeRows) -> tuple[torch.Tensor | None, ...]:
        """Run staged rows (host tensors): replay the graph of bucket `key`, or eagerly when `key` is None."""
        self.forwards[key] += 1
        self.last_bucket = key
        if key is None:
            on_device = staged.to(self.device, non_blocking=True)
            self._copied()
            batch = staged.paged.batch
            return self._per_request(self.forward(on_device), batch, staged.tokens.shape[0] // batch)
        static = self.static_views.get(key)
        if static is None:
            static = self.static_views[key] = self.static.view(*key)
        staged.copy_into(static)
        self._copied()
        captured = self.graphs[key]
        captured.graph.replay()
        outputs = self.output_views.get(key)  # a graph's outputs are the same tensors every replay
        if outputs is None:
            outputs = self.output_views[key] = self._per_request(captured.outputs, *key)
        return outputs

    def _per_request(self, outputs: tuple[torch.Tensor | None, ...], batch: int, rows: int
                     ) -> tuple[torch.Tensor | None, ...]:
        """A forward's outputs viewed as (batch, rows, ...), except the per-request ones."""
        per_row = len(outputs) - self.request_outputs
        return tuple(out if out is None or i >= per_row else out.view(batch, rows, *out.shape[1:])
                     for i, out in enumerate(outputs))

    def _copied(self) -> None:
        """Mark (on a GPU) where the copies out of the last staging buffers end in the stream."""
        self.staging_copies.copied(self.staged_in)
