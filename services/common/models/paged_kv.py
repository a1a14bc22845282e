"""A paged KV cache: one tensor for every layer's keys and values, handed out in fixed-size blocks.

`PagedKVCache.data` is (2, layers, num_blocks, block_size, kv_heads, head_dim); `layer(i)` gives that layer's
keys and values as views, the layout the tree-attention and KV-write kernels read. A `PagedSequence` owns the
blocks of one request: its committed prefix, then room for the tree being verified. After a round, `keep`
moves the accepted rows down to the end of the prefix (all layers in one copy) and returns the blocks past the
new end to the allocator, so a rejected branch holds nothing. `PagedAttention` runs one model forward for several
sequences over the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from treeserve.errors import TreeserveError
from treeserve.kernels.references import kv_move_reference
from treeserve.models.config import ModelConfig


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def free_count(self) -> int:
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_blocks):
            raise TreeserveError(f"KV cache full: {count} blocks wanted, {len(self.free_blocks)} free of "
                                 f"{self.num_blocks}")
        return [self.free_blocks.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(reversed(blocks))


class StagingEvents:
    """For page-locked host buffers used in turn to stage copies to a GPU: each buffer's event, recorded after
    its last copy, which must be made before the host refills it. The host waits on it only where its owner has
    not since waited for the device past that copy (`settled`): a round that reads its results back has, so in
    steady rounds the buffers are refilled without a driver call. Off a GPU, nothing to wait for."""

    def __init__(self, buffers: int, device: torch.device):
        on_gpu = device.type == "cuda"
        self.events = [torch.cuda.Event() for _ in range(buffers)] if on_gpu else None
        # Recorded on the device's stream current when made (its default: the services queue all their work there),
        # given each time: an event's record() without one looks the current stream up, several times its own cost.
        self.stream = torch.cuda.current_stream(device) if on_gpu else None
        self.queued = 0  # copies recorded so far
        self.last = [0] * buffers  # each buffer's last copy's number
        self.made = 0  # copies known to be made

    def wait(self, buffer: int) -> None:
        """Before refilling `buffer`: its last copy made."""
        if self.events is not None and self.last[buffer] > self.made:
            self.events[buffer].synchronize()

    def copied(self, buffer: int) -> None:
        """A copy out of `buffer` was queued."""
        if self.events is not None:
            self.events[buffer].record(self.stream)
            self.queued += 1
            self.last[buffer] = self.queued

    def settled(self, copies: int | None = None) -> None:
        """The device has made the first `copies` copies (default: every one queued so far): its owner waited for
        work queued after them."""
        self.made = max(self.made, self.queued if copies is None else copies)


def _slot_tensor(slots: list[int]) -> torch.Tensor:
    """Slot numbers as an int64 tensor (through NumPy: torch.tensor of a list costs several times more)."""
    return torch.from_numpy(np.array(slots, dtype=np.int64))


def _joined(moves: list[tuple]) -> tuple:
    """Several moves as one: slot numbers as one list each where all are lists, else tensors."""
    if all(isinstance(source, list) for source, _ in moves):
        return [slot for source, _ in moves for slot in source], [slot for _, target in moves for slot in target]
    return (torch.cat([torch.as_tensor(source) for source, _ in moves]),
            torch.cat([torch.as_tensor(target) for _, target in moves]))


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise TreeserveError(f"a paged KV cache needs blocks: got {num_blocks} blocks of {block_size} tokens")
        self.block_size = block_size
        self.block_offsets = np.arange(block_size, dtype=np.int64)  # a slot's offset in its block
        self.data = torch.zeros(2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        # When a list (rank 0 of a tensor-parallel target), every `move` is also recorded here, so the other
        # ranks can repeat it on their shards of the pool.
        self.recorded_moves: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.deferred_moves: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # inside `moves_together`
        self.held_moves: list[tuple[list[int] | torch.Tensor, list[int] | torch.Tensor]] = []  # moves_together(hold)
        # On a GPU, page-locked buffers that moves' slot numbers are staged in, in turn (grown as needed), and the
        # events of the copies out of them.
        self.move_staging: list[torch.Tensor | None] = [None, None]
        self.move_copies = StagingEvents(len(self.move_staging), self.data.device)
        self.move_turn = 0
        # Where a drafter conditions on the target's hidden states (`keep_features`): a row of them per slot, written
        # by the forward that writes the slot's keys and values and moved with them, plus one last row where
        # padding rows write.
        self.features: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.data.shape[2] * self.block_size

    def keep_features(self, width: int, dtype: torch.dtype) -> None:
        """Keep `width` feature values per slot from now on (those of earlier forwards are not kept). Raises
        torch.OutOfMemoryError where the device has no room for them (build_verifier leaves room for the features
        it is told of)."""
        if self.features is None or self.features.shape[1] != width or self.features.dtype != dtype:
            self.features = None  # (the old rows' memory back first)
            self.features = torch.zeros(self.num_slots + 1, width, dtype=dtype, device=self.data.device)

    def feature_rows(self, slots: np.ndarray) -> torch.Tensor:
        """The feature rows at these slots, on the host: one gather and one copy for any number of requests. The
        slots' forwards and moves must have been launched (a held move: `launch_held_moves` first)."""
        index = torch.from_numpy(slots)
        if not self.features.is_cuda:
            return self.features.index_select(0, index)
        return self.features.index_select(0, index.to(self.features.device)).cpu()

    def write_features(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """A forward's feature rows at its rows' slots (on the pool's device; slot -1: a padding row, which writes
        the last row), as its keys and values are written."""
        sink = torch.full_like(slots, len(self.features) - 1)
        self.features.index_copy_(0, torch.where(slots < 0, sink, slots), rows.to(self.features.dtype))

    def move(self, source: torch.Tensor | list[int], target: torch.Tensor | list[int]) -> None:
        """Copy the keys and values of every layer at slots `source` to slots `target` (host tensors, or lists of
        slot numbers). On a GPU, thousands of moves go in launches one after another, so no move may read a slot
        that an earlier one writes: an accepted path moved down to the end of its prefix never does, nor do several
        requests' paths together."""
        if self.deferred_moves is not None:
            self.deferred_moves.append((source, target))
            return
        self.launch_held_moves()  # (they came first)
        self._launch(source, target)

    def _launch(self, source: torch.Tensor | list[int], target: torch.Tensor | list[int]) -> None:
        if isinstance(source, list):
            source, target = _slot_tensor(source), _slot_tensor(target)
        if self.recorded_moves is not None:
            self.recorded_moves.append((source, target))
        moved = [self.slabs] if self.features is None else [self.slabs, self.features[None]]
        if not self.data.is_cuda:
            for slabs in moved:
                kv_move_reference(slabs, source, target)
            return
        source, target = self._slots_on_device(source, target)
        from treeserve.kernels.kv_move import kv_move  # (Triton: imported where a GPU is)
        for slabs in moved:
            kv_move(slabs, source, target)

    def _slots_on_device(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A move's slot numbers on the GPU, in one copy from a page-locked buffer allocated once, so that the copy
        does not make the host wait (a round waits once, for its picks)."""
        count = len(source)
        self.move_turn = (self.move_turn + 1) % len(self.move_staging)
        staging = self.move_staging[self.move_turn]
        if staging is None or len(staging) < 2 * count:
            staging = self.move_staging[self.move_turn] = torch.empty(max(2 * count, 4096), dtype=torch.long,
                                                                      pin_memory=True)
        else:
            self.move_copies.wait(self.move_turn)  # (its copy was queued a move back: long done)
        staging[:count], staging[count:2 * count] = source, target
        on_device = staging[:2 * count].to(self.data.device, non_blocking=True)
        self.move_copies.copied(self.move_turn)
        return on_device[:count], on_device[count:]

    @property
    def slabs(self) -> torch.Tensor:
        """The pool as (2 * layers, slots, row): one slab per keys or values of a layer, a row per slot."""
        _, _, blocks, block_size, kv_heads, head_dim = self.data.shape
        return self.data.view(-1, blocks * block_size, kv_heads * head_dim)

    def warm_up_moves(self) -> None:
        """On a GPU, compile the KV move's kernel for every move count now, not during the first rounds."""
        if self.data.is_cuda:
            from treeserve.kernels.kv_move import warm_up

            warm_up(self.slabs)
            if self.features is not None:
                warm_up(self.features[None])

    @contextlib.contextmanager
    def moves_together(self, hold: bool = False):
        """The moves made inside happen on leaving, as one copy. A round's accepted paths, moved request by
        request, cost two transfers and two indexing kernels each (at 64 requests, the host's launches add up);
        the requests' slots never overlap, so one copy does the same. Blocks freed inside are not handed out again
        before the copy: only a new reservation takes them, and none may be made inside.
        With `hold`, the copy waits for `launch_held_moves`, so that its launch can run off a round's path (while a
        drafter drafts): the next reservation or move launches it first, and a forward's caller must too."""
        if self.deferred_moves is not None:
            raise TreeserveError("moves_together does not nest")
        self.deferred_moves = []
        try:
            yield
        finally:
            moves, self.deferred_moves = self.deferred_moves, None
            if moves:
                joined = _joined(moves)
                if hold:
                    self.held_moves.append(joined)
                else:
                    self.move(*joined)

    def launch_held_moves(self) -> None:
        """The moves that moves_together(hold=True) left, in their order. One that fails stays held, so that the
        next reservation or forward fails with it rather than read rows it did not move."""
        while self.held_moves:
            self._launch(*self.held_moves[0])
            del self.held_moves[0]

    @staticmethod
    def blocks_that_fit(cfg: ModelConfig, block_size: int, dtype: torch.dtype, free_bytes: int,
                        fraction: float = 0.9, feature_width: int = 0) -> int:
        """How many blocks `fraction` of `free_bytes` holds (measure free memory after warm-up, then size), with
        `feature_width` feature values per slot beside the keys and values (keep_features)."""
        per_slot = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim + feature_width) * dtype.itemsize
        return int(free_bytes * fraction) // (per_slot * block_size)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold this many tokens."""
        return -(-tokens // self.block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[0, index], self.data[1, index]

    def sequence(self) -> "PagedSequence":
        return PagedSequence(self)


class PagedSequence:
    """One request's tokens in the cache: `length` committed, in `blocks` (its block table)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.blocks: list[int] = []
        self.length = 0

    def slots(self, start: int, count: int) -> torch.Tensor:
        """Cache slots (block * block_size + offset) of positions start .. start + count - 1."""
        return torch.from_numpy(self.slot_array(start, count))

    def slot_array(self, start: int, count: int) -> np.ndarray:
        """`slots` as int64 NumPy."""
        size = self.cache.block_size
        first, last = start // size, (start + count - 1) // size
        # A tree or an accepted path, mostly: one run of one block's slots, several times cheaper than the general
        # way, which was a visible part of a large batch's round of trees.
        if count > 0 and first == last:
            base = self.blocks[first] * size + start % size
            return np.arange(base, base + count, dtype=np.int64)
        # Every slot of the blocks the positions span (only those), block by block, then the positions' run of them.
        table = np.asarray(self.blocks[first:last + 1], dtype=np.int64)
        offset = start % size
        return (table[:, None] * size + self.cache.block_offsets).ravel()[offset:offset + count]

    def reserve(self, count: int) -> torch.Tensor:
        """Room for `count` pending rows after the committed ones; returns their slots."""
        return torch.from_numpy(self.reserve_array(count))

    def reserve_array(self, count: int) -> np.ndarray:
        """`reserve`, the slots as int64 NumPy."""
        self._grow(count)
        return self.slot_array(self.length, count)

    def reserve_one(self) -> int:
        """reserve(1), its slot as an integer: a plain step's row, for every request of every plain round."""
        self._grow(1)
        size = self.cache.block_size
        return self.blocks[self.length // size] * size + self.length % size

    def _grow(self, count: int) -> None:
        """Blocks enough for `count` pending rows after the committed ones."""
        if self.cache.held_moves:  # their rows may be in blocks handed out here, or in rows reserved here
            self.cache.launch_held_moves()
        needed = self.cache.blocks_for(self.length + count) - len(self.blocks)
        if needed > 0:
            if self.cache.deferred_moves is not None:  # a block freed inside could be handed out before its copy
                raise TreeserveError("blocks reserved while KV moves wait (inside moves_together)")
            self.blocks += self.cache.allocator.allocate(needed)

    @contextlib.contextmanager
    def ahead(self, rows: int):
        """For the duration, the first `rows` pending rows count as committed: what is reserved next comes after
        them and sees them as its prefix (a prompt verified in pieces, each after the ones before it). They are
        pending again afterwards, for `keep` to commit with the rest."""
        self.length += rows
        try:
            yield self
        finally:
            self.length -= rows

    def keep(self, pending_rows: list[int]) -> None:
        """Commit the pending rows at these indices (ascending) and free the blocks past the new end."""
        count = len(pending_rows)
        if pending_rows != list(range(count)):
            # As lists of slot numbers: for the few rows of an accepted path, Python's arithmetic costs less than
            # NumPy's or torch's calls, and a round's moves become one array (moves_together).
            self.cache.move(self._slot_numbers(pending_rows), self._slot_numbers(range(count)))
        self.commit(count)

    def commit(self, count: int) -> None:
        """Commit the first `count` pending rows, where they lie (0: drop every pending row), and free the blocks
        past the new end: `keep` of rows 0 .. count - 1, without the check for a move."""
        self.length += count
        self._trim()

    def _slot_numbers(self, rows) -> list[int]:
        """The slots of these pending rows (0: the first after the committed ones)."""
        size, blocks, length = self.cache.block_size, self.blocks, self.length
        return [blocks[(length + row) // size] * size + (length + row) % size for row in rows]

    def _trim(self) -> None:
        used = self.cache.blocks_for(self.length)
        if len(self.blocks) > used:
            self.cache.allocator.free(self.blocks[used:])
            del self.blocks[used:]

    def release(self) -> None:
        self.cache.allocator.free(self.blocks)
        self.blocks, self.length = [], 0


@dataclasses.dataclass
class PagedInputs:
    """Where one forward's new rows go in the paged cache and what each sees, for `batch` requests of up to
    `rows` new rows each (the kernels' padded layout; request b's row i is padded row b * rows + i).

    slots: the cache slot of each forward row, in the forward's own row order, -1 for a padding row (writes
    nowhere); tables (batch, width) int32: block tables; prefix_lens, new_counts (batch,) int32: committed rows,
    and new rows (0 for a padding request); tree_mask (batch, rows, rows) int8, or None for causal (a prompt)."""

    slots: torch.Tensor
    tables: torch.Tensor
    prefix_lens: torch.Tensor
    new_counts: torch.Tensor
    tree_mask: torch.Tensor | None

    @property
    def batch(self) -> int:
        return self.tables.shape[0]

    def tensors(self) -> list[torch.Tensor | None]:
        """The fields in their order (named, not looked up through dataclasses.fields: a forward's staging calls
        this)."""
        return [self.slots, self.tables, self.prefix_lens, self.new_counts, self.tree_mask]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PagedInputs":
        return PagedInputs(*(None if t is None else t.to(device, non_blocking=non_blocking)
                             for t in self.tensors()))


def block_table(sequences: list[PagedSequence], width: int | None = None) -> torch.Tensor:
    """(batch, width) int32 block tables, zero past each sequence's blocks (never read: lengths bound reads)."""
    tables = torch.zeros(len(sequences), width or max(len(s.blocks) for s in sequences), dtype=torch.int32)
    for b, sequence in enumerate(sequences):
        tables[b, :len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
    return tables


def paged_kernels(kernels: bool):
    """(kv_write, tree_attention): the Triton kernels (on a GPU, or under TRITON_INTERPRET=1), or their PyTorch
    references; both take the same arguments."""
    if kernels:
        from treeserve.kernels.kv_write import kv_write
        from treeserve.kernels.tree_attention import tree_attention
    else:
        from treeserve.kernels.references import kv_write_reference as kv_write
        from treeserve.kernels.references import tree_attention_reference as tree_attention
    return kv_write, tree_attention


class PagedAttention:
    """Attention for one forward over the paged cache: each layer writes the new keys/values at `inputs.slots`,
    then every new row attends to its request's prefix and to the new rows its mask allows.

    The model's rows are either already padded (batch * rows, the verifier's layout, fixed per CUDA graph), or
    packed (request 0's rows, then request 1's, ...: a prefill, where padding prompts to the longest would waste
    work); `packed_rows` (request index, row index) per forward row, and the padded width, then places them.

    `kernels` picks the Triton kernels over their PyTorch references (`paged_kernels`), so a test can hold one
    against the other."""

    def __init__(self, cache: PagedKVCache, inputs: PagedInputs, kernels: bool = False,
                 packed_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None):
        self.cache, self.inputs = cache, inputs
        self.packed_rows, self.packed_width = (packed_rows[:2], packed_rows[2]) if packed_rows else (None, 0)
        self.write, self.attend = paged_kernels(kernels)

    @classmethod
    def for_prompts(cls, sequences: list[PagedSequence], counts: list[int], kernels: bool = False
                    ) -> "PagedAttention":
        """Packed rows: `counts[b]` new causal rows of sequence b, after its committed prefix (reserved here)."""
        if len(sequences) != len(counts) or not sequences:
            raise TreeserveError(f"paged attention: {len(sequences)} sequences but {len(counts)} row counts")
        prefix_lens = torch.tensor([sequence.length for sequence in sequences], dtype=torch.int32)
        slots = torch.cat([sequence.reserve(n) for sequence, n in zip(sequences, counts)])
        inputs = PagedInputs(slots, block_table(sequences), prefix_lens, torch.tensor(counts, dtype=torch.int32),
                             None)
        batch_index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        row_index = torch.cat([torch.arange(n) for n in counts])
        return cls.on_device(sequences[0].cache, inputs, kernels, (batch_index, row_index, max(counts)))

    @classmethod
    def on_device(cls, cache: PagedKVCache, inputs: PagedInputs, kernels: bool,
                  packed_rows: tuple[torch.Tensor, torch.Tensor, int] | None) -> "PagedAttention":
        """From host tensors, which are kept (`inputs_cpu`, `packed_rows_cpu`: what another rank needs to run
        the same forward)."""
        device = cache.data.device
        device_rows = None if packed_rows is None else (packed_rows[0].to(device), packed_rows[1].to(device),
                                                        packed_rows[2])
        attention = cls(cache, inputs.to(device), kernels, device_rows)
        attention.inputs_cpu, attention.packed_rows_cpu = inputs, packed_rows
        return attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.layer(layer)
        inputs = self.inputs
        self.write(keys, values, k.to(keys.dtype), v.to(values.dtype), inputs.slots)
        if self.packed_rows is None:
            padded = q.view(inputs.batch, -1, *q.shape[1:])
        else:
            padded = q.new_zeros(inputs.batch, self.packed_width, *q.shape[1:])
            padded[self.packed_rows] = q
        out = self.attend(padded, keys, values, inputs.tables, inputs.prefix_lens, inputs.new_counts,
                          inputs.tree_mask)
        return out.view(q.shape) if self.packed_rows is None else out[self.packed_rows]
