"""Training a DFlash drafter on its target's own responses (`treeserve train-drafter`).

The drafter must predict the target's next b - 1 tokens, so the data is the target's own output: the target
answers the training prompts (greedy by default, many prompts decoded together) and those tokens are the labels.

One training forward serves many anchors of a sequence. The target runs once over the whole sequence (frozen,
no gradient) to give the features; each draft layer turns every position's feature into context keys/values
once; then the A blocks of b rows query together, with keys = [context rows; all block rows] and a mask that
lets block i see context positions < a_i and its own b rows only. For each anchor that is exactly the inference
computation (DFlashModel.extend_context over positions < a, then forward over the block), tested to float32
tolerance, at the cost of one target forward per sequence instead of one per anchor.

Everything random in a step (which sequences, which anchors) is drawn from generators seeded by (seed, step),
so a run resumed from OUT/trainer-state.pt continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

from treeserve.prompt_sets import encode_prompts, read_prompts
from treeserve.drafter.dflash import DFlashConfig, DFlashModel, default_target_layer_ids, load_dflash, save_dflash
from treeserve.errors import TreeserveError
from treeserve.params import GenerationParams
from treeserve.models import DecoderLM, ModelConfig
from treeserve.models.transformer import rope_cos_sin
from treeserve.tokenizer import Tokenizer

STATE_NAME, SUMMARY_NAME = "trainer-state.pt", "training.json"
DATA_NAME, EVAL_DATA_NAME = "data.jsonl", "eval-data.jsonl"
Log = Callable[[str], None]


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- new drafter


def choose_mask_token(target: DecoderLM, tokenizer: Tokenizer) -> int:
    """The MASK id: a row of the target's embedding that ordinary text never encodes to.

    In order of preference: the first row past the tokenizer's vocabulary (a padding row, as z-lab picks for
    Qwen3); else the highest-id special token that neither the chat template nor the stop ids use (SmolLM2:
    16, <empty_output>); else the last row. A row that is all zeros is passed over: it would give every MASK
    row of a block the same zero query, so a one-layer drafter could not tell the drafted positions apart.
    """
    embeddings = target.model.embed_tokens.weight
    template = tokenizer.chat_template or ""
    specials = sorted((i for i, token in tokenizer.backend.get_added_tokens_decoder().items()
                       if token.special and i not in tokenizer.eos_ids and token.content not in template
                       and token.content not in (tokenizer.bos_token, tokenizer.eos_token)), reverse=True)
    rows = embeddings.shape[0]
    candidates = [*range(tokenizer.vocab_size, rows), *(i for i in specials if i < rows)]
    return next((i for i in candidates if embeddings[i].abs().sum() > 0), rows - 1)


def drafter_config(target: ModelConfig, mask_token_id: int, layers: int = 1, block_size: int = 16,
                   target_layer_ids: Sequence[int] | None = None, feature_layers: int = 3,
                   intermediate_size: int | None = None) -> DFlashConfig:
    """Draft layers shaped like the target's (hidden size, heads, head_dim, RoPE theta, eps, context), Qwen3-style
    (RMSNorm on q and k) as DFlash defines them. RoPE scaling is not copied: the checkpoint format has no field
    for it, and the drafter's own attention is trained from scratch at plain RoPE."""
    if layers < 1 or block_size < 2:
        raise TreeserveError(f"need at least 1 draft layer and a block size of at least 2 "
                             f"(got {layers} layers, block size {block_size})")
    ids = tuple(target_layer_ids) if target_layer_ids else default_target_layer_ids(target.num_layers, feature_layers)
    if not all(0 <= i < target.num_layers for i in ids):
        raise TreeserveError(f"target layer ids {list(ids)} must lie in [0, {target.num_layers})")
    if not 0 <= mask_token_id < target.vocab_size:
        raise TreeserveError(f"mask token id {mask_token_id} is outside the vocabulary [0, {target.vocab_size})")
    layer_cfg = dataclasses.replace(target, family="qwen3", num_layers=layers, tie_word_embeddings=False,
                                    intermediate_size=intermediate_size or target.intermediate_size,
                                    rope_scaling=None, rope_freq_factors=None)
    return DFlashConfig(layer_cfg, block_size, ids, mask_token_id, target.num_layers)


