"""The DFlash block-diffusion drafter: a few decoder layers that draft a whole block in one forward.

The target's hidden states after a few of its layers (`target_layer_ids`) are concatenated per token, projected
by `fc` and normalised (`hidden_norm`): that is the context. Every draft layer turns the context into extra
keys and values with its own k/v projections, k-norm and RoPE at the context tokens' positions; they are
computed once per token and kept per request (`DraftContext`). A round runs the block [root, MASK x (b-1)] at
positions root_position .. root_position + b - 1 through the layers; the block attends to the whole context
and to itself without a causal mask. The final norm, then the target's own LM head, give a distribution for
each of the next b - 1 positions. The block's embeddings also come from the target, so the checkpoint holds
neither an embedding nor an LM head.

Checkpoints follow the z-lab layout: config.json (Qwen3-style fields, `block_size`, and
`dflash_config.target_layer_ids` / `dflash_config.mask_token_id`) and safetensors named fc.weight,
hidden_norm.weight, layers.N.*, norm.weight.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.errors import TreeserveError
from treeserve.loading.hf_folder import config_from_hf, read_json, safetensors_reader
from treeserve.loading.weights import fill_parameters
from treeserve.models import ModelConfig
from treeserve.models.transformer import DecoderLayer, RMSNorm, apply_rope, rope_cos_sin

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to layer L - 3, as DFlash chooses them by default."""
    if count < 1 or num_target_layers < 4:
        raise TreeserveError(f"cannot pick {count} feature layers from a {num_target_layers}-layer target")
    if count == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    layers: ModelConfig  # the draft decoder layers (Qwen3-style: RMSNorm on q and k)
    block_size: int  # root + (block_size - 1) drafted positions
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context, 0-based
    mask_token_id: int

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.layers.hidden_size

    def to_json(self) -> dict:
        """config.json in the z-lab layout."""
        c = self.layers
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_context, "vocab_size": c.vocab_size,
            "attention_bias": False, "tie_word_embeddings": False, "block_size": self.block_size,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        }


def config_from_json(raw: dict, source: str = "config.json") -> DFlashConfig:
    dflash = raw.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if layer_ids is None or mask_token_id is None:
        raise TreeserveError(f"{source}: not a DFlash config (needs dflash_config.target_layer_ids and "
                             "dflash_config.mask_token_id)")
    if any(kind != "full_attention" for kind in raw.get("layer_types") or ()) or raw.get("is_causal"):
        raise TreeserveError(f"{source}: only non-causal full-attention DFlash layers are supported")
    if raw.get("attention_bias"):
        raise TreeserveError(f"{source}: DFlash layers with attention biases are not supported")
    layers = config_from_hf({**raw, "model_type": "qwen3", "vocab_size": raw.get("vocab_size", 1),
                             "sliding_window": None})
    block_size = int(dflash.get("block_size", raw.get("block_size", 16)))
    if block_size < 2:
        raise TreeserveError(f"{source}: block_size must be at least 2, got {block_size}")
    return DFlashConfig(layers, block_size, tuple(int(i) for i in layer_ids), int(mask_token_id))


