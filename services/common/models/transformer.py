"""The decoder used for every supported family, in plain PyTorch.

Parameter names mirror the Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...) so an HF
state dict loads as it is and other formats are renamed into it once, in their loader.

A forward takes a flat list of tokens with explicit positions plus an attention object that owns the KV cache
and the mask; the model itself does not know whether it is running a prompt, a chain or a tree.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels.references import rms_norm_reference, rope_reference
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, H, D) at the positions of cos/sin (N, 1, D), from `rope_cos_sin`."""
    if use_kernels(x):
        from treeserve.kernels.rope import rope

        return rope(x, cos, sin)
    return rope_reference(x, cos, sin)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE cos and sin, (N, 1, head_dim) to broadcast over heads. The angles are computed in float32 whatever
    the weights' dtype: bfloat16 positions would be off by whole steps."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention: Attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        """input_ids, positions: (N,). Returns logits (float32) for `logits_rows` (all rows when None), and the
        hidden state after each layer in `hidden_layer_ids` (0-based; the output of that decoder layer), (N, hidden).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        wanted = set(hidden_layer_ids)
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attention)
            if i in wanted:
                hidden[i] = x
        x = x if logits_rows is None else x[logits_rows]
        logits = self.lm_head(self.model.norm(x)).float()
        return logits, [hidden[i] for i in hidden_layer_ids]