def new_drafter(cfg: DFlashConfig, seed: int = 0, init_from: DecoderLM | None = None) -> DFlashModel:
    """Random init (weights normal(0, 0.02), norms one), in float32 (the optimizer's master copy).

    With `init_from`, draft layer i starts as the target's layer L - n + i wherever shapes match (a llama
    target has no q/k norms, so those stay one): the last layers already map features to next-token states.
    """
    generator = torch.Generator().manual_seed(seed)
    model = DFlashModel(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        if init_from is not None:
            source = init_from.model.layers[-cfg.layers.num_layers:]
            for layer, donor in zip(model.layers, source):
                own = layer.state_dict()
                layer.load_state_dict({k: v.float() for k, v in donor.state_dict().items()
                                       if k in own and own[k].shape == v.shape}, strict=False)
    return model


# ------------------------------------------------------------------------------------- training forward


class CausalAttention:
    """Plain causal self-attention over a right-padded batch (B, T) flattened to B*T rows, without a cache: the
    target's features for whole training sequences. Padding comes after a row, so it never changes it."""

    def __init__(self, batch: int):
        self.batch = batch

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.unflatten(0, (self.batch, -1)).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)


@torch.no_grad()
def target_features(target: DecoderLM, tokens: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """tokens (B, T) -> the concatenated hidden states after `layer_ids`, (B, T, len(layer_ids) * hidden)."""
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).repeat(batch)
    no_rows = torch.empty(0, dtype=torch.long, device=tokens.device)
    _, hidden = target(tokens.flatten(), positions, CausalAttention(batch), logits_rows=no_rows,
                       hidden_layer_ids=layer_ids)
    return torch.cat(hidden, dim=-1).unflatten(0, (batch, length))


class AnchoredBlockAttention:
    """Draft-layer attention for A blocks per sequence. Queries: the B * A * b block rows. Keys/values: per
    sequence, its context rows (computed once per layer) followed by all its block rows; `mask` (B, A*b, T + A*b)
    chooses what each row sees."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor):
        self.keys, self.values, self.mask = keys, values, mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = self.mask.shape[0]
        q = q.unflatten(0, (batch, -1)).transpose(1, 2)
        keys = torch.cat((self.keys[layer], k.unflatten(0, (batch, -1))), dim=1).transpose(1, 2)
        values = torch.cat((self.values[layer], v.unflatten(0, (batch, -1))), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask[:, None], enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)


def block_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """(B, A*b, T + A*b) bool: block i's rows see context positions < anchors[:, i] and block i's b rows."""
    batch, count = anchors.shape
    row_anchor = anchors.repeat_interleave(block_size, dim=1)
    context = torch.arange(context_length, device=anchors.device) < row_anchor[:, :, None]
    block_of_row = torch.arange(count, device=anchors.device).repeat_interleave(block_size)
    own_block = block_of_row[:, None] == block_of_row[None, :]
    return torch.cat((context, own_block.expand(batch, -1, -1)), dim=2)


def block_hidden(model: DFlashModel, features: torch.Tensor, block_embeddings: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's normalised output for every block: features (B, T, F), block_embeddings (B, A*b, hidden)
    for blocks starting at `anchors` (B, A) -> (B, A*b, hidden)."""
    batch, length, _ = features.shape
    block_size = model.config.block_size
    keys, values = model.context_kv(features.flatten(0, 1), torch.arange(length, device=features.device).repeat(batch))
    keys = [k.unflatten(0, (batch, length)) for k in keys]
    values = [v.unflatten(0, (batch, length)) for v in values]
    positions = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).flatten()
    x = block_embeddings.flatten(0, 1).to(model.dtype)
    cos, sin = rope_cos_sin(model.rope_inv_freq, positions, x.dtype)
    attention = AnchoredBlockAttention(keys, values, block_mask(anchors, length, block_size))
    for layer in model.layers:
        x = layer(x, cos, sin, attention)
    return model.norm(x).unflatten(0, (batch, -1))


