"""Writing a forward's new keys and values into the paged KV cache.

Row i goes to slot `slots[i]` = block * block_size + offset of the cache (num_blocks, block_size, kv_heads,
head_dim); a slot of -1 marks a padding row (a graph's unused batch or tree positions), which writes nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(keys_ptr, values_ptr, new_keys_ptr, new_values_ptr, slots_ptr, stride_new_keys,
                     stride_new_values, ROW_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        # ROW_SIZE (kv_heads * head_dim) is fixed per model, so the loop unrolls at compile time.
        for start in tl.static_range(0, ROW_SIZE, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < ROW_SIZE
            k = tl.load(new_keys_ptr + row * stride_new_keys + cols, mask=ok)
            v = tl.load(new_values_ptr + row * stride_new_values + cols, mask=ok)
            tl.store(keys_ptr + slot * ROW_SIZE + cols, k, mask=ok)
            tl.store(values_ptr + slot * ROW_SIZE + cols, v, mask=ok)


def kv_write(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """The Triton kernel for `references.kv_write_reference` (same arguments): one program per new row."""
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the cache must be contiguous")
    if new_keys.dtype != keys.dtype or new_values.dtype != values.dtype:
        raise ValueError(f"new keys/values are {new_keys.dtype}, the cache {keys.dtype}: a copy, not a conversion")
    row_size = keys.shape[2] * keys.shape[3]
    new_keys, new_values = new_keys.reshape(-1, row_size), new_values.reshape(-1, row_size)
    if new_keys.stride(1) != 1 or new_values.stride(1) != 1:
        new_keys, new_values = new_keys.contiguous(), new_values.contiguous()
    _kv_write_kernel[(len(slots),)](keys, values, new_keys, new_values, slots.to(torch.int64).contiguous(),
                                    new_keys.stride(0), new_values.stride(0), ROW_SIZE=row_size,
                                    BLOCK=min(1024, triton.next_power_of_2(row_size)))
