"""Each row's k likeliest tokens and their log-probabilities, from logits as stored, in one read of them.

A DFlash round needs, for each drafted position, its top k tokens (k: the search's width) and their
log-probabilities. The PyTorch form (`references.vocab_top_reference`) upcasts the logits to float32, takes their
log-softmax and then topk over the whole vocabulary: at 64 requests x 15 positions x 49,152 tokens that writes two
float32 copies of 190 MB, and topk's radix select reads them several times over, about two thirds of the
drafter's device time in a round. Here two launches:
- one program per (row, chunk of the vocabulary) reads the chunk once: its maximum and sum of exp(x - maximum), and
  its top k as sortable keys (the float32 logit's bits in the high half, the token in the low: ddtree_search's);
- one program per row merges them: the row's logsumexp, and the top k of its chunks' top k (the row's top k are
  among them), whose log-probabilities are their logits less the logsumexp.
The tokens are the reference's but for the order of tied logits (here the lower token first); the
log-probabilities equal its within float32 rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from treeserve.kernels.ddtree_search import NO_KEY, _index, _key, _score

CHUNK = 2048  # vocabulary entries a first-launch program reads


@triton.jit
def _chunk_top_kernel(logits_ptr, keys_ptr, maxima_ptr, sums_ptr, stride_group, stride_row, group, size, chunks,
                      CHUNK: tl.constexpr, K: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < size
    start = (row // group) * stride_group + (row % group) * stride_row
    x = tl.load(logits_ptr + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
    biggest = tl.max(x, axis=0)
    tl.store(maxima_ptr + row * chunks + chunk, biggest)
    # (x > -inf: a chunk of -inf logits, masked ones, sums 0 rather than exp(-inf - -inf))
    tl.store(sums_ptr + row * chunks + chunk, tl.sum(tl.where(x > float("-inf"), tl.exp(x - biggest), 0.0), axis=0))
    keys = tl.where(ok, _key(x, cols), NO_KEY)
    tl.store(keys_ptr + (row * chunks + chunk) * K + tl.arange(0, K), tl.topk(keys, K))


@triton.jit
def _merge_top_kernel(keys_ptr, maxima_ptr, sums_ptr, log_probs_ptr, tokens_ptr, chunks, k,
                      K: tl.constexpr, CANDIDATES: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    spots = tl.arange(0, CHUNKS)
    maxima = tl.load(maxima_ptr + row * chunks + spots, mask=spots < chunks, other=float("-inf"))
    sums = tl.load(sums_ptr + row * chunks + spots, mask=spots < chunks, other=0.0)
    peak = tl.max(maxima, axis=0)
    logsumexp = peak + tl.log(tl.sum(tl.where(spots < chunks, sums * tl.exp(maxima - peak), 0.0), axis=0))
    candidates = tl.arange(0, CANDIDATES)
    keys = tl.load(keys_ptr + row * chunks * K + candidates, mask=candidates < chunks * K, other=NO_KEY)
    best = tl.topk(keys, K)
    places = tl.arange(0, K)
    tl.store(log_probs_ptr + row * k + places, _score(best) - logsumexp, mask=places < k)
    tl.store(tokens_ptr + row * k + places, _index(best).to(tl.int64), mask=places < k)


def vocab_top(logits: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel form of `references.vocab_top_reference` (same arguments): each row's top k log-probabilities
    (float32, descending) and their tokens (int64), of logits (..., P, V) of any float dtype whose last dimension
    is contiguous; the P rows of a group may be a slice of more (a block's positions after its root), read in place.
    `chunk`: a power of two, at least k."""
    size = logits.shape[-1]
    if not 1 <= k <= min(chunk, size):
        raise ValueError(f"vocab_top: k must be between 1 and min({chunk}, {size}), got {k}")
    groups = logits.unsqueeze(0) if logits.dim() == 2 else logits.reshape(-1, *logits.shape[-2:])
    if groups.stride(-1) != 1:
        groups = groups.contiguous()
    group = groups.shape[1]
    # (the top `width` of each chunk, a power of two of at least 2 that tl.topk takes; the first k of them kept)
    count, chunks, width = groups.shape[0] * group, triton.cdiv(size, chunk), max(2, triton.next_power_of_2(k))
    device = logits.device
    keys = torch.empty(count, chunks * width, dtype=torch.int64, device=device)
    maxima = torch.empty(count, chunks, dtype=torch.float32, device=device)
    sums = torch.empty_like(maxima)
    _chunk_top_kernel[(count, chunks)](groups, keys, maxima, sums, groups.stride(0), groups.stride(1), group, size,
                                       chunks, CHUNK=chunk, K=width, num_warps=8)
    log_probs = torch.empty(count, k, dtype=torch.float32, device=device)
    tokens = torch.empty(count, k, dtype=torch.int64, device=device)
    _merge_top_kernel[(count,)](keys, maxima, sums, log_probs, tokens, chunks, k, K=width,
                                CANDIDATES=triton.next_power_of_2(chunks * width),
                                CHUNKS=triton.next_power_of_2(chunks), num_warps=8)
    shape = (*logits.shape[:-1], k)
    return log_probs.view(shape), tokens.view(shape)
