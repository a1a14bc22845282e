"""Tree verification over the paged KV cache in a fixed (batch, rows) layout, run eagerly or replayed from CUDA
graphs captured per (batch bucket x tree bucket).

A verification forward has the shape of its bucket: requests padded up to the batch bucket (zero new rows: they
read and write nothing) and each tree padded up to the tree bucket (slot -1: the row writes nowhere, and the
kernel's row bound hides it). Logits and sampling stay outside the graph.

The rules from DESIGN.md ("What broke"): every static input of every graph is allocated here, before the first
capture, sized from the declared maxima (a bucket's inputs are views of those buffers, so none can be missing or
too small); the tree mask is tree x tree (the prefix is always visible); replay checks the sizes it is handed; and
a test replays every bucket against eager execution.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM
from treeserve.models.paged_kv import PagedAttention, PagedInputs, PagedKVCache, PagedSequence
from treeserve.tree import MAX_BUDGET

log = logging.getLogger("treeserve.verifier")

# Tree sizes a round verifies, root included: plain decoding (1), then budgets 1, 2, 4, ..., MAX_BUDGET.
TREE_BUCKETS = (1,) + tuple(2 ** i + 1 for i in range(MAX_BUDGET.bit_length()))


def buckets_up_to(maximum: int, sizes: tuple[int, ...]) -> list[int]:
    """The sizes below `maximum`, then `maximum` itself (so the maximum is always captured)."""
    return sorted({size for size in sizes if size < maximum} | {maximum})


def powers_of_two_up_to(maximum: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(maximum.bit_length()))


@dataclasses.dataclass
class TreeRows:
    """One verification forward's inputs, padded to (batch, rows); row b * rows + i is node i of request b."""

    tokens: torch.Tensor  # (batch * rows,) int64
    positions: torch.Tensor  # (batch * rows,) int64
    paged: PagedInputs

    def to(self, device: torch.device, non_blocking: bool = False) -> "TreeRows":
        return TreeRows(self.tokens.to(device, non_blocking=non_blocking),
                        self.positions.to(device, non_blocking=non_blocking), self.paged.to(device, non_blocking))


