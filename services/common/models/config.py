"""Architecture description shared by every supported decoder family.

Llama 2/3, Mistral and SmolLM2 are "llama"; Qwen2 adds q/k/v biases; Qwen3 adds RMSNorm on q and k per head.
Everything a forward pass needs is here, whatever format the weights came from.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from treeserve.errors import TreeserveError

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent scaling ("llama3"), or plain position interpolation ("linear")."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors stored by GGUF converters instead of rope_scaling (tensor "rope_freqs.weight").
    rope_freq_factors: tuple[float, ...] | None = None

    @property
    def attention_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise TreeserveError(f"unsupported architecture {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_context"):
            if getattr(self, name) <= 0:
                raise TreeserveError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise TreeserveError(f"model config: {self.num_heads} attention heads do not divide into "
                                 f"{self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise TreeserveError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies (head_dim/2,) in float64, scaling applied."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)
        if self.rope_freq_factors is not None:
            return inv_freq / torch.tensor(self.rope_freq_factors, dtype=torch.float64)
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        if scaling.kind == "linear":
            return inv_freq / scaling.factor
        # llama3: leave high frequencies alone, divide low ones by factor, interpolate in between.
        low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        return torch.where(is_medium, interpolated, scaled)
