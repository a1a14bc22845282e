"""RMSNorm in one kernel: one program per row, the statistics in float32 whatever the storage dtype.

The PyTorch form (`references.rms_norm_reference`) launches about seven kernels per call (upcast, square, mean,
rsqrt, two products, downcast); at one token per forward those launches, not the arithmetic, are the cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, size, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    # As the reference: normalise in float32, round to the storage dtype, then scale by the weight.
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel for `references.rms_norm_reference` (same arguments), over the last dimension."""
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), size, eps,
                                       BLOCK=triton.next_power_of_2(size))
    return out.view(x.shape)
