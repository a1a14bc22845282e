"""Tree verification over the verifier's paged KV pool, through a PagedRunner (treeserve.models.graphs: the
padded layout, the CUDA graphs and their rules) whose rows buckets are the tree sizes a round verifies; and the
pool's size from the memory a GPU has free after warm-up."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time

import numpy as np
import torch

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM
from treeserve.models.graphs import PagedRunner, TreeRows, buckets_up_to
from treeserve.models.paged_kv import PagedAttention, PagedInputs, PagedKVCache, PagedSequence
from treeserve.tree import MAX_BUDGET, TreeShape
from treeserve.verifier.rows import Rows, gather
from treeserve.verifier.tensor_parallel import agreed_blocks

log = logging.getLogger("treeserve.verifier")

# Tree sizes a round verifies, root included: plain decoding (1), then budgets 1, 2, 4, ..., MAX_BUDGET.
TREE_BUCKETS = (1,) + tuple(2 ** i + 1 for i in range(MAX_BUDGET.bit_length()))


def causal_mask(rows: int) -> torch.Tensor:
    return torch.ones(rows, rows, dtype=torch.bool).tril_()


class TreeVerifier:
    """The target's tree verification over one paged pool, through a PagedRunner whose row buckets are the tree
    sizes up to `max_tree` (`kernels`: the Triton kernels, by default on a GPU only; elsewhere their PyTorch
    references). With `graphs`, call `capture(feature_layer_ids)` once the drafters' feature layers are known."""

    PREFILL_PIECES = 8  # with graphs: prompts of up to this many times the largest rows bucket go in pieces

    def __init__(self, model: DecoderLM, pool: PagedKVCache, max_batch: int, max_tree: int = MAX_BUDGET + 1,
                 graphs: bool = False, kernels: bool | None = None):
        if not 1 <= max_tree <= MAX_BUDGET + 1:
            raise TreeserveError(f"trees of 1 to {MAX_BUDGET + 1} nodes, not {max_tree}")
        self.model, self.pool = model, pool
        self.kernels = pool.data.device.type == "cuda" if kernels is None else kernels
        self.max_tree = max_tree
        self.feature_layer_ids: tuple[int, ...] = ()
        self.runner = PagedRunner(pool, self._forward, max_batch, buckets_up_to(max_tree, TREE_BUCKETS),
                                  model.config.max_context, graphs)
        self.captured_features: tuple[int, ...] | None = None
        self.flat_outputs: dict[tuple[int, int], tuple] = {}  # each graph's outputs, flattened (verify)
        self.mirror = None  # on rank 0 of a tensor-parallel target: the other ranks' channel (tensor_parallel)
        # Prompts of up to this many rows buckets are prefilled in pieces through the runner (`prefill_in_pieces`),
        # longer ones in one eager forward (`prefill`). With graphs, 8 pieces: an eager prefill launches every
        # kernel from Python, which pieces replayed from graphs avoid, while a long prompt in pieces would reread
        # the weights once per piece on a large model. Without graphs, 0: one packed eager forward is cheaper.
        self.prefill_pieces = self.PREFILL_PIECES if graphs else 0
        # The causal mask of a piece of each length, made once, not per piece and round: making them was a visible
        # part of a large batch's rounds with new prompts.
        self.piece_masks = [causal_mask(rows) for rows in range(self.runner.max_rows + 1)]

    def mirror_to(self, mirror) -> None:
        """Rank 0 of a tensor-parallel target: send every forward, capture and KV move to the other ranks first."""
        self.mirror = mirror
        self.pool.recorded_moves = []
        self.runner.on_execute = lambda key, staged: mirror.send(  # the staged bytes alone, not their whole buffer
            "run", key=key, staged=staged.packed[:staged.packed_bytes], shape=staged.shape,
            feature_layer_ids=self.feature_layer_ids)

    @property
    def use_graphs(self) -> bool:
        return self.runner.use_graphs

    def _forward(self, rows: TreeRows):
        attention = PagedAttention(self.pool, rows.paged, kernels=self.kernels)
        logits, hidden = self.model(rows.tokens, rows.positions, attention, hidden_layer_ids=self.feature_layer_ids)
        return logits, self._features_kept(hidden, rows.paged.slots)

    def _features_kept(self, hidden: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor | None:
        """A forward's features (its hidden states at the feature layers, concatenated per row), written at the
        rows' slots where the pool keeps them; None without feature layers."""
        features = torch.cat(hidden, dim=-1) if hidden else None
        if features is not None and self.pool.features is not None:
            self.pool.write_features(slots, features)
        return features

    def keep_features(self, feature_layer_ids: tuple[int, ...]) -> None:
        """Keep every token's features of these layers in the pool, at its slot (PagedKVCache.keep_features), where
        a drafter in another process reads them (`kept_feature_rows`); before capturing, so that the graphs write
        them (`verify` recaptures graphs captured without). Raises torch.OutOfMemoryError where they do not fit."""
        if feature_layer_ids:
            self.pool.keep_features(len(feature_layer_ids) * self.model.config.hidden_size, self.pool.data.dtype)
            self.pool.warm_up_moves()

    def capture(self, feature_layer_ids: tuple[int, ...] = ()) -> None:
        if self.mirror is not None:  # every rank captures: the graphs hold their collectives
            self.mirror.send("capture", feature_layer_ids=tuple(feature_layer_ids))
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.flat_outputs.clear()
        seconds = self.runner.capture()
        self.captured_features = self.feature_layer_ids
        log.info("captured %d CUDA graphs (batch up to %d, trees up to %d nodes) in %.1f s",
                 len(self.runner.graphs), self.runner.max_batch, self.max_tree, seconds)

    def time_graphs(self) -> dict[tuple[int, int], float]:
        """Seconds of one replay of each captured graph (PagedRunner.time_graphs); under tensor parallelism every
        rank replays with rank 0, since the graphs hold collectives."""
        if self.mirror is not None:
            self.mirror.send("time_graphs")
        return self.runner.time_graphs()

    def verify(self, sequences: list[PagedSequence], tokens: list[list[int]], positions: list[np.ndarray],
               masks: list[torch.Tensor | TreeShape], feature_layer_ids: tuple[int, ...] = ()
               ) -> tuple[list[Rows], list[Rows | None]]:
        """One forward of every request's tree; returns each request's logits (its nodes' rows) and features, as
        rows of the forward's outputs (overwritten by the next replay of the same graph)."""
        if self.use_graphs and self.captured_features != tuple(feature_layer_ids):
            log.warning("recapturing the CUDA graphs for feature layers %s", list(feature_layer_ids))
            self.capture(feature_layer_ids)
        self.feature_layer_ids = tuple(feature_layer_ids)
        logits, features = self.runner.run(sequences, tokens, positions, masks)
        rows = logits.shape[1]  # padded: request b's nodes are rows b * rows .. of the flattened outputs
        spans = [range(b * rows, b * rows + len(t)) for b, t in enumerate(tokens)]
        key = self.runner.last_bucket  # a graph's: the same outputs every replay, flattened once
        flat = self.flat_outputs.get(key) if key is not None else None
        if flat is None:
            flat = (logits.flatten(0, 1), None if features is None else features.flatten(0, 1))
            if key is not None:
                self.flat_outputs[key] = flat
        all_logits, all_features = flat
        per_logits = [Rows(all_logits, span) for span in spans]
        if all_features is None:
            return per_logits, [None] * len(spans)
        return per_logits, [Rows(all_features, span) for span in spans]

    def prefills_in_pieces(self, rows: int) -> bool:
        """Whether a prompt of this many rows is prefilled through the runner (`prefill_in_pieces`)."""
        return rows <= self.prefill_pieces * self.runner.max_rows

    def prefill_in_pieces(self, sequences: list[PagedSequence], prompts: list[list[int]],
                          feature_layer_ids: tuple[int, ...] = ()
                          ) -> tuple[list[Rows], list[Rows | None]]:
        """Prompts through the runner (replaying its CUDA graphs) in pieces of up to its largest rows bucket: the
        k-th piece of every prompt in one forward, causal within itself and after the pieces before it. Returns
        each prompt's logits at its last row (one row) and its rows' features; every row is left pending in its
        sequence, as `prefill` leaves them, for the caller to keep."""
        size = self.runner.max_rows
        logits: list[Rows | None] = [None] * len(prompts)
        pieces_features: list[list[torch.Tensor]] = [[] for _ in prompts]
        for start in range(0, max(map(len, prompts)), size):
            active = [j for j, prompt in enumerate(prompts) if len(prompt) > start]
            pieces = [prompts[j][start:start + size] for j in active]
            with contextlib.ExitStack() as earlier_pieces:
                for j in active:
                    earlier_pieces.enter_context(sequences[j].ahead(start))
                found = self.verify([sequences[j] for j in active], pieces,
                                    [np.arange(len(piece)) + start for piece in pieces],
                                    [self.piece_masks[len(piece)] for piece in pieces], feature_layer_ids)
            # Copied out: the next replay of the same graph overwrites its outputs.
            for j, piece, piece_logits, piece_features in zip(active, pieces, *found):
                if start + len(piece) == len(prompts[j]):
                    logits[j] = Rows(gather([piece_logits[-1:]], copy=True))
                if piece_features is not None:
                    pieces_features[j].append(gather([piece_features], copy=True))
        features = [Rows(chunks[0] if len(chunks) == 1 else torch.cat(chunks)) if chunks else None
                    for chunks in pieces_features]
        return logits, features

    # Prompt batches (tokens per prompt) whose prefills meet every compiled variant of the prefill's other Triton
    # kernels (Triton compiles an integer argument apart when it is 1 or a multiple of 16); the attention's
    # variants are launched one by one (`warm_up_kernels`).
    WARM_UP_PROMPTS = ((1,), (2,), (5,), (16,), (37,), (3, 64), (200, 7))

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile every variant of the tree-attention kernels a prefill can meet, and of the KV move a round can
        make (on every tensor-parallel rank)."""
        from treeserve.kernels import tree_attention

        if self.mirror is not None:
            self.mirror.send("warm_up_kernels")
        cfg = self.model.config
        tree_attention.warm_up(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.pool.block_size,
                               self.pool.data.dtype, self.pool.data.device)
        self.pool.warm_up_moves()

    @torch.inference_mode()
    def warm_up_prefill(self, feature_layer_ids: tuple[int, ...] = ()) -> float:
        """Throwaway prefills of WARM_UP_PROMPTS and the attention's variants, so that their kernels compile at
        start-up, not during the first requests (which otherwise run far slower while they compile); the pool is as
        before afterwards. Returns the seconds it took."""
        started = time.perf_counter()
        if self.kernels:
            self.warm_up_kernels()
        for counts in self.WARM_UP_PROMPTS:
            if sum(self.pool.blocks_for(count) for count in counts) > self.pool.allocator.free_count:
                continue  # a pool this small (--kv-cache-tokens) serves no prompt of this size either
            sequences = [self.pool.sequence() for _ in counts]
            try:
                attention = PagedAttention.for_prompts(sequences, list(counts), self.kernels)
                last_rows = torch.tensor(list(itertools.accumulate(counts))) - 1
                self.prefill(attention, torch.zeros(sum(counts), dtype=torch.long),
                             torch.cat([torch.arange(count) for count in counts]), last_rows, feature_layer_ids)
            finally:
                for sequence in sequences:
                    sequence.release()
        if self.pool.data.device.type == "cuda":
            torch.cuda.synchronize(self.pool.data.device)
        return time.perf_counter() - started

    @torch.inference_mode()
    def prefill(self, attention: PagedAttention, tokens: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor, feature_layer_ids: tuple[int, ...] = ()):
        """One eager forward of packed prompt rows (`PagedAttention.for_prompts`, over this pool; tokens,
        positions and logits_rows on the host); returns the model's logits of `logits_rows` and its rows' features
        (their hidden states after `feature_layer_ids`, concatenated per row), or None without feature layers."""
        if self.mirror is not None:
            self.mirror.send("prefill", inputs=attention.inputs_cpu, packed_rows=attention.packed_rows_cpu,
                             tokens=tokens, positions=positions, logits_rows=logits_rows,
                             feature_layer_ids=tuple(feature_layer_ids))
        device = self.pool.data.device
        logits, hidden = self.model(tokens.to(device, non_blocking=True), positions.to(device, non_blocking=True),
                                    attention, logits_rows=logits_rows.to(device), hidden_layer_ids=feature_layer_ids)
        return logits, self._features_kept(hidden, attention.inputs.slots)


# KV pool of a CPU verifier (GPU pools are sized from free memory): enough for several long requests, small
# enough for a laptop.
CPU_KV_CACHE_TOKENS = 16384


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


def build_verifier(model: DecoderLM, max_batch: int, graphs: bool = False, kv_cache_tokens: int = 0,
                   block_size: int = 16, memory_fraction: float = 0.9, max_tree: int = MAX_BUDGET + 1,
                   feature_layer_ids: tuple[int, ...] = ()) -> TreeVerifier:
    """The verifier's paged pool and tree verifier (with `graphs`, from `graphs_wanted`, not captured yet:
    `capture` once the feature layers are known). `kv_cache_tokens` 0 sizes the pool: on a GPU,
    `memory_fraction` of the memory left free after room for the largest verification (the graphs' memory pool)
    and the longest prefill; on the CPU, CPU_KV_CACHE_TOKENS. A GPU pool leaves room for each slot's features of
    `feature_layer_ids` (the drafters' known at start), which `TreeVerifier.keep_features` then keeps (rank 0
    only, under tensor parallelism: the features come from there)."""
    cfg = model.config
    if kv_cache_tokens > 0:
        num_blocks = -(-kv_cache_tokens // block_size)
    elif model.device.type == "cuda":
        verify_peak = activation_peak(model, max_batch, max_tree)
        prefill_peak = activation_peak(model, 1, cfg.max_context, torch.tensor([0], device=model.device))
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(model.device)
        num_blocks = PagedKVCache.blocks_that_fit(cfg, block_size, model.dtype, free - verify_peak - prefill_peak,
                                                  memory_fraction, len(feature_layer_ids) * cfg.hidden_size)
        log.info("activations: %.2f GiB for the largest verification, %.2f GiB for the longest prefill; "
                 "%.2f GiB free", verify_peak / 2**30, prefill_peak / 2**30, free / 2**30)
    else:
        num_blocks = -(-CPU_KV_CACHE_TOKENS // block_size)
    num_blocks = agreed_blocks(num_blocks, model.device)  # tensor-parallel ranks: the same pool on each
    if num_blocks < 1:
        raise TreeserveError("no memory left for the KV cache: lower --max-batch or set --kv-cache-tokens")
    pool = PagedKVCache(cfg, num_blocks, block_size, model.dtype, model.device)
    log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", num_blocks, block_size,
             num_blocks * block_size, pool.data.numel() * pool.data.element_size() / 2**30)
    return TreeVerifier(model, pool, max_batch, max_tree, graphs=graphs)