class DraftContext:
    """One request's context keys/values for every draft layer: (layers, kv_heads, capacity, head_dim), growing
    by doubling. Slot i holds the context token at position i."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(self.shape, dtype=dtype, device=device)
        self.values = torch.zeros(self.shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """keys/values: per layer (N, kv_heads, head_dim) for the next N context tokens."""
        n = keys[0].shape[0]
        if self.length + n > self.keys.shape[2]:
            grown = max(self.length + n, 2 * self.keys.shape[2])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[0], old.shape[1], grown, old.shape[3])
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer, :, self.length:self.length + n] = k.transpose(0, 1)
            self.values[layer, :, self.length:self.length + n] = v.transpose(0, 1)
        self.length += n


class BlockAttention:
    """The draft layers' attention for a batch of blocks: each block's rows see its request's whole context
    and every row of its own block (no causal mask)."""

    def __init__(self, contexts: list[DraftContext], block_size: int):
        self.contexts, self.block_size = contexts, block_size

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outputs = []
        for i, context in enumerate(self.contexts):
            rows = slice(i * self.block_size, (i + 1) * self.block_size)
            keys = torch.cat((context.keys[layer, :, :context.length], k[rows].transpose(0, 1)), dim=1)
            values = torch.cat((context.values[layer, :, :context.length], v[rows].transpose(0, 1)), dim=1)
            out = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys[None], values[None],
                                                 enable_gqa=True)
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs)


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        layers = cfg.layers
        layers.validate()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_size, layers.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(layers.hidden_size, layers.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(layers, i) for i in range(layers.num_layers))
        self.norm = RMSNorm(layers.hidden_size, layers.rms_norm_eps)
        self.register_buffer("rope_inv_freq", layers.rope_inv_freq().float(), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_context(self) -> DraftContext:
        return DraftContext(self.config.layers, self.dtype, self.device)

    def extend_context(self, context: DraftContext, features: torch.Tensor) -> None:
        """Add the next tokens' target features (N, feature_size) to `context`, at positions from its length."""
        positions = torch.arange(context.length, context.length + features.shape[0], device=self.device)
        context.append(*self.context_kv(features.to(self.dtype), positions))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per draft layer, the keys (k_proj, k-norm, RoPE) and values of the projected features."""
        hidden = self.hidden_norm(self.fc(features))
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, hidden.dtype)
        keys, values = [], []
        n = hidden.shape[0]
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(hidden).view(n, attn.num_kv_heads, attn.head_dim))
            keys.append(apply_rope(k, cos, sin))
            values.append(attn.v_proj(hidden).view(n, attn.num_kv_heads, attn.head_dim))
        return keys, values

    def forward(self, block_embeddings: torch.Tensor, positions: torch.Tensor,
                contexts: list[DraftContext]) -> torch.Tensor:
        """block_embeddings (B * block_size, hidden) of B blocks back to back; returns the normalised hidden
        states, same shape."""
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, block_embeddings.dtype)
        attention = BlockAttention(contexts, self.config.block_size)
        x = block_embeddings
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)


def load_dflash(path: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> DFlashModel:
    """A DFlash checkpoint folder (config.json + model.safetensors or a sharded index)."""
    import safetensors

    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise TreeserveError(f"{folder}: no DFlash checkpoint here (config.json is missing)")
    cfg = config_from_json(read_json(folder / CONFIG_NAME), str(folder / CONFIG_NAME))
    with torch.device("meta"):
        model = DFlashModel(cfg)
    try:
        names, read = safetensors_reader(folder)
        fill_parameters(model, names, read, str(folder), dtype, device)
    except (safetensors.SafetensorError, OSError) as error:
        raise TreeserveError(f"{folder}: cannot read weights, the file is truncated or corrupt ({error})") from None
    model.rope_inv_freq = cfg.layers.rope_inv_freq().float().to(device)
    return model.eval().requires_grad_(False)


def save_dflash(model: DFlashModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model` as a z-lab-layout checkpoint (weights stored in `dtype`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})


class DFlashRequest:
    """One request's draft context: its tokens and the draft layers' context keys/values (every committed
    token but the root, whose features the target has not produced yet)."""

    def __init__(self, kv: DraftContext):
        self.tokens: list[int] = []
        self.kv = kv


TREES = ("chain", "ddtree")


class DFlashDrafter:
    """Batched DFlash drafting: one block forward for every request of a round, then a tree per request, built
    on the device (`chain`: the argmax path; `ddtree`: the best tree of `budget` nodes over each position's
    top-`top_k` tokens)."""

    name = "dflash"

    def __init__(self, model: DFlashModel, embedding: torch.Tensor, lm_head: torch.Tensor, tree: str = "ddtree",
                 top_k: int = 8):
        cfg = model.config
        if tree not in TREES:
            raise TreeserveError(f"unknown tree kind {tree!r} (use {' or '.join(TREES)})")
        if embedding.shape[1] != cfg.layers.hidden_size or lm_head.shape[1] != cfg.layers.hidden_size:
            raise TreeserveError(f"the drafter's hidden size {cfg.layers.hidden_size} does not match the target's "
                                 f"{embedding.shape[1]}")
        if not 0 <= cfg.mask_token_id < embedding.shape[0]:
            raise TreeserveError(f"mask token id {cfg.mask_token_id} is outside the target's vocabulary")
        self.model, self.embedding, self.lm_head = model, embedding, lm_head
        self.tree_kind, self.top_k = tree, top_k
        self.feature_layer_ids = cfg.target_layer_ids
        self.feature_size = cfg.feature_size

    @classmethod
    def for_target(cls, path: str | Path, target_model, tree: str = "ddtree", top_k: int = 8) -> "DFlashDrafter":
        """Load the checkpoint at `path` onto the target's device and dtype, borrowing its embedding and
        LM head. Raises TreeserveError when the drafter does not fit the target."""
        model = load_dflash(path, target_model.device, target_model.dtype)
        layers = target_model.config.num_layers
        bad = [i for i in model.config.target_layer_ids if not 0 <= i < layers]
        if bad:
            raise TreeserveError(f"{path}: the drafter reads target layer {bad[0]}, but the target has {layers}")
        return cls(model, target_model.model.embed_tokens.weight, target_model.lm_head.weight, tree, top_k)

    def new_context(self) -> DFlashRequest:
        return DFlashRequest(self.model.new_context())

    def extend(self, context: DFlashRequest, tokens: list[int], features: torch.Tensor | None) -> None:
        rows = 0 if features is None else features.shape[0]
        expected = len(context.tokens) + len(tokens) - 1 - context.kv.length
        if rows != expected:
            raise TreeserveError(f"dflash: {rows} feature rows for {len(tokens)} new tokens; expected {expected} "
                                 "(one per token that entered the target's KV cache)")
        if rows and features.shape[1] != self.feature_size:
            raise TreeserveError(f"dflash: features are {features.shape[1]} wide; this drafter needs "
                                 f"{self.feature_size}")
        context.tokens.extend(tokens)
        if rows:
            self.model.extend_context(context.kv, features.to(self.model.device))

    @torch.inference_mode()
    def block_log_probs(self, contexts: list[DFlashRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Roots (B,) and log-probabilities (B, block_size - 1, vocab) for the positions after each root."""
        cfg, device = self.model.config, self.model.device
        block = cfg.block_size
        roots = torch.tensor([context.tokens[-1] for context in contexts], device=device)
        ids = torch.full((len(contexts), block), cfg.mask_token_id, device=device)
        ids[:, 0] = roots
        starts = torch.tensor([context.kv.length for context in contexts], device=device)
        positions = (starts[:, None] + torch.arange(block, device=device)[None, :]).reshape(-1)
        embeddings = F.embedding(ids.reshape(-1), self.embedding).to(self.model.dtype)
        hidden = self.model(embeddings, positions, [context.kv for context in contexts])
        hidden = hidden.view(len(contexts), block, -1)[:, 1:]
        return roots, torch.log_softmax((hidden @ self.lm_head.T.to(hidden.dtype)).float(), dim=-1)

    def propose(self, contexts: list[DFlashRequest], budgets: list[int]):
        from treeserve.drafter.trees import chain_trees, ddtree_trees

        roots, log_probs = self.block_log_probs(contexts)
        if self.tree_kind == "chain":
            return chain_trees(roots, log_probs.argmax(dim=-1, keepdim=True), budgets)
        top = log_probs.topk(max(1, min(self.top_k, max(budgets), log_probs.shape[-1])), dim=-1)
        return ddtree_trees(roots, top.values, top.indices, budgets)