def block_logits(model: DFlashModel, target: DecoderLM, tokens: torch.Tensor, features: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Logits (B, A, b-1, vocab) for positions a+1 .. a+b-1 of every anchor a, through the target's embedding
    (block [token at a, MASK x (b-1)]) and LM head, as at inference."""
    cfg = model.config
    block = torch.full((*anchors.shape, cfg.block_size), cfg.mask_token_id, device=tokens.device)
    block[:, :, 0] = tokens.gather(1, anchors)
    hidden = block_hidden(model, features, target.model.embed_tokens(block.flatten(1)), anchors)
    return target.lm_head(hidden.unflatten(1, (anchors.shape[1], cfg.block_size))[:, :, 1:])


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, A, b-1): the tokens at a+1 .. a+b-1 (clamped into the sequence for invalid padding anchors)."""
    index = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)
    return tokens.gather(1, index.flatten(1).clamp(max=tokens.shape[1] - 1)).view(index.shape)


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weight of block position k = 1 .. b-1: exp(-(k-1)/gamma), DFlash's decay (early positions decide the
    accepted length); gamma <= 0 weighs all positions alike."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones_like(k)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor):
    """Cross-entropy per position, weighted by `weights` (b-1,) over valid anchors (B, A), divided by the weight
    sum."""
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.device) * valid[:, :, None]
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


def accepted_lengths(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per valid anchor, the tokens a chain of the drafter's argmaxes gets accepted for: 1 (the target's own
    bonus token) + the number of leading block positions whose argmax equals the label."""
    hits = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1) + 1
    return hits[valid]


# --------------------------------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Sample:
    """prompt + the target's response; anchors are drawn from the response only."""

    tokens: tuple[int, ...]
    prompt_length: int


def sample_anchors(samples: Sequence[Sample], count: int, block_size: int, generator: torch.Generator):
    """Up to `count` distinct anchors per sequence with all labels present (a + b - 1 < length) and a in the
    response (a >= prompt length, and a >= 1 so the context is never empty). Returns anchors (B, A) and valid
    (B, A); sequences with fewer usable anchors are padded with invalid ones."""
    anchors = torch.zeros(len(samples), count, dtype=torch.long)
    valid = torch.zeros(len(samples), count, dtype=torch.bool)
    for row, sample in enumerate(samples):
        first = max(sample.prompt_length, 1)
        usable = len(sample.tokens) - block_size - first + 1
        if usable > 0:
            chosen = torch.randperm(usable, generator=generator)[:count] + first
            anchors[row, :len(chosen)], valid[row, :len(chosen)] = chosen, True
    return anchors, valid


def pad_tokens(samples: Sequence[Sample]) -> torch.Tensor:
    """(B, longest) with right padding (never a label nor visible context of a valid anchor)."""
    tokens = torch.zeros(len(samples), max(len(s.tokens) for s in samples), dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample.tokens)] = torch.tensor(sample.tokens)
    return tokens


def usable(sample: Sample, block_size: int) -> bool:
    return len(sample.tokens) - block_size - max(sample.prompt_length, 1) + 1 > 0


class LockstepAttention:
    """Left-padded rows decoded in lockstep with one KV cache (layers, B, kv_heads, capacity, head_dim): row b's
    real tokens start at column pads[b]. `length` (the columns written so far) lives on the device, and a decode
    step attends over every column under a mask worked out there, so a step has static shapes and can replay from
    one CUDA graph; the prompt's forward attends over its own columns only. Call `advance()` after each forward.

    The query heads that share a KV head are folded into one longer query (B, kv_heads, group * T, d), so SDPA
    needs no GQA support from its backend (not every fused kernel that takes a mask has it)."""

    def __init__(self, cfg: ModelConfig, pads: torch.Tensor, capacity: int, dtype: torch.dtype):
        shape = (cfg.num_layers, len(pads), cfg.num_kv_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=pads.device)
        self.values = torch.zeros(shape, dtype=dtype, device=pads.device)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.pads, self.capacity = pads, capacity
        self.length = torch.zeros(1, dtype=torch.long, device=pads.device)
        self.step, self.visible = 0, 0

    def begin(self, tokens_per_row: int, visible: int | None = None) -> None:
        """The next forward brings `tokens_per_row` tokens a row and attends over the first `visible` columns
        (default: all of them)."""
        self.step, self.visible = tokens_per_row, visible or self.capacity
        self.columns = self.length + torch.arange(tokens_per_row, device=self.pads.device)  # where they go
        cols = torch.arange(self.visible, device=self.pads.device)
        causal = cols[None, None, :] <= self.columns[None, :, None]
        real = cols[None, None, :] >= self.pads[:, None, None]
        # A padding row sees itself only: never a fully masked row, whose NaNs would reach the cache.
        mask = (real & causal) | (cols[None, None, :] == self.columns[None, :, None])  # (B, T, visible)
        self.mask = mask.repeat(1, self.group, 1)[:, None]  # (B, 1, group * T, visible): the folded query's rows

    def advance(self) -> None:
        self.length += self.step

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, step = len(self.pads), self.step
        q, k, v = (x.unflatten(0, (batch, step)).transpose(1, 2) for x in (q, k, v))  # (B, heads, T, d)
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.columns, k)
        values.index_copy_(2, self.columns, v)
        kv_heads, head_dim = k.shape[1], k.shape[3]
        folded = q.reshape(batch, kv_heads, self.group * step, head_dim)  # query head h uses KV head h // group
        out = F.scaled_dot_product_attention(folded, keys[:, :, :self.visible], values[:, :, :self.visible],
                                             attn_mask=self.mask)
        return out.reshape(batch, kv_heads * self.group, step, head_dim).transpose(1, 2).flatten(0, 1)


