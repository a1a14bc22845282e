"""A Hugging Face model folder: config.json, model.safetensors (or a sharded index) and tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import safetensors
import tokenizers
import torch

from treeserve.errors import TreeserveError
from treeserve.loading.weights import build_model
from treeserve.models import DecoderLM, ModelConfig, RopeScaling
from treeserve.parallel import Shard
from treeserve.tokenizer import Tokenizer

# model_type in config.json -> our family
HF_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TreeserveError(f"{path}: cannot read JSON ({error})") from None


def _rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(raw["factor"]), float(raw["low_freq_factor"]),
                           float(raw["high_freq_factor"]), int(raw["original_max_position_embeddings"]))
    raise TreeserveError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")


def config_from_hf(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in HF_FAMILIES:
        raise TreeserveError(f"unsupported architecture {model_type!r} in config.json; "
                             f"supported model_type values: {', '.join(sorted(HF_FAMILIES))}")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers 5 keeps rope settings in rope_parameters; older configs use rope_theta / rope_scaling.
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        max_context = int(raw.get("max_position_embeddings", 4096))
        if raw.get("sliding_window") and raw.get("use_sliding_window", model_type == "mistral"):
            # Beyond the window the model attends differently; cap the context so output stays exact.
            max_context = min(max_context, int(raw["sliding_window"]))
        return ModelConfig(
            family=HF_FAMILIES[model_type],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_context=max_context,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(rope if rope.get("rope_type") else raw.get("rope_scaling")),
        )
    except KeyError as error:
        raise TreeserveError(f"config.json lacks {error.args[0]!r}") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(folder: Path, model_raw: dict) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TreeserveError(f"{folder}: no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises its own exception type
        raise TreeserveError(f"{path}: cannot load tokenizer ({error})") from None
    config_path = folder / "tokenizer_config.json"
    tok_config = read_json(config_path) if config_path.is_file() else {}
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    eos_ids: set[int] = set()
    for source in (model_raw, generation):
        value = source.get("eos_token_id")
        eos_ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    eos_token = _token_text(tok_config.get("eos_token"))
    if eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids.add(backend.token_to_id(eos_token))
    template = tok_config.get("chat_template")
    template_path = folder / "chat_template.jinja"
    if template is None and template_path.is_file():
        template = template_path.read_text()
    return Tokenizer(backend, frozenset(eos_ids), _token_text(tok_config.get("bos_token")), eos_token,
                     template if isinstance(template, str) else None)


def weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise TreeserveError(f"{folder}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return [folder / s for s in shards]
    raise TreeserveError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_hf_folder(folder: Path, dtype: torch.dtype, device, shard: Shard | None = None
                   ) -> tuple[DecoderLM, Tokenizer]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise TreeserveError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    raw = read_json(config_path)
    cfg = config_from_hf(raw)
    cfg.validate()
    tokenizer = load_hf_tokenizer(folder, raw)
    try:
        names, read = safetensors_reader(folder)
        model = build_model(cfg, names, read, str(folder), dtype, device, shard)
    except (safetensors.SafetensorError, OSError) as error:
        raise TreeserveError(f"{folder}: cannot read weights, the file is truncated or corrupt ({error})") from None
    return model, tokenizer


def safetensors_reader(folder: Path) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """The tensor names in the folder's model.safetensors (or its shards), and a reader of one tensor by name.
    Reading raises safetensors.SafetensorError or OSError for a truncated or corrupt file."""
    location: dict[str, Path] = {}
    handles = {}
    for path in weight_files(folder):
        handles[path] = safetensors.safe_open(str(path), framework="pt")
        for name in handles[path].keys():
            location[name] = path
    return set(location), lambda name: handles[location[name]].get_tensor(name)
