"""The decoder used for every supported family, in plain PyTorch.

Parameter names mirror the Hugging Face checkpoints (model.layers.N.self_attn.o_proj.weight, ...), except that
q/k/v and gate/up are fused into one projection each (`qkv_proj`, `gate_up_proj`: one GEMM instead of three and
two); modules with fused projections list their checkpoint parts in `fused_parts`, and the loaders
(treeserve.loading.weights) read checkpoints, HF-named, through them. Other formats are renamed to HF names once,
in their loader.

A forward takes a flat list of tokens with explicit positions plus an attention object that owns the KV cache
and the mask; the model itself does not know whether it is running a prompt, a chain or a tree.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels.references import (
    add_rms_norm_reference, rms_norm_reference, rope_reference, silu_mul_reference)
from treeserve.models.config import ModelConfig


class Attention(Protocol):
    """Writes this forward's keys/values into a cache and attends over it. Shapes: q (N, H, D), k/v (N, KVH, D)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def use_kernels(x: torch.Tensor) -> bool:
    """The fused Triton kernels on a GPU at inference; their PyTorch references elsewhere and for training
    (the kernels have no backward)."""
    return x.is_cuda and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            from treeserve.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum x + delta and its norm (one kernel on a GPU)."""
        if use_kernels(x):
            from treeserve.kernels.rms_norm import add_rms_norm

            return add_rms_norm(x, delta, self.weight, self.eps)
        return add_rms_norm_reference(x, delta, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, H, D) at the positions of cos/sin (N, 1, D), from `rope_cos_sin`."""
    if use_kernels(x):
        from treeserve.kernels.rope import rope

        return rope(x, cos, sin)
    return rope_reference(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_kernels(gate_up):
        from treeserve.kernels.silu_mul import silu_mul as kernel

        return kernel(gate_up)
    return silu_mul_reference(gate_up)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE cos and sin, (N, 1, head_dim) to broadcast over heads. The angles are computed in float32 whatever
    the weights' dtype: bfloat16 positions would be off by whole steps."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class SelfAttention(nn.Module):
    """q, k and v come from one fused projection (one GEMM instead of three); checkpoints keep them apart
    (`fused_parts` tells the loader how they stack)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.fused_parts = {"qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))}
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        if self.q_norm is None:  # q and k side by side: one RoPE launch for both
            q, k = apply_rope(qkv[:, :heads + kv_heads], cos, sin).split((heads, kv_heads), dim=1)
        else:
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        out = attention(self.layer, q, k, v)
        return self.o_proj(out.reshape(n, heads * self.head_dim))

    def key_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (before k-norm and RoPE) and values of x alone, (N, kv_heads, head_dim) each, from the k and v
        rows of the fused projection."""
        rows = slice(self.num_heads * self.head_dim, None)
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[rows]
        kv = F.linear(x, self.qkv_proj.weight[rows], bias).view(x.shape[0], 2 * self.num_kv_heads, self.head_dim)
        return kv.split((self.num_kv_heads, self.num_kv_heads), dim=1)


class MLP(nn.Module):
    """Gate and up in one fused projection, then SiLU(gate) * up in one kernel on a GPU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused_parts = {"gate_up_proj": (("gate_proj", cfg.intermediate_size),
                                             ("up_proj", cfg.intermediate_size))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention: Attention):
        x, normed = self.post_attention_layernorm.after_add(
            x, self.self_attn(self.input_layernorm(x), cos, sin, attention))
        return x + self.mlp(normed)


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM for the llama / qwen2 / qwen3 families."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a parameter: recomputed from the config, never loaded from a checkpoint.
        self.register_buffer("rope_inv_freq", cfg.rope_inv_freq().float(), persistent=False)

    def tie_weights(self) -> None:
        """Re-share the LM head with the embedding after parameters were replaced by a loader."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        logits_rows: torch.Tensor | None = None,
        hidden_layer_ids: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: (N,). Returns logits (in the model's dtype) for `logits_rows` (all rows when None),
        and the hidden state after each layer in `hidden_layer_ids` (0-based; the output of that decoder layer, and
        for the last layer that output after the final norm), (N, hidden).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        wanted = set(hidden_layer_ids)
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attention)
            if i in wanted:
                hidden[i] = x
        last = len(self.model.layers) - 1
        if last in wanted:  # what Hugging Face's hidden_states[L] holds, and DFlash drafters were trained on
            hidden[last] = self.model.norm(x)
        x = x if logits_rows is None else x[logits_rows]
        # In the weights' dtype: a float32 copy of every row would be exact but cost a large tree batch hundreds of
        # megabytes a round; greedy picks are the same either way, and sampling upcasts the rows it samples.
        logits = self.lm_head(self.model.norm(x))
        return logits, [hidden[i] for i in hidden_layer_ids]
