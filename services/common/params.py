"""What a request asks for: how to sample and when to stop. Torch-free, so clients and the gateway start fast."""

from __future__ import annotations

import dataclasses
import math

from treeserve.errors import TreeserveError


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: a random seed, reported back with the result
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise TreeserveError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise TreeserveError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise TreeserveError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise TreeserveError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise TreeserveError(f"seed must be in [0, 2^63), got {self.seed}")
        if any(s == "" for s in self.stop_strings):
            raise TreeserveError("stop strings must not be empty")
