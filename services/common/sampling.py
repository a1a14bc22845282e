"""The target's token choice at every scored position.

Randomness is counter-based: the uniform number behind the j-th generated token of a request is a hash of
(seed, j). A token's draw therefore does not depend on how many tokens a round verified, which drafter ran, or
which other requests shared the batch, so one seed gives one output whatever the speculation (up to floating
point near-ties between differently shaped forwards).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from treeserve.params import GenerationParams


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def counter_uniforms(seeds: int | np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1), one per output index, from splitmix64(seed, index); `seeds` is one seed or one
    per index (several requests' rows at once)."""
    with np.errstate(over="ignore"):
        x = (np.asarray(seeds, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + indices.astype(np.uint64)
             + np.uint64(1))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def target_probs(logits: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. (N, V) float64."""
    scaled = logits.double() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sampling_setting(params: GenerationParams) -> tuple:
    """What the choice depends on besides the logits and the draws: requests that share it are picked together."""
    return () if params.greedy else (params.temperature, params.top_k, params.top_p)


def pick_tokens(logits: torch.Tensor, params: GenerationParams, seeds: int | np.ndarray | None,
                output_indices: np.ndarray | None) -> torch.Tensor:
    """The target's choice at each of N scored positions, left on the logits' device (the caller moves a whole
    round's picks to the host at once). Row i belongs to a request with seed `seeds[i]` (or `seeds` for all)
    and decides its generated token `output_indices[i]` (the draw's counter; both unused when greedy, and may be
    None then). The rows may come from several requests of one `sampling_setting`: every operation is per row,
    so each row's pick is the one it would get alone, and a batch costs one set of kernels instead of one per
    request."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, params)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.from_numpy(counter_uniforms(seeds, np.asarray(output_indices))).to(cdf.device, non_blocking=True)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picks.clamp_(max=probs.shape[-1] - 1)
