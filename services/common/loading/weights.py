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


def checkpoint_parts(model: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """Each parameter's checkpoint tensors (HF names) with their row counts: one for most parameters; the parts
    stacked along rows for a fused projection (a module's `fused_parts`, e.g. q/k/v in qkv_proj)."""
    parts = {name: [(name, param.shape[0])] for name, param in model.named_parameters()}
    for module_name, module in model.named_modules():
        for fused, pieces in getattr(module, "fused_parts", {}).items():
            prefix = f"{module_name}.{fused}." if module_name else f"{fused}."
            for name in parts:
                if name.startswith(prefix) and "." not in name[len(prefix):]:  # weight, bias
                    kind = name[len(prefix):]
                    parts[name] = [(prefix[:-len(fused) - 1] + f"{piece}.{kind}", rows) for piece, rows in pieces]
    return parts


def fill_parameters(model: nn.Module, names: Iterable[str], read: Callable[[str], torch.Tensor], source: str,
                    dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every parameter of `model` (made on the meta device) its tensor `read(name)` (HF names; a fused
    projection reads its parts and stacks them), as `dtype` on `device`.

    Missing or mis-shaped tensors raise one error naming them; tensors the model has no use for are ignored.
    """
    available = set(names)
    expected = dict(model.named_parameters())  # a tied LM head is listed once, under the embedding
    parts = checkpoint_parts(model)
    missing = sorted(part for name in expected for part, _ in parts[name] if part not in available)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise TreeserveError(f"{source}: missing tensors: {shown}")
    state = {}
    for name, param in expected.items():
        tensors = []
        for part, rows in parts[name]:
            tensor = read(part)
            want = (rows, *param.shape[1:]) if len(parts[name]) > 1 else tuple(param.shape)
            if tuple(tensor.shape) != tuple(want):
                raise TreeserveError(f"{source}: tensor {part} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(want)} from the model config")
            tensors.append(tensor.to(device=device, dtype=dtype))
        state[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    model.load_state_dict(state, strict=False, assign=True)


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under checkpoint (HF) names, fused projections split back into their parts:
    what `fill_parameters` reads."""
    parts, state = checkpoint_parts(model), {}
    for name, tensor in model.state_dict().items():
        pieces = parts.get(name, [(name, tensor.shape[0])])  # a tied LM head: not a separate parameter
        for (part, _), value in zip(pieces, tensor.split([rows for _, rows in pieces])):
            state[part] = value
    return state
