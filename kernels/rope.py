"""Rotary position embedding in one kernel per tensor (the PyTorch form splits, negates, concatenates, then
multiplies and adds: six launches for q and six for k in every layer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xn, stride_xh, stride_cn, stride_sn, stride_on,
                 stride_oh, heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < heads) & (d < HALF)
    first = tl.load(x_ptr + n * stride_xn + h * stride_xh + d, mask=ok, other=0.0).to(tl.float32)
    second = tl.load(x_ptr + n * stride_xn + h * stride_xh + HALF + d, mask=ok, other=0.0).to(tl.float32)
    cos_first = tl.load(cos_ptr + n * stride_cn + d, mask=d < HALF, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + n * stride_cn + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + n * stride_sn + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + n * stride_sn + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    tl.store(out_ptr + n * stride_on + h * stride_oh + d, (first * cos_first - second * sin_first).to(kind),
             mask=ok)
    tl.store(out_ptr + n * stride_on + h * stride_oh + HALF + d,
             (second * cos_second + first * sin_second).to(kind), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Triton kernel for `references.rope_reference` (same arguments): x (N, H, D), cos/sin (N, 1, D)."""
    n, heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(n, head_dim), sin.reshape(n, head_dim)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    half = head_dim // 2
    _rope_kernel[(n,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0),
                       out.stride(1), heads, HALF=half, BLOCK_H=triton.next_power_of_2(heads),
                       BLOCK_D=triton.next_power_of_2(half))
    return out