class LockstepDecoder:
    """Greedy or sampled decoding of left-padded prompts together, one token a row per step, everything on the
    device: a step records the last chosen token (-1 once a row has stopped), feeds it to the target and chooses
    the next. Greedy steps on CUDA replay one captured graph (a step of a 30-layer model is a few hundred kernel
    launches, which cost more than the step's arithmetic at this size)."""

    WARM_UP_STEPS = 3  # run eagerly before capture: they are real steps, and they settle the allocator

    def __init__(self, model: DecoderLM, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: set[int],
                 temperature: float = 0.0, seed: int = 0, graphs: bool = True):
        device = model.device
        self.model, self.max_new_tokens, self.temperature = model, max_new_tokens, temperature
        # Sampling stays eager: a graph would replay its generator's draws.
        self.graphs = graphs and device.type == "cuda" and temperature == 0
        self.params = GenerationParams(temperature=temperature)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.width = int(lengths.max())
        self.pads = self.width - lengths
        self.attention = LockstepAttention(model.config, self.pads, self.width + max_new_tokens, model.dtype)
        self.stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
        self.positions = lengths.clone()  # of the token fed at the next step
        self.outputs = torch.full((len(prompts), max_new_tokens), -1, dtype=torch.long, device=device)
        self.finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.token = self._prefill(prompts)

    def _prefill(self, prompts: Sequence[list[int]]) -> torch.Tensor:
        device, width = self.model.device, self.width
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
        self.attention.begin(width, visible=width)
        positions = (torch.arange(width, device=device)[None, :] - self.pads[:, None]).clamp(min=0)
        last_rows = torch.arange(len(prompts), device=device) * width + width - 1
        logits, _ = self.model(ids.flatten(), positions.flatten(), self.attention, logits_rows=last_rows)
        self.attention.advance()
        return self._choose(logits)

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        from treeserve.sampling import target_probs

        if self.temperature == 0:
            return logits.argmax(dim=-1)
        return torch.multinomial(target_probs(logits, self.params).float(), 1, generator=self.generator)[:, 0]

    def _step(self) -> None:
        """Record the chosen tokens, then feed them and choose the next ones (in place: a graph replays this)."""
        self.outputs.index_copy_(1, self.step_index, torch.where(self.finished, -1, self.token)[:, None])
        self.finished |= torch.isin(self.token, self.stops)
        self.attention.begin(1)
        logits, _ = self.model(self.token, self.positions, self.attention)
        self.attention.advance()
        self.token.copy_(self._choose(logits))
        self.positions += 1
        self.step_index += 1

    def _graph(self):
        """The step captured, once warm-up has run (None without graphs)."""
        if not self.graphs:
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        return graph

    @torch.inference_mode()
    def run(self) -> list[list[int]]:
        """The responses (stop token included): decodes until every row stopped or max_new_tokens."""
        graph, steps = None, 0
        while steps < self.max_new_tokens:
            if graph is not None:
                graph.replay()
            else:
                self._step()
            steps += 1
            if steps == self.WARM_UP_STEPS and steps < self.max_new_tokens:
                graph = self._graph()
            # Asking whether every row has finished waits for the GPU: only every 16 steps.
            if steps % 16 == 0 and bool(self.finished.all()):
                break
        return [[t for t in row if t >= 0] for row in self.outputs[:, :steps].tolist()]


