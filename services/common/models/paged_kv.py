"""A paged KV cache: one tensor for every layer's keys and values, handed out in fixed-size blocks.

`PagedKVCache.data` is (2, layers, num_blocks, block_size, kv_heads, head_dim); `layer(i)` gives that layer's
keys and values as views, the layout the tree-attention and KV-write kernels read. A `PagedSequence` owns the
blocks of one request: its committed prefix, then room for the tree being verified. After a round, `keep`
moves the accepted rows down to the end of the prefix (all layers in one copy) and returns the blocks past the
new end to the allocator, so a rejected branch holds nothing. `PagedBatchAttention` runs one model forward for
several sequences over the pool.
"""

from __future__ import annotations

import torch

from treeserve.errors import TreeserveError
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


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise TreeserveError(f"a paged KV cache needs blocks: got {num_blocks} blocks of {block_size} tokens")
        self.block_size = block_size
        self.data = torch.zeros(2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def blocks_that_fit(cfg: ModelConfig, block_size: int, dtype: torch.dtype, free_bytes: int,
                        fraction: float = 0.9) -> int:
        """How many blocks `fraction` of `free_bytes` holds (measure free memory after warm-up, then size)."""
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        return int(free_bytes * fraction) // per_block

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
        size = self.cache.block_size
        positions = torch.arange(start, start + count)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[positions // size] * size + positions % size

    def reserve(self, count: int) -> torch.Tensor:
        """Room for `count` pending rows after the committed ones; returns their slots."""
        needed = -(-(self.length + count) // self.cache.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks += self.cache.allocator.allocate(needed)
        return self.slots(self.length, count)

    def keep(self, pending_rows: list[int]) -> None:
        """Commit the pending rows at these indices (ascending) and free the blocks past the new end."""
        count = len(pending_rows)
        if pending_rows != list(range(count)):
            flat = self.cache.data.flatten(2, 3)  # (2, layers, slots, kv_heads, head_dim)
            source = self.slots(self.length, max(pending_rows) + 1)[pending_rows].to(flat.device)
            target = self.slots(self.length, count).to(flat.device)
            flat[:, :, target] = flat[:, :, source]  # advanced indexing copies first: overlaps are safe
        self.length += count
        self._trim()

    def _trim(self) -> None:
        used = -(-self.length // self.cache.block_size)
        if len(self.blocks) > used:
            self.cache.allocator.free(self.blocks[used:])
            del self.blocks[used:]

    def release(self) -> None:
        self.cache.allocator.free(self.blocks)
        self.blocks, self.length = [], 0


class PagedBatchAttention:
    """Attention for one forward over several requests in the paged cache. Rows come as the engine lays them
    out: request 0's rows, then request 1's, and so on. Each request's new keys and values go to slots reserved
    after its committed prefix; each new row sees that whole prefix and, among the request's new rows, what its
    mask allows (a tree's ancestors and itself, or causal for a prefill). After the forward, the caller commits
    rows with `sequence.keep(...)`; `keep([])` drops them all.

    `kernels` picks the Triton kernels (on a GPU, or under TRITON_INTERPRET=1) over their PyTorch references;
    both take the same arguments, so a test can hold one against the other."""

    def __init__(self, sequences: list[PagedSequence], masks: list[torch.Tensor], kernels: bool = False):
        if len(sequences) != len(masks) or not sequences:
            raise TreeserveError(f"paged attention: {len(sequences)} sequences but {len(masks)} masks")
        self.cache = sequences[0].cache
        device = self.cache.data.device
        sizes = [mask.shape[0] for mask in masks]
        prefix_lens = [sequence.length for sequence in sequences]
        self.slots = torch.cat([sequence.reserve(n) for sequence, n in zip(sequences, sizes)]).to(device)
        batch, rows = len(sequences), max(sizes)
        self.tables = torch.zeros(batch, max(len(s.blocks) for s in sequences), dtype=torch.int32)
        self.tree_mask = torch.zeros(batch, rows, rows, dtype=torch.bool)
        for b, (sequence, mask) in enumerate(zip(sequences, masks)):
            self.tables[b, :len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
            self.tree_mask[b, :sizes[b], :sizes[b]] = mask
        self.tables, self.tree_mask = self.tables.to(device), self.tree_mask.to(device)
        self.prefix_lens = torch.tensor(prefix_lens, device=device)
        self.tree_sizes = torch.tensor(sizes, device=device)
        # Flat row i is row row_index[i] of request batch_index[i] in the padded (batch, rows) layout.
        self.batch_index = torch.repeat_interleave(torch.arange(batch), torch.tensor(sizes)).to(device)
        self.row_index = torch.cat([torch.arange(n) for n in sizes]).to(device)
        self.padded_rows = rows
        if kernels:
            from treeserve.kernels.kv_write import kv_write
            from treeserve.kernels.tree_attention import tree_attention
        else:
            from treeserve.kernels.references import kv_write_reference as kv_write
            from treeserve.kernels.references import tree_attention_reference as tree_attention
        self.write, self.attend = kv_write, tree_attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.layer(layer)
        self.write(keys, values, k.to(keys.dtype), v.to(values.dtype), self.slots)
        padded = q.new_zeros(len(self.tables), self.padded_rows, *q.shape[1:])
        padded[self.batch_index, self.row_index] = q
        out = self.attend(padded, keys, values, self.tables, self.prefix_lens, self.tree_sizes, self.tree_mask)
        return out[self.batch_index, self.row_index]
