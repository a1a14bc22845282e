"""The DFlash block-diffusion drafter: a few decoder layers that draft a whole block in one forward.

The target's hidden states after a few of its layers (`target_layer_ids`) are concatenated per token, projected
by `fc` and normalised (`hidden_norm`): that is the context. Every draft layer turns the context into extra
keys and values with its own k/v projections, k-norm and RoPE at the context tokens' positions; they are
computed once per token and kept per request, in a paged KV pool of the draft layers. A round runs the block
[root, MASK x (b-1)] at positions root_position .. root_position + b - 1 through the layers; the block attends
to the whole context and to itself without a causal mask (the tree-attention kernel with an all-ones mask). The
final norm, then the target's own LM head, give a distribution for each of the next b - 1 positions. The
block's embeddings also come from the target, so the checkpoint holds neither an embedding nor an LM head.
Each request's tree is then searched from those distributions (trees.ddtree_select), at the narrowest of a few
tree widths that holds the round's largest budget (the same trees as the widest). On a GPU both replay CUDA graphs,
the block forward's per batch bucket as the verifier's trees do and the search's per (batch bucket, width), so that
a round is two replays and one small copy to the host rather than hundreds of small launches.

Checkpoints follow the z-lab layout: config.json (Qwen3-style fields, `block_size`, `num_target_layers` and
`dflash_config.target_layer_ids` / `dflash_config.mask_token_id`) and safetensors named fc.weight,
hidden_norm.weight, layers.N.*, norm.weight. Missing target_layer_ids default as the reference's do, one per
draft layer (default_target_layer_ids).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treeserve.drafter.trees import (ddtree_select, ddtree_select_kernel, kernel_tables, possible_nodes, search_plan,
                                     unpack_trees)
from treeserve.errors import TreeserveError
from treeserve.loading.hf_folder import config_from_hf, read_json, safetensors_reader
from treeserve.loading.weights import checkpoint_state, fill_parameters
from treeserve.models import ModelConfig
from treeserve.models.graphs import (CapturedGraph, PagedRunner, TreeRows, buckets_up_to, capture_graph,
                                     cycle_collection_paused, powers_of_two_up_to)
from treeserve.models.paged_kv import PagedAttention, PagedKVCache, PagedSequence, paged_kernels
from treeserve.models.transformer import Attention, DecoderLayer, RMSNorm, apply_rope, rope_cos_sin
from treeserve.settings import TREE_KINDS
from treeserve.tree import MAX_BUDGET, DraftPoolFull, DraftTree


CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
POOL_BLOCK = 16  # tokens per block of the drafter's context pool
NARROWEST_TREE_WIDTH = 16  # below it a search costs about the same: its kernels are launch-bound
# Context rows a request's round may bring to the block graph, in blocks: a merged tree's accepted path (a
# prompt-lookup chain of up to half the budget, then DFlash's) often runs past one block, and more than this
# leaves the graph for an eager write.
STAGED_BLOCKS = 2

log = logging.getLogger("treeserve.drafter")


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to layer L - 3 (the middle layer when count is 1), as DFlash
    chooses them by default; a config without target_layer_ids takes count = its number of draft layers."""
    if count == 1 and num_target_layers >= 1:
        return (num_target_layers // 2,)
    if count < 1 or num_target_layers < 4:
        raise TreeserveError(f"cannot pick {count} feature layers from a {num_target_layers}-layer target")
    return tuple(round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    layers: ModelConfig  # the draft decoder layers (Qwen3-style: RMSNorm on q and k)
    block_size: int  # root + (block_size - 1) drafted positions
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context, 0-based
    mask_token_id: int
    num_target_layers: int | None  # the target's layer count; None: an older config, loaded without a target

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.layers.hidden_size

    def to_json(self) -> dict:
        """config.json in the z-lab layout."""
        if self.num_target_layers is None:  # the reference cannot load a config without it
            raise TreeserveError("the target's layer count is unknown; load the drafter for its target "
                                 "(DFlashDrafter.for_target, or load_dflash with num_target_layers) to save it")
        c = self.layers
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_context, "vocab_size": c.vocab_size,
            "attention_bias": False, "tie_word_embeddings": False, "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        }


def target_layer_count(raw: dict, num_target_layers: int | None, source: str) -> int | None:
    """The target's layer count: the config's, else the one given (the target's); they must agree."""
    recorded = raw.get("num_target_layers")
    if recorded is not None and num_target_layers is not None and int(recorded) != num_target_layers:
        raise TreeserveError(f"{source}: made for a target of {recorded} layers; this one has {num_target_layers}")
    return int(recorded) if recorded is not None else num_target_layers


def context_layer_ids(raw: dict, target_layers: int | None, draft_layers: int, source: str) -> tuple[int, ...]:
    """The config's target_layer_ids, else the reference's default for its draft layers; all inside the target."""
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is None and target_layers is None:
        raise TreeserveError(f"{source}: needs dflash_config.target_layer_ids or num_target_layers (to default them)")
    ids = default_target_layer_ids(target_layers, draft_layers) if ids is None else tuple(int(i) for i in ids)
    outside = [i for i in ids if target_layers is not None and not 0 <= i < target_layers]
    if outside:
        raise TreeserveError(f"{source}: the drafter reads target layer {outside[0]}, but the target has "
                             f"{target_layers}")
    return ids


def config_from_json(raw: dict, source: str = "config.json", num_target_layers: int | None = None) -> DFlashConfig:
    """A DFlash config.json; `num_target_layers` (the target's) stands in where the config does not record it."""
    dflash = raw.get("dflash_config") or {}
    mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if mask_token_id is None:
        raise TreeserveError(f"{source}: not a DFlash config (needs dflash_config.mask_token_id)")
    target_layers = target_layer_count(raw, num_target_layers, source)
    if any(kind != "full_attention" for kind in raw.get("layer_types") or ()) or raw.get("is_causal"):
        raise TreeserveError(f"{source}: only non-causal full-attention DFlash layers are supported")
    if raw.get("attention_bias"):
        raise TreeserveError(f"{source}: DFlash layers with attention biases are not supported")
    layers = config_from_hf({**raw, "model_type": "qwen3", "vocab_size": raw.get("vocab_size", 1),
                             "sliding_window": None})
    block_size = int(dflash.get("block_size", raw.get("block_size", 16)))
    if block_size < 2:
        raise TreeserveError(f"{source}: block_size must be at least 2, got {block_size}")
    layer_ids = context_layer_ids(raw, target_layers, layers.num_layers, source)
    return DFlashConfig(layers, block_size, layer_ids, int(mask_token_id), target_layers)


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

    @torch.no_grad()  # a cache write, never part of a gradient
    def extend_context(self, sequence: PagedSequence, features: torch.Tensor, kernels: bool = False) -> None:
        """Write the next tokens' context keys/values, from their target features (N, feature_size), into
        `sequence` (of a pool of this model's layers), at positions from its length."""
        n = features.shape[0]
        positions = torch.arange(sequence.length, sequence.length + n)
        self.write_context(sequence.cache, sequence.reserve(n), positions, features, kernels)
        sequence.keep(list(range(n)))

    @torch.no_grad()
    def write_context(self, cache: PagedKVCache, slots: torch.Tensor, positions: torch.Tensor,
                      features: torch.Tensor, kernels: bool = False) -> None:
        """The context keys/values of tokens at `positions`, from their features (N, feature_size), written at
        `slots` of `cache` (a pool of this model's layers): any number of requests' tokens in one pass."""
        keys, values = self.context_kv(features.to(self.device, self.dtype), positions.to(self.device))
        slots = slots.to(self.device)
        kv_write, _ = paged_kernels(kernels)
        for layer, (k, v) in enumerate(zip(keys, values)):
            kv_write(*cache.layer(layer), k.contiguous(), v.contiguous(), slots)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per draft layer, the keys (k projection, k-norm, RoPE) and values of the projected features."""
        hidden = self.hidden_norm(self.fc(features))
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, hidden.dtype)
        keys, values = [], []
        for layer in self.layers:
            attn = layer.self_attn
            k, v = attn.key_values(hidden)
            keys.append(apply_rope(attn.k_norm(k), cos, sin))
            values.append(v)
        return keys, values

    def forward(self, block_embeddings: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """block_embeddings (B * block_size, hidden) of B blocks back to back, attending through `attention`
        (each block to its request's context and to the whole block); returns the normalised hidden states,
        same shape."""
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, block_embeddings.dtype)
        x = block_embeddings
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)


def load_dflash(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                num_target_layers: int | None = None) -> DFlashModel:
    """A DFlash checkpoint folder (config.json + model.safetensors or a sharded index), for a target of
    `num_target_layers` layers where known."""
    import safetensors

    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise TreeserveError(f"{folder}: no DFlash checkpoint here (config.json is missing)")
    cfg = config_from_json(read_json(folder / CONFIG_NAME), str(folder / CONFIG_NAME), num_target_layers)
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
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in checkpoint_state(model).items()}
    save_file(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})


class DFlashRequest:
    """One request's draft context: its tokens and, in `sequence`, the draft layers' context keys/values
    (every committed token but the root, whose features the target has not produced yet). Rows extended since
    its last block forward wait in `unwritten` (slots, positions, features) until the next one writes them. The
    rows may lag the tokens (a merged drafter's rounds of prompt lookup alone carry none); a block forward needs
    them all (`rows_wanted` 0)."""

    def __init__(self, sequence: PagedSequence):
        self.tokens: list[int] = []
        self.sequence = sequence
        self.unwritten: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []

    @property
    def unwritten_rows(self) -> int:
        return sum(len(slots) for slots, _, _ in self.unwritten)

    def rows_wanted(self, new_tokens: int = 0) -> int:
        """Feature rows it lacks once `new_tokens` more tokens join: one per token but the root."""
        return max(0, len(self.tokens) + new_tokens - 1) - self.sequence.length




def tree_widths(widest: int) -> list[int]:
    """The widths trees are searched at: the powers of two from NARROWEST_TREE_WIDTH below `widest`, and `widest`."""
    return buckets_up_to(widest, tuple(w for w in powers_of_two_up_to(widest) if w >= NARROWEST_TREE_WIDTH))


class RoundInputs:
    """What the drafter's graphs read each round besides the pool and the block rows, on the device: each
    request's budget (0 for padding requests) and the context rows the block forward first writes (their slots,
    -1 for none, positions and features), back to back from row 0. Filled from a host buffer allocated once,
    page-locked on a GPU so that the copy in is queued without the host waiting for it (on the CPU, the device
    tensors themselves).

    The long inputs and then the feature rows lie in one buffer, so that a round copies what it uses in one copy.
    Refilling the host buffer waits for the last copy out of it only where the drafter has not waited for the
    device since (`settled`): a round of trees always has, as it reads them back."""

    def __init__(self, max_batch: int, rows: int, feature_size: int, dtype: torch.dtype, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.longs_bytes = (max_batch + 2 * rows) * 8
        self.row_bytes = feature_size * dtype.itemsize
        host = torch.zeros(self.longs_bytes + rows * self.row_bytes, dtype=torch.uint8, pin_memory=self.on_gpu)
        host_longs = host[:self.longs_bytes].view(torch.long)
        host_longs[max_batch:max_batch + rows] = -1  # no slots: nothing to write
        self.host = host
        self.buffer = host.to(device) if self.on_gpu else host
        self.budgets, self.slots, self.positions = self.buffer[:self.longs_bytes].view(torch.long).split(
            [max_batch, rows, rows])
        self.features = self.buffer[self.longs_bytes:].view(dtype).view(rows, feature_size)
        # NumPy views of the host buffer, made once: the round fills them.
        self.host_budgets, self.host_slots, self.host_positions = (
            part.numpy() for part in host_longs.split([max_batch, rows, rows]))
        self.host_features = host[self.longs_bytes:].view(dtype).view(rows, feature_size)
        self.unsettled = False  # a copy in is queued that the device may not have made yet
        # bytes copied -> (the device's, the host's) views of them, made once each (as TreeRows.copy_views)
        self.copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def settled(self) -> None:
        """The device has done all the work queued so far: the caller waited for it."""
        self.unsettled = False

    def stage(self, budgets: list[int], parts: list[tuple[np.ndarray, np.ndarray, torch.Tensor]]) -> None:
        """This round's budgets and context rows (parts of (slots, positions, features) in turn), copied in."""
        if self.unsettled:  # (not in rounds of trees: see the class)
            torch.cuda.current_stream().synchronize()
        budgets_np, slots_np, positions_np = self.host_budgets, self.host_slots, self.host_positions
        rows = sum(len(slots) for slots, _, _ in parts)
        if len(budgets) > len(budgets_np) or rows > len(slots_np):
            raise TreeserveError(f"dflash: {len(budgets)} budgets and {rows} context rows do not fit the round's "
                                 f"inputs ({len(budgets_np)} and {len(slots_np)})")
        budgets_np[:len(budgets)], budgets_np[len(budgets):] = budgets, 0
        if parts:
            slots_np[:rows] = np.concatenate([slots for slots, _, _ in parts])
            positions_np[:rows] = np.concatenate([positions for _, positions, _ in parts])
        slots_np[rows:], positions_np[rows:] = -1, 0
        features = [part_features for _, _, part_features in parts]
        on_host = all(f.device.type == "cpu" for f in features)
        if features:
            if on_host:
                torch.cat(features, out=self.host_features[:rows])
            else:  # in process on a GPU: the target's features are there already
                self.features[:rows] = torch.cat([f.to(self.features.device) for f in features])
        if self.on_gpu:
            used = self.longs_bytes + (rows * self.row_bytes if features and on_host else 0)
            views = self.copy_views.get(used)
            if views is None:
                views = self.copy_views[used] = (self.buffer[:used], self.host[:used])
            views[0].copy_(views[1], non_blocking=True)
            self.unsettled = True


def rows_to_gpu(slots: np.ndarray, positions: np.ndarray, features: list[torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context rows from the host (their slots, positions and features, in parts) on the GPU, through one
    page-locked buffer in one copy, queued without the host waiting for it: a copy from pageable memory waits for
    the copy, and so for the device's work queued before it. Torch's page-locked allocator keeps the buffer until
    the copy is made."""
    rows, width = len(slots), features[0].shape[1]
    longs_bytes = 2 * rows * 8
    host = torch.empty(longs_bytes + rows * width * dtype.itemsize, dtype=torch.uint8, pin_memory=True)
    longs = host[:longs_bytes].view(torch.long).numpy()
    longs[:rows], longs[rows:] = slots, positions
    torch.cat(features, out=host[longs_bytes:].view(dtype).view(rows, width))
    moved = host.to(device, non_blocking=True)
    on_device = moved[:longs_bytes].view(torch.long)
    return on_device[:rows], on_device[rows:], moved[longs_bytes:].view(dtype).view(rows, width)


# Context tokens the drafter's pool holds over all requests, unless told (per token: 2 x layers x kv heads x
# head_dim values, about 1.5 KB for the shipped SmolLM2 drafter in bfloat16).
DEFAULT_CONTEXT_TOKENS = {"cpu": 32768, "cuda": 262144}


class DFlashDrafter:
    """Batched DFlash drafting: one block forward for every request of a round, then each request's tree built on
    the device (`chain`: the argmax path; `ddtree`: the best tree of its budget, up to `max_budget` nodes).
    Contexts live in one paged pool of `kv_cache_tokens`; with `graphs` (CUDA) the block forward replays a graph
    per batch bucket up to `max_batch` and the trees one per (batch bucket, tree width) (call `capture()` once),
    so a round costs two replays and one copy of the trees to the host."""

    name = "dflash"

    def __init__(self, model: DFlashModel, embedding: torch.Tensor, lm_head: torch.Tensor, tree: str = "ddtree",
                 max_batch: int = 64, kv_cache_tokens: int = 0, graphs: bool = False,
                 max_context: int | None = None, max_budget: int = MAX_BUDGET):
        cfg = model.config
        if tree not in TREE_KINDS:
            raise TreeserveError(f"unknown tree kind {tree!r} (use {' or '.join(TREE_KINDS)})")
        if embedding.shape[1] != cfg.layers.hidden_size or lm_head.shape[1] != cfg.layers.hidden_size:
            raise TreeserveError(f"the drafter's hidden size {cfg.layers.hidden_size} does not match the target's "
                                 f"{embedding.shape[1]}")
        if not 0 <= cfg.mask_token_id < embedding.shape[0]:
            raise TreeserveError(f"mask token id {cfg.mask_token_id} is outside the target's vocabulary")
        if not 1 <= max_budget <= MAX_BUDGET:
            raise TreeserveError(f"max budget must be between 1 and {MAX_BUDGET}, got {max_budget}")
        self.model, self.embedding, self.lm_head = model, embedding, lm_head
        self.tree_kind, self.max_budget = tree, max_budget
        self.feature_layer_ids = cfg.target_layer_ids
        self.feature_size = cfg.feature_size
        device = model.device
        self.kernels = device.type == "cuda"
        # A chain is the DDTree of each position's top token. A tree of at most max_budget nodes needs each
        # position's top max_budget tokens (trees.py says why), and holds at most every possible node. Each
        # round searches at the narrowest width that holds its largest budget, from each position's top `width`
        # tokens (top_k at most): a search `width` wide needs no more.
        self.top_k = 1 if tree == "chain" else min(max_budget, embedding.shape[0])
        self.tree_width = min(max_budget, possible_nodes(cfg.block_size - 1, self.top_k))
        self.tree_widths = tree_widths(self.tree_width)
        tokens = kv_cache_tokens or DEFAULT_CONTEXT_TOKENS[device.type]
        # Kept free for the block rows of a round (each request's block spills into one more pool block at most),
        # so proposing never runs out of blocks: contexts that would eat into this are refused in extend().
        self.block_reserve = max_batch * (-(-cfg.block_size // POOL_BLOCK) + 1)
        self.pool = PagedKVCache(cfg.layers, -(-tokens // POOL_BLOCK) + self.block_reserve, POOL_BLOCK, model.dtype,
                                 device)
        self.block_mask = np.ones((cfg.block_size, cfg.block_size), dtype=np.int8)  # a block sees all of itself
        self.runner = PagedRunner(self.pool, self._block_forward, max_batch, [cfg.block_size],
                                  max_context or cfg.layers.max_context, graphs)
        # The block forward first writes the round's new context rows, up to STAGED_BLOCKS blocks per request, so
        # that a round's context write is part of its graph replay.
        self.staged_rows = STAGED_BLOCKS * cfg.block_size
        self.inputs = RoundInputs(max_batch, max_batch * self.staged_rows, cfg.feature_size, model.dtype, device)
        self.unwritten: dict[int, DFlashRequest] = {}  # id -> a context with rows not written yet
        self.search_graphs: dict[tuple[int, int], CapturedGraph] = {}  # (batch bucket, tree width) -> its graph
        self.search_plans = []  # the index tables the search graphs read

    @classmethod
    def for_target(cls, path: str | Path, target_model, tree: str = "ddtree", **options) -> "DFlashDrafter":
        """Load the checkpoint at `path` onto the target's device and dtype, borrowing its embedding and
        LM head (`options`: the constructor's). Raises TreeserveError when the drafter does not fit the target."""
        model = load_dflash(path, target_model.device, target_model.dtype, target_model.config.num_layers)
        return cls(model, target_model.model.embed_tokens.weight, target_model.lm_head.weight, tree,
                   max_context=target_model.config.max_context, **options)

    def capture(self) -> None:
        self.inputs.slots.fill_(-1)  # the captures run the forward for real: it must write nothing
        seconds = self.runner.capture()
        started = time.perf_counter()
        self._capture_searches()
        log.info("captured %d CUDA graphs of the DFlash block forward (batch up to %d) and %d of its tree search "
                 "(widths %s) in %.1f s", len(self.runner.graphs), self.runner.max_batch, len(self.search_graphs),
                 ", ".join(map(str, self.tree_widths)), seconds + time.perf_counter() - started)

    @torch.inference_mode()
    def _capture_searches(self) -> None:
        """A search graph per (batch bucket, tree width), reading its bucket's block graph's log-probabilities,
        into the block graphs' memory pool (a round replays one after the other, never both at once)."""
        block, device = self.model.config.block_size, self.model.device
        self.search_graphs.clear()
        self.search_plans = [search_plan(block - 1, min(width, self.top_k), width, device)
                             for width in self.tree_widths]
        if self.kernels:
            self.search_plans += [kernel_tables(block - 1, min(width, self.top_k), width, device)
                                  for width in self.tree_widths]
        with cycle_collection_paused():
            for batch, rows in sorted(self.runner.graphs, reverse=True):
                log_probs = self.runner.graphs[(batch, rows)].outputs[0].view(batch, rows, -1)
                for width in reversed(self.tree_widths):
                    captured = capture_graph(functools.partial(self._search, log_probs, width),
                                             self.runner.memory_pool)
                    self.runner.memory_pool = captured.graph.pool()
                    self.search_graphs[(batch, width)] = captured
        torch.cuda.synchronize()

    def new_context(self) -> DFlashRequest:
        return DFlashRequest(self.pool.sequence())

    def rows_wanted(self, context: DFlashRequest, new_tokens: int = 0) -> int:
        """Feature rows the context lacks once `new_tokens` more tokens join."""
        return context.rows_wanted(new_tokens)

    def release(self, context: DFlashRequest) -> None:
        """Return the context's blocks to the pool (the request finished or left)."""
        context.unwritten.clear()  # rows for the blocks being freed: never written
        self.unwritten.pop(id(context), None)
        context.sequence.release()

    def extend(self, context: DFlashRequest, tokens: list[int], features: torch.Tensor | None) -> None:
        """The next tokens, and feature rows for the oldest tokens without theirs: as many as the tokens but the
        root, or fewer (they may come with a later call, before the context drafts)."""
        rows = 0 if features is None else features.shape[0]
        wanted = context.rows_wanted(len(tokens))
        if rows > wanted:
            raise TreeserveError(f"dflash: {rows} feature rows for {len(tokens)} new tokens; expected at most "
                                 f"{wanted} (one per token that entered the target's KV cache)")
        if rows and features.shape[1] != self.feature_size:
            raise TreeserveError(f"dflash: features are {features.shape[1]} wide; this drafter needs "
                                 f"{self.feature_size}")
        sequence = context.sequence
        if rows:
            allocator = self.pool.allocator
            needed = -(-(sequence.length + rows) // POOL_BLOCK) - len(sequence.blocks)
            if allocator.free_count - needed < self.block_reserve:
                raise DraftPoolFull(f"dflash: the context pool ({self.pool.allocator.num_blocks} blocks of "
                                    f"{POOL_BLOCK}) is full; raise --kv-cache-tokens")
        context.tokens.extend(tokens)
        if rows:
            positions = np.arange(sequence.length, sequence.length + rows)
            context.unwritten.append((sequence.reserve_array(rows), positions, features))
            sequence.commit(rows)
            self.unwritten[id(context)] = context

    def write_context(self, contexts: list[DFlashRequest] | None = None) -> None:
        """Write the unwritten context rows of `contexts` (default: every context's) now, in one eager pass."""
        contexts = list(self.unwritten.values()) if contexts is None else contexts
        parts = [part for context in contexts for part in self._take_unwritten(context)]
        if parts:
            slots, positions, features = zip(*parts)
            slots, positions = np.concatenate(slots), np.concatenate(positions)
            if self.kernels and all(part.device.type == "cpu" for part in features):
                rows = rows_to_gpu(slots, positions, features, self.model.dtype, self.model.device)
            else:
                rows = torch.from_numpy(slots), torch.from_numpy(positions), torch.cat(features)
            self.model.write_context(self.pool, *rows, self.kernels)

    def _take_unwritten(self, context: DFlashRequest) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        parts, context.unwritten = context.unwritten, []
        self.unwritten.pop(id(context), None)
        return parts

    def _stage_round(self, contexts: list[DFlashRequest], budgets: list[int]) -> None:
        """The round's budgets and every context's unwritten rows, in the graphs' inputs; a context with more than
        staged_rows of them (a prompt) is written eagerly first, so that the rest fit any bucket that holds the
        batch."""
        self.write_context([context for context in contexts if context.unwritten_rows > self.staged_rows])
        self.inputs.stage(budgets, [part for context in contexts for part in self._take_unwritten(context)])

    def _block_forward(self, rows: TreeRows) -> tuple[torch.Tensor]:
        """Log-probabilities (rows, vocab) of every block row, after writing the round's context rows: the
        forward the block graphs capture."""
        staged = slice(0, rows.paged.batch * self.staged_rows)
        inputs = self.inputs
        self.model.write_context(self.pool, inputs.slots[staged], inputs.positions[staged],
                                 inputs.features[staged], self.kernels)
        return (self.row_log_probs(rows),)

    def _search(self, log_probs: torch.Tensor, width: int) -> tuple[torch.Tensor]:
        """Each request's tree from its block log-probabilities (B, block_size, vocab), packed as
        trees.ddtree_select packs it, searched `width` wide: the work the search graphs capture. On a GPU the
        search is one Triton launch (treeserve.kernels.ddtree_search), the same trees."""
        drafted = log_probs[:, 1:]  # the positions after each root
        top = drafted.topk(min(width, self.top_k), dim=-1)
        search = ddtree_select_kernel if self.kernels else ddtree_select
        packed, _ = search(top.values, top.indices, self.inputs.budgets[:log_probs.shape[0]], width)
        return (packed,)

    def row_log_probs(self, rows: TreeRows) -> torch.Tensor:
        """The drafter's log-probabilities (rows, vocab) at every block row."""
        embeddings = F.embedding(rows.tokens, self.embedding).to(self.model.dtype)
        hidden = self.model(embeddings, rows.positions, PagedAttention(self.pool, rows.paged, kernels=self.kernels))
        return torch.log_softmax((hidden @ self.lm_head.T.to(hidden.dtype)).float(), dim=-1)

    @torch.inference_mode()
    def _run_block(self, contexts: list[DFlashRequest], budgets: list[int]) -> torch.Tensor:
        """The block forward of these contexts (at most max_batch), their budgets staged for the search: the
        log-probabilities (B', block_size, vocab), B' >= B their batch bucket's (the rows past B are padding)."""
        self._stage_round(contexts, budgets)
        block, mask_token = self.model.config.block_size, self.model.config.mask_token_id
        sequences = [context.sequence for context in contexts]
        log_probs, = self.runner.run(
            sequences, [[context.tokens[-1]] + [mask_token] * (block - 1) for context in contexts],
            [np.arange(s.length, s.length + block) for s in sequences], [self.block_mask] * len(contexts))
        for sequence in sequences:
            sequence.commit(0)  # the block's own keys and values are never context
        return log_probs

    @torch.inference_mode()
    def _trees(self, log_probs: torch.Tensor, width: int) -> torch.Tensor:
        """The packed trees (B', 1 + 2 * width) of the last block forward, whose log-probabilities are
        `log_probs`: from the search graph of its bucket where it replayed one, else eagerly."""
        bucket = self.runner.last_bucket
        captured = self.search_graphs.get((bucket[0], width)) if bucket is not None else None
        if captured is None:
            return self._search(log_probs, width)[0]
        captured.graph.replay()
        return captured.outputs[0]

    def width_for(self, budget: int) -> int:
        """The narrowest tree width that holds a round whose largest budget is `budget`."""
        return next(width for width in self.tree_widths if width >= min(budget, self.tree_width))

    def block_log_probs(self, contexts: list[DFlashRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Roots (B,) and log-probabilities (B, block_size - 1, vocab) for the positions after each root."""
        log_probs = self._run_block(contexts, [0] * len(contexts))[:len(contexts)]
        roots = torch.tensor([context.tokens[-1] for context in contexts], device=self.model.device)
        return roots, log_probs[:, 1:]

    def propose(self, contexts: list[DFlashRequest], budgets: list[int]) -> list[DraftTree]:
        outside = [budget for budget in budgets if not 0 <= budget <= self.max_budget]
        if outside:
            raise TreeserveError(f"dflash: budgets must be between 0 and {self.max_budget}, got {outside[0]}")
        lacking = next((context.rows_wanted() for context in contexts if context.rows_wanted()), 0)
        if lacking:
            raise TreeserveError(f"dflash: a context lacks the feature rows of {lacking} tokens")
        trees, step = [], self.runner.max_batch
        timed = log.isEnabledFor(logging.DEBUG)
        for start in range(0, len(contexts), step):
            chunk, chunk_budgets = contexts[start:start + step], list(budgets[start:start + step])
            if timed:
                started, rows = time.perf_counter(), sum(context.unwritten_rows for context in chunk)
            log_probs = self._run_block(chunk, chunk_budgets)
            if timed:
                launched = time.perf_counter()
            packed = self._trees(log_probs, self.width_for(max(chunk_budgets)))[:len(chunk)].tolist()
            if timed:
                log.debug("dflash: %d contexts, %d new context rows: block forward launched in %.3f ms, trees "
                          "read back %.3f ms later", len(chunk), rows, (launched - started) * 1e3,
                          (time.perf_counter() - launched) * 1e3)
            # (reading the trees back waited for the device: every copy in before them has been made)
            self.inputs.settled()
            self.runner.staging_copies.settled()
            trees += unpack_trees([context.tokens[-1] for context in chunk], packed)
        return trees