def generate_padded(model: DecoderLM, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: set[int],
                    temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """The responses (stop token included) to `prompts`, decoded together; greedy, or sampled at `temperature`
    from the target's distribution."""
    return LockstepDecoder(model, prompts, max_new_tokens, stop_ids, temperature, seed).run()


# cuDNN attention builds a new plan, on the CPU, for every new key length; the fused kernels need none.
VARYING_LENGTH_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def regenerate(model: DecoderLM, tokenizer: Tokenizer, prompts: Mapping[int, list[int]], max_new_tokens: int,
               temperature: float = 0.0, concurrency: int = 64, seed: int = 0,
               on_sample: Callable[[int, Sample], None] | None = None, log: Log | None = log_stderr) -> dict[int, Sample]:
    """The target's own responses, `concurrency` prompts of similar length decoded together
    (generate_padded). Keys are the prompts' indices in their file; a batch samples with seed + its first key."""
    order = sorted(prompts, key=lambda key: len(prompts[key]))  # similar lengths: little padding
    done, tokens, started = {}, 0, time.perf_counter()
    for start in range(0, len(order), concurrency):
        keys = order[start:start + concurrency]
        with sdpa_kernel(VARYING_LENGTH_SDPA):
            responses = generate_padded(model, [prompts[k] for k in keys], max_new_tokens, set(tokenizer.eos_ids),
                                        temperature, seed + keys[0])
        for key, response in zip(keys, responses):
            done[key] = Sample(tuple(prompts[key] + response), len(prompts[key]))
            tokens += len(response)
            if on_sample is not None:
                on_sample(key, done[key])
        if log is not None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            eta = (len(order) - len(done)) * (tokens / len(done)) / max(rate, 1e-9)
            log(f"regenerate: {len(done)}/{len(order)} responses, {tokens} tokens, {rate:.0f} tok/s, "
                f"ETA {format_duration(eta)}")
    return done


def read_responses(path: Path, prompts: Sequence[list[int]]) -> dict[int, Sample]:
    """The responses already in `path`, checked against `prompts`. A last line cut short by an interrupted run
    is dropped from the file, so appending continues cleanly."""
    if not path.is_file():
        return {}
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text)
    done = {}
    for line in text.splitlines():
        record = json.loads(line)
        sample, index = Sample(tuple(record["tokens"]), record["prompt_length"]), record["index"]
        if index >= len(prompts):  # the file answers a longer list of the same prompts (--limit)
            continue
        if list(sample.tokens[:sample.prompt_length]) != prompts[index]:
            raise TreeserveError(f"{path} holds responses to other prompts; delete it or use another --out")
        done[index] = sample
    return done


def load_or_regenerate(path: Path, model: DecoderLM, tokenizer: Tokenizer, prompts: Sequence[list[int]],
                       max_new_tokens: int, log: Log | None = log_stderr, **generation) -> list[Sample]:
    """The responses to `prompts`, kept in `path` (JSONL, one {"index", "prompt_length", "tokens"} per response,
    appended as each finishes): what is already there is reused, only missing ones are generated."""
    done = read_responses(path, prompts)
    missing = {i: ids for i, ids in enumerate(prompts) if i not in done}
    if missing:
        if log is not None:
            log(f"regenerate: {len(missing)} of {len(prompts)} prompts need responses ({path.name})")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            def keep(index: int, sample: Sample) -> None:
                record = {"index": index, "prompt_length": sample.prompt_length, "tokens": list(sample.tokens)}
                f.write(json.dumps(record) + "\n")
                f.flush()

            done |= regenerate(model, tokenizer, missing, max_new_tokens, on_sample=keep, log=log, **generation)
    return [done[i] for i in range(len(prompts))]


def data_stats(samples: Sequence[Sample]) -> dict:
    total = sum(len(s.tokens) for s in samples)
    response = total - sum(s.prompt_length for s in samples)
    return {"sequences": len(samples), "tokens": total, "response_tokens": response,
            "mean_response_tokens": round(response / max(len(samples), 1), 1)}


