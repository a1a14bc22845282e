"""The MLP's activation in one kernel: SiLU(gate) * up, reading the fused gate/up projection's output once
(PyTorch would launch a SiLU and a product, and write the SiLU in between)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=ok, other=0.0)
    # As the reference: SiLU rounded to the storage dtype, then the product.
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel for `references.silu_mul_reference`: (..., 2 * I) -> (..., I)."""
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](rows, out, rows.stride(0), out.stride(0), size,
                                                                BLOCK=block)
    return out.view(*gate_up.shape[:-1], size)
