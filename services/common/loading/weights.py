"""Turning named tensors from any checkpoint format into a ready DecoderLM."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, ModelConfig
from treeserve.parallel import Shard, sum_partial_outputs


def build_model(
    cfg: ModelConfig,
    names: Iterable[str],
    read: Callable[[str], torch.Tensor],
    source: str,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: Shard | None = None,
) -> DecoderLM:
    """Create the model without initialising it, then fill every parameter from `read(name)` (HF names).
    With `shard`, only this tensor-parallel rank's part of each layer (treeserve.parallel)."""
    if shard is not None:
        cfg = shard.config(cfg)
        read = lambda name, whole=read: shard.slice(name, whole(name))  # noqa: E731
    with torch.device("meta"):
        model = DecoderLM(cfg)
    fill_parameters(model, names, read, source, dtype, device)
    if shard is not None:
        sum_partial_outputs(model)
    model.tie_weights()
    model.rope_inv_freq = cfg.rope_inv_freq().float().to(device)
    return model.eval().requires_grad_(False)


def fill_parameters(model: nn.Module, names: Iterable[str], read: Callable[[str], torch.Tensor], source: str,
                    dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every parameter of `model` (made on the meta device) its tensor `read(name)`, as `dtype` on `device`.

    Missing or mis-shaped tensors raise one error naming them; tensors the model has no use for are ignored.
    """
    available = set(names)
    expected = dict(model.named_parameters())  # a tied LM head is listed once, under the embedding
    missing = sorted(name for name in expected if name not in available)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise TreeserveError(f"{source}: missing tensors: {shown}")
    state = {}
    for name, param in expected.items():
        tensor = read(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise TreeserveError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)} from the model config")
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