def stage_trees(sequences: list[PagedSequence], tokens: list[list[int]], positions: list[torch.Tensor],
                masks: list[torch.Tensor], batch: int, rows: int, table_width: int, pin: bool) -> TreeRows:
    """Host tensors of a verification forward: each request's tree (reserving its rows in the pool), padded to
    (batch, rows). `pin`: page-locked, so the copies to the GPU do not wait on it."""
    def new(shape, fill, dtype):
        return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

    flat_tokens, flat_positions = new((batch, rows), 0, torch.long), new((batch, rows), 0, torch.long)
    slots = new((batch, rows), -1, torch.long)
    tables = new((batch, table_width), 0, torch.int32)
    prefix_lens, counts = new((batch,), 0, torch.int32), new((batch,), 0, torch.int32)
    tree_mask = new((batch, rows, rows), 0, torch.int8)
    for b, (sequence, tree_tokens, tree_positions, mask) in enumerate(zip(sequences, tokens, positions, masks)):
        n = len(tree_tokens)
        prefix_lens[b], counts[b] = sequence.length, n
        slots[b, :n] = sequence.reserve(n)
        if len(sequence.blocks) > table_width:
            raise TreeserveError(f"a sequence of {len(sequence.blocks)} blocks exceeds the block table's "
                                 f"{table_width}")
        tables[b, :len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
        flat_tokens[b, :n] = torch.tensor(tree_tokens)
        flat_positions[b, :n] = tree_positions
        tree_mask[b, :n, :n] = mask
    paged = PagedInputs(slots.view(-1), tables, prefix_lens, counts, tree_mask)
    return TreeRows(flat_tokens.view(-1), flat_positions.view(-1), paged)


@dataclasses.dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (batch * rows, vocab) float32, written by each replay
    features: torch.Tensor | None  # (batch * rows, feature size)


class TreeVerifier:
    """Runs verification forwards over one paged pool: with `graphs`, by replaying the smallest captured bucket
    that holds the batch (capture with `capture()`; a batch beyond the maxima runs eagerly); without, eagerly at
    the batch's own padded size, through the same inputs and the same kernels (`kernels`: the Triton kernels,
    by default on a GPU only; elsewhere their PyTorch references)."""

    def __init__(self, model: DecoderLM, pool: PagedKVCache, max_batch: int, max_tree: int = MAX_BUDGET + 1,
                 graphs: bool = False, kernels: bool | None = None):
        if not 1 <= max_tree <= MAX_BUDGET + 1 or max_batch < 1:
            raise TreeserveError(f"graph maxima out of range: batch {max_batch}, tree {max_tree} (at most "
                                 f"{MAX_BUDGET + 1} nodes)")
        if graphs and pool.data.device.type != "cuda":
            raise TreeserveError("CUDA graphs need the model on a CUDA device")
        self.model, self.pool = model, pool
        self.device = pool.data.device
        self.kernels = self.device.type == "cuda" if kernels is None else kernels
        self.max_batch, self.max_tree = max_batch, max_tree
        # Wide enough for the longest sequence Generation admits: a full context plus one tree.
        self.table_width = -(-(model.config.max_context + max_tree) // pool.block_size)
        self.use_graphs = graphs
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.captured_features: tuple[int, ...] | None = None
        self.memory_pool = None
        if graphs:
            self.static = self._allocate_static()

    @property
    def buckets(self) -> list[tuple[int, int]]:
        batches = buckets_up_to(self.max_batch, powers_of_two_up_to(self.max_batch))
        return [(b, t) for b in batches for t in buckets_up_to(self.max_tree, TREE_BUCKETS)]

    def _allocate_static(self) -> TreeRows:
        """Every graph's inputs, at the maxima, holding padding (nothing read, nothing written)."""
        with torch.inference_mode():
            rows = stage_trees([], [], [], [], self.max_batch, self.max_tree, self.table_width, pin=False)
            return rows.to(self.device)

    def _static_view(self, batch: int, rows: int) -> TreeRows:
        s, n = self.static, batch * rows
        mask = s.paged.tree_mask.view(-1)[:n * rows].view(batch, rows, rows)
        paged = PagedInputs(s.paged.slots[:n], s.paged.tables[:batch], s.paged.prefix_lens[:batch],
                            s.paged.new_counts[:batch], mask)
        return TreeRows(s.tokens[:n], s.positions[:n], paged)

    def _forward(self, rows: TreeRows, feature_layer_ids: tuple[int, ...]):
        attention = PagedAttention(self.pool, rows.paged, kernels=self.kernels)
        logits, hidden = self.model(rows.tokens, rows.positions, attention, hidden_layer_ids=feature_layer_ids)
        return logits, torch.cat(hidden, dim=-1) if hidden else None

    @torch.inference_mode()
    def capture(self, feature_layer_ids: tuple[int, ...] = ()) -> None:
        """Capture every bucket, largest first so the smaller ones fit in the memory pool the largest made.
        The static inputs are reset to padding first: warm-up and capture run on them for real."""
        started = time.perf_counter()
        self.graphs.clear()
        self.static = self._allocate_static()
        torch.cuda.synchronize()
        for batch, rows in sorted(self.buckets, reverse=True):
            view = self._static_view(batch, rows)
            self._forward(view, feature_layer_ids)  # warm-up: Triton compiles, cuBLAS picks its kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                logits, features = self._forward(view, feature_layer_ids)
            self.memory_pool = graph.pool()
            self.graphs[(batch, rows)] = CapturedGraph(graph, logits, features)
        torch.cuda.synchronize()
        self.captured_features = tuple(feature_layer_ids)
        log.info("captured %d CUDA graphs (batch up to %d, trees up to %d nodes) in %.1f s", len(self.graphs),
                 self.max_batch, self.max_tree, time.perf_counter() - started)

    def bucket(self, batch: int, rows: int) -> tuple[int, int] | None:
        """The smallest captured (batch, rows) bucket that holds these sizes; None when none does."""
        fitting = [key for key in self.graphs if key[0] >= batch and key[1] >= rows]
        return min(fitting, default=None)

    @torch.inference_mode()
    def verify(self, sequences: list[PagedSequence], tokens: list[list[int]], positions: list[torch.Tensor],
               masks: list[torch.Tensor], feature_layer_ids: tuple[int, ...] = ()
               ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One forward of every request's tree; returns each request's logits (its nodes' rows) and features."""
        if any(sequence.cache is not self.pool for sequence in sequences):
            raise TreeserveError("a sequence from another KV pool")
        batch, rows = len(sequences), max(len(t) for t in tokens)
        if self.use_graphs and self.captured_features != tuple(feature_layer_ids):
            log.warning("recapturing the CUDA graphs for feature layers %s", list(feature_layer_ids))
            self.capture(feature_layer_ids)
        key = self.bucket(batch, rows) if self.use_graphs else None
        if key is None:  # graphs off, or a batch beyond the captured maxima
            staged = stage_trees(sequences, tokens, positions, masks, batch, rows, self.table_width,
                                 pin=self.device.type == "cuda")
            logits, features = self._forward(staged.to(self.device, non_blocking=True), feature_layer_ids)
        else:
            batch, rows = key
            staged = stage_trees(sequences, tokens, positions, masks, batch, rows, self.table_width, pin=True)
            self._load(self._static_view(batch, rows), staged)
            captured = self.graphs[key]
            captured.graph.replay()
            logits, features = captured.logits, captured.features
        sizes = [len(t) for t in tokens]
        logits = logits.view(batch, rows, -1)
        per_logits = [logits[b, :n] for b, n in enumerate(sizes)]
        if features is None:
            return per_logits, [None] * len(sizes)
        features = features.view(batch, rows, -1)
        return per_logits, [features[b, :n] for b, n in enumerate(sizes)]

    @staticmethod
    def _load(static: TreeRows, staged: TreeRows) -> None:
        """Copy a staged batch into a bucket's static inputs (asynchronously: `staged` is page-locked)."""
        pairs = [(static.tokens, staged.tokens), (static.positions, staged.positions)]
        pairs += zip(static.paged.tensors(), staged.paged.tensors())
        for target, source in pairs:
            if target.shape != source.shape:
                raise TreeserveError(f"graph input of shape {tuple(source.shape)} for a bucket of "
                                     f"{tuple(target.shape)}")
            target.copy_(source, non_blocking=True)


# KV pool of a CPU verifier (GPU pools are sized from free memory): enough for several long requests, small
# enough for a laptop.
CPU_KV_CACHE_TOKENS = 16384
GRAPH_CHOICES = ("auto", "on", "off")  # auto: on with CUDA


def graphs_wanted(choice: str, device: torch.device | str) -> bool:
    if choice not in GRAPH_CHOICES:
        raise TreeserveError(f"cuda graphs must be one of {', '.join(GRAPH_CHOICES)}, got {choice!r}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "on" and not on_cuda:
        raise TreeserveError("CUDA graphs need --device cuda")
    return on_cuda if choice == "auto" else choice == "on"


@torch.inference_mode()
def activation_peak(model: DecoderLM, batch: int, rows: int, logits_rows: torch.Tensor | None = None) -> int:
    """Bytes a forward of batch x rows padding rows allocates beyond what is already held (the KV cache is
    neither read nor written: every slot is -1, every request empty)."""
    device = model.device
    scratch = PagedKVCache(model.config, 1, 1, model.dtype, device)
    empty = torch.zeros(batch, dtype=torch.int32, device=device)
    inputs = PagedInputs(torch.full((batch * rows,), -1, device=device), torch.zeros(batch, 1, dtype=torch.int32,
                         device=device), empty, empty, None)
    flat = torch.zeros(batch * rows, dtype=torch.long, device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    model(flat, flat, PagedAttention(scratch, inputs, kernels=True), logits_rows=logits_rows)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def build_verifier(model: DecoderLM, max_batch: int, graphs: str = "auto", kv_cache_tokens: int = 0,
                   block_size: int = 16, memory_fraction: float = 0.9, max_tree: int = MAX_BUDGET + 1
                   ) -> TreeVerifier:
    """The verifier's paged pool and tree verifier (graphs not captured yet: `capture` once the feature layers
    are known). `kv_cache_tokens` 0 sizes the pool: on a GPU, `memory_fraction` of the memory left free after
    room for the largest verification (the graphs' memory pool) and the longest prefill; on the CPU,
    CPU_KV_CACHE_TOKENS."""
    use_graphs = graphs_wanted(graphs, model.device)
    cfg = model.config
    if kv_cache_tokens > 0:
        num_blocks = -(-kv_cache_tokens // block_size)
    elif model.device.type == "cuda":
        verify_peak = activation_peak(model, max_batch, max_tree)
        prefill_peak = activation_peak(model, 1, cfg.max_context, torch.tensor([0], device=model.device))
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(model.device)
        num_blocks = PagedKVCache.blocks_that_fit(cfg, block_size, model.dtype,
                                                  free - verify_peak - prefill_peak, memory_fraction)
        log.info("activations: %.2f GiB for the largest verification, %.2f GiB for the longest prefill; "
                 "%.2f GiB free", verify_peak / 2**30, prefill_peak / 2**30, free / 2**30)
    else:
        num_blocks = -(-CPU_KV_CACHE_TOKENS // block_size)
    if num_blocks < 1:
        raise TreeserveError("no memory left for the KV cache: lower --max-batch or set --kv-cache-tokens")
    pool = PagedKVCache(cfg, num_blocks, block_size, model.dtype, model.device)
    log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", num_blocks, block_size,
             num_blocks * block_size, pool.data.numel() * pool.data.element_size() / 2**30)
    return TreeVerifier(model, pool, max_batch, max_tree, graphs=use_graphs)