# --------------------------------------------------------------------------------------------------- loop


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors: int = 16  # blocks per sequence per step
    lr: float = 6e-4
    warmup: int | None = None  # steps of linear warm-up; None: 5% of the steps
    loss_decay: float = 7.0  # gamma of the per-position weights; <= 0: uniform
    weight_decay: float = 0.01
    log_every: int = 10
    eval_every: int = 250
    save_every: int = 500
    seed: int = 0
    save_dtype: torch.dtype = torch.bfloat16

    def validate(self) -> None:
        for name in ("steps", "batch_size", "anchors", "log_every", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise TreeserveError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise TreeserveError(f"--lr must be positive, got {self.lr}")
        if self.warmup is not None and self.warmup < 0:
            raise TreeserveError(f"--warmup must be >= 0, got {self.warmup}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to zero at the last step."""
        warmup = self.warmup if self.warmup is not None else self.steps // 20
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(self.steps - warmup, 1)
        return self.lr * 0.5 * (1 + math.cos(math.pi * progress))


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def batch_indices(count: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Step s takes items s*B .. s*B+B-1 of an endless stream of shuffled epochs (epoch e shuffled by (seed, e)):
    every sequence once per epoch, and computable from the step alone."""
    flat = range(step * batch_size, (step + 1) * batch_size)
    orders = {e: torch.randperm(count, generator=step_generator(seed, -1 - e)) for e in {i // count for i in flat}}
    return [int(orders[i // count][i % count]) for i in flat]


def autocast(device: torch.device):
    """bfloat16 autocast on CUDA (float32 master weights); plain float32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def batch_loss(model: DFlashModel, target: DecoderLM, samples: Sequence[Sample], anchors: torch.Tensor,
               valid: torch.Tensor, weights: torch.Tensor):
    """(loss, logits, labels) for one batch with the given anchors."""
    device = target.device
    tokens = pad_tokens(samples).to(device)
    anchors, valid = anchors.to(device), valid.to(device)
    with autocast(device):
        features = target_features(target, tokens, model.config.target_layer_ids)
        logits = block_logits(model, target, tokens, features, anchors)
        labels = block_labels(tokens, anchors, model.config.block_size)
        return block_loss(logits, labels, valid, weights), logits, labels


@torch.no_grad()
def evaluate(model: DFlashModel, target: DecoderLM, samples: Sequence[Sample], settings: TrainSettings) -> dict:
    """Held-out loss and mean accepted length of the argmax chain, at anchors fixed by the seed (the same at
    every evaluation, so successive figures compare)."""
    weights = decay_weights(model.config.block_size, settings.loss_decay)
    generator = step_generator(settings.seed, -10**6)
    lengths, losses = [], []
    for start in range(0, len(samples), settings.batch_size):
        batch = samples[start:start + settings.batch_size]
        anchors, valid = sample_anchors(batch, settings.anchors, model.config.block_size, generator)
        loss, logits, labels = batch_loss(model, target, batch, anchors, valid, weights)
        lengths.append(accepted_lengths(logits, labels, valid.to(logits.device)).float())
        losses.append(loss.item())
    accepted = torch.cat(lengths)
    return {"loss": round(sum(losses) / len(losses), 4), "accepted_length": round(accepted.mean().item(), 4),
            "anchors": accepted.numel()}


def save_state(out: Path, model: DFlashModel, optimizer: torch.optim.Optimizer, step: int,
               settings: TrainSettings) -> None:
    """OUT/trainer-state.pt (written whole, then renamed into place) and the z-lab checkpoint next to it."""
    state = {"step": step, "seed": settings.seed, "drafter_config": model.config.to_json(),
             "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    partial = out / (STATE_NAME + ".partial")
    torch.save(state, partial)
    partial.replace(out / STATE_NAME)
    save_dflash(model, out, settings.save_dtype)


def resume(out: Path, model: DFlashModel, optimizer: torch.optim.Optimizer, settings: TrainSettings) -> int:
    """The step to start from: 0, or the saved step after loading OUT/trainer-state.pt into model and optimizer."""
    path = out / STATE_NAME
    if not path.is_file():
        return 0
    state = torch.load(path, map_location=model.device, weights_only=True)
    if state["drafter_config"] != model.config.to_json() or state["seed"] != settings.seed:
        raise TreeserveError(f"{path} is from a run with another drafter config or seed; "
                             "use the same flags to resume, or another --out")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


class Progress:
    """Mean loss, tokens/s and ETA over the steps since the last line. The loss stays on the device until a line
    is printed, so logging does not wait for the GPU every step."""

    def __init__(self, total_steps: int):
        self.total_steps, self.curve = total_steps, []
        self.reset()

    def reset(self) -> None:
        self.loss, self.steps, self.tokens, self.start = 0.0, 0, 0, time.perf_counter()

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.loss, self.steps, self.tokens = self.loss + loss.detach(), self.steps + 1, self.tokens + tokens

    def line(self, done: int, lr: float) -> str:
        elapsed = time.perf_counter() - self.start
        mean = float(self.loss) / self.steps
        self.curve.append([done, round(mean, 4)])
        eta = elapsed / self.steps * (self.total_steps - done)
        text = (f"train: step {done}/{self.total_steps} loss {mean:.4f} lr {lr:.2e} "
                f"{self.tokens / elapsed:.0f} tok/s ETA {format_duration(eta)}")
        self.reset()
        return text


def train(model: DFlashModel, target: DecoderLM, data: Sequence[Sample], held_out: Sequence[Sample], out: Path,
          settings: TrainSettings, log: Log = log_stderr) -> dict:
    """Train `model` (on the target's device) to `settings.steps`, resuming from OUT/trainer-state.pt if there;
    returns the summary (loss curve, held-out evaluation)."""
    settings.validate()
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)  # gradients flow through its embedding and LM head, never into them
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                  betas=(0.9, 0.95))
    first_step = resume(out, model, optimizer, settings)
    if first_step:
        log(f"train: resuming from {STATE_NAME} at step {first_step}")
    weights = decay_weights(model.config.block_size, settings.loss_decay)
    progress, evaluation, held_out_curve = Progress(settings.steps), None, []
    for step in range(first_step, settings.steps):
        done = step + 1
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        batch = [data[i] for i in batch_indices(len(data), settings.batch_size, step, settings.seed)]
        anchors, valid = sample_anchors(batch, settings.anchors, model.config.block_size,
                                        step_generator(settings.seed, step))
        loss, _, _ = batch_loss(model, target, batch, anchors, valid, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.add(loss, sum(len(s.tokens) for s in batch))
        if done % settings.log_every == 0 or done == settings.steps:
            log(progress.line(done, settings.lr_at(step)))
        if held_out and (done % settings.eval_every == 0 or done == settings.steps):
            evaluation = evaluate(model, target, held_out, settings)
            held_out_curve.append({"step": done, "loss": evaluation["loss"],
                                   "accepted_length": evaluation["accepted_length"]})
            log(f"eval: step {done} held-out loss {evaluation['loss']:.4f} "
                f"accepted length {evaluation['accepted_length']:.3f} ({evaluation['anchors']} anchors)")
        if done % settings.save_every == 0 or done == settings.steps:
            save_state(out, model, optimizer, done, settings)
    if held_out and evaluation is None:  # nothing left to train: report the saved drafter
        evaluation = evaluate(model, target, held_out, settings)
    return {"start_step": first_step, "steps": settings.steps, "loss_curve": progress.curve,
            "final_loss": progress.curve[-1][1] if progress.curve else None, "held_out": evaluation,
            "held_out_curve": held_out_curve}


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ---------------------------------------------------------------------------------------------------- CLI


def settings_from_args(args) -> TrainSettings:
    settings = TrainSettings(
        steps=args.steps, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
        loss_decay=args.loss_decay, log_every=args.log_every, eval_every=args.eval_every,
        save_every=args.save_every, seed=args.seed, save_dtype=getattr(torch, args.save_dtype))
    settings.validate()
    if args.limit is not None and args.limit < 1:
        raise TreeserveError(f"--limit must be at least 1, got {args.limit}")
    for name in ("held_out", "max_new_tokens", "gen_batch", "block_size", "layers", "target_layers"):
        minimum = 0 if name == "held_out" else 2 if name == "block_size" else 1
        if getattr(args, name) < minimum:
            raise TreeserveError(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(args, name)}")
    GenerationParams(temperature=args.temperature).validate()  # regeneration samples by the serving rules
    return settings


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise TreeserveError(f"--target-layer-ids: expected comma-separated integers, got {text!r}") from None


def split_prompts(args, tokenizer: Tokenizer, records: list[dict], held_records: list[dict], max_prompt: int):
    """(training prompts, held-out prompts) as token ids, prompts too long for the context left out."""
    train_ids, held_ids = ([ids for ids in encode_prompts(tokenizer, group) if len(ids) <= max_prompt]
                           for group in (records, held_records))
    skipped = len(records) + len(held_records) - len(train_ids) - len(held_ids)
    if skipped:
        log_stderr(f"train: skipping {skipped} prompts longer than {max_prompt} tokens")
    if not held_records:
        if args.held_out >= len(train_ids):
            raise TreeserveError(f"--held-out {args.held_out} leaves no training prompts out of {len(train_ids)}")
        cut = len(train_ids) - args.held_out
        train_ids, held_ids = train_ids[:cut], train_ids[cut:]
    return train_ids, held_ids[:args.held_out]


def prepare_data(args, target, block_size: int, records: list[dict], held_records: list[dict]):
    """(training, held-out) samples: the target's responses, regenerated into OUT or read back from there."""
    model, tokenizer = target.model, target.tokenizer
    train_ids, held_ids = split_prompts(args, tokenizer, records, held_records,
                                        model.config.max_context - args.max_new_tokens)
    generation = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      concurrency=args.gen_batch, seed=args.seed)
    responses = args.responses or args.out / DATA_NAME
    if args.eval_data:
        data = load_or_regenerate(responses, model, tokenizer, train_ids, **generation)
        held_out = load_or_regenerate(args.out / EVAL_DATA_NAME, model, tokenizer, held_ids, **generation)
    else:
        both = load_or_regenerate(responses, model, tokenizer, train_ids + held_ids, **generation)
        data, held_out = both[:len(train_ids)], both[len(train_ids):]
    data = [s for s in data if usable(s, block_size)]
    if not data:
        raise TreeserveError(f"no response is longer than the block size {block_size}; raise --max-new-tokens")
    return data, [s for s in held_out if usable(s, block_size)]


def starting_drafter(args, cfg: DFlashConfig, target: DecoderLM) -> DFlashModel:
    """The drafter to train: --init-from's weights (float32), or a new one."""
    if args.init_from is None:
        return new_drafter(cfg, args.seed, target if args.init_from_target else None).to(target.device)
    model = load_dflash(args.init_from, target.device, torch.float32, target.config.num_layers)
    have, want = model.config.to_json(), cfg.to_json()
    if have != want:
        differ = ", ".join(f"{k} {have.get(k)} (flags: {want.get(k)})" for k in want if have.get(k) != want.get(k))
        raise TreeserveError(f"--init-from {args.init_from} is another drafter than the flags ask for: {differ}")
    return model.train().requires_grad_(True)


def run(args) -> int:
    """`treeserve train-drafter`: regenerate (or reuse) the data, build or resume the drafter, train, save."""
    settings = settings_from_args(args)
    layer_ids = parse_layer_ids(args.target_layer_ids)
    records = read_prompts(args.data)[:args.limit]  # a bad prompts file fails before the target loads
    held_records = read_prompts(args.eval_data) if args.eval_data else []
    from treeserve.loading import load_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    mask_id = choose_mask_token(target.model, target.tokenizer)
    cfg = drafter_config(target.model.config, mask_id, args.layers, args.block_size, layer_ids, args.target_layers,
                         args.intermediate_size)
    data, held_out = prepare_data(args, target, cfg.block_size, records, held_records)
    if args.regenerate_only:
        log_stderr(f"train: {len(data)} training and {len(held_out)} held-out responses ready; not training")
        return 0
    model = starting_drafter(args, cfg, target.model)
    log_stderr(f"train: drafter {cfg.layers.num_layers} layer(s), block {cfg.block_size}, target layers "
               f"{list(cfg.target_layer_ids)}, mask id {mask_id}, {len(data)} training / {len(held_out)} held-out "
               f"sequences, device {device}")
    summary = train(model, target.model, data, held_out, args.out, settings)
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"command": shlex.join(["treeserve", "train-drafter", *args.argv]), "arguments": arguments,
              "drafter": cfg.to_json(), "data": data_stats(data), "held_out_data": data_stats(held_out), **summary}
    if args.init_from is not None and (args.init_from / SUMMARY_NAME).is_file():  # all the drafter went through
        record["started_from"] = json.loads((args.init_from / SUMMARY_NAME).read_text())
    (args.out / SUMMARY_NAME).write_text(json.dumps(record, indent=2) + "\n")
    log_stderr(f"train: saved the drafter to {args.out}")
    return 0
