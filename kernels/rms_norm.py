"""RMSNorm in one kernel, alone or after the residual add: one program per row, the statistics in float32
whatever the storage dtype.

The PyTorch form (`references.rms_norm_reference`) launches about seven kernels per call (upcast, square, mean,
rsqrt, two products, downcast); at one token per forward those launches, not the arithmetic, are the cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, stride_x, stride_delta, stride_sum,
                     stride_out, size, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # the residual sum, rounded to the storage dtype as the reference's `x + delta`, then normalised
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)
             ).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    x = x.to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    # As the reference: normalise in float32, round to the storage dtype, then scale by the weight.
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel for `references.rms_norm_reference` (same arguments), over the last dimension."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), rows.stride(0), out.stride(0),
                                       out.stride(0), rows.shape[1], eps, ADD=False,
                                       BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for `references.add_rms_norm_reference` (same arguments): (x + delta, its RMSNorm)."""
    rows, delta_rows = _rows(x), _rows(delta)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    _rms_norm_kernel[(rows.shape[0],)](rows, delta_rows, weight, total, out, rows.stride(0), delta_rows.stride(0),
                                       total.stride(0), out.stride(0), rows.shape[1], eps, ADD=True,
                                       BLOCK=triton.next_power_of_2(rows.shape[1]))
    return total.view(x.shape), out.view(x.shape)
