"""Turning named tensors from any checkpoint format into a ready DecoderLM."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from treeserve.errors import TreeserveError
from treeserve.models import DecoderLM, ModelConfig
from treeserve.parallel import Shard, add_collectives


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
        vocab = cfg.vocab_size
        cfg = shard.config(cfg)
        # A tied LM head's shard comes from the embedding's rows (the embedding itself stays whole).
        head = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
        names = set(names) | set(head)
        read = lambda name, whole=read: shard.slice(name, whole(head.get(name, name)))  # noqa: E731
    with torch.device("meta"):
        model = DecoderLM(cfg if shard is None else dataclasses.replace(cfg, vocab_size=vocab))
        if shard is not None:  # untied: this rank's rows of the head, a parameter of its own
            model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    fill_parameters(model, names, read, source, dtype, device)
    if shard is None:
        model.tie_weights()
    else:
        add_collectives(model, shard.world)
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
