"""Tiny random models of every supported family, written as a Hugging Face folder and as a GGUF file.

The transformers model built by `make_hf_model(case, seed)` is the reference; `write_hf_folder` and `write_gguf`
store the very same weights the way `save_pretrained` and llama.cpp's convert_hf_to_gguf.py do, so a loader
that reads either one back must reproduce the reference logits.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
TOKENIZER_VOCAB = 360  # what the BPE trainer aims for: 256 bytes, 3 specials and ~100 merges
MODEL_VOCAB = 384  # larger than the tokenizer, as in real checkpoints: GGUF pads the rest with [PADn] tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The llama3 case uses a small rope_theta and original context, so that at the short positions the tests use
# all three regimes of llama3 scaling (kept, interpolated, divided by factor) change the rotation angles.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_config(case: str):
    """A transformers config: hidden 64, 2 layers, 4 query heads over 2 key/value heads (GQA)."""
    common = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if case == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=False)
    if case == "llama3":
        return LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    if case == "mistral":
        # A sliding window longer than any test sequence: the loader caps max_context to it.
        return MistralConfig(**common, head_dim=16, sliding_window=128, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if case == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if case == "qwen3":
        # head_dim 32 while hidden / heads is 16: q/k/v are wider than the hidden size.
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(f"unknown case {case!r}")


@torch.no_grad()
def make_hf_model(case: str, seed: int):
    """The reference model, randomly initialised with weights large enough that logits are far from uniform."""
    model = AutoModelForCausalLM.from_config(hf_config(case), attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=generator)

    for name, param in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if name.endswith("norm.weight"):
            # Non-trivial norms: a loader that drops or mixes them up changes the output.
            param.copy_(0.5 + torch.rand(param.shape, generator=generator))
        elif name.endswith(".bias"):
            param.copy_(0.5 * randn(param.shape))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(randn(param.shape))
        else:
            # Twice the variance-preserving scale: attention is peaked but not one-hot, logits spread widely.
            param.copy_(2.0 / math.sqrt(param.shape[1]) * randn(param.shape))
    return model.eval()


# ---------------------------------------------------------------------------------------------- tokenizer


def _corpus() -> list[str]:
    """A few hundred varied lines: prose, code, numbers, unicode and odd whitespace."""
    rng = random.Random(1234)
    words = ("the quick brown fox jumps over lazy dog tree token draft model verify accept reject "
             "speculative decoding is lossless when every sampled token follows the target distribution").split()
    unicode_words = ["café", "naïve", "über", "Straße", "日本語", "中文", "привет", "🙂", "👍🏽", "—", "…", "ñandú"]
    code = ["def f(x):\n    return x * 2\n", "for i in range(10):\n\tprint(i)\n", "if (a != b) { return -1; }",
            "x = {'key': [1, 2, 3]}", "import torch  # comment", "    indented    line\n\n"]
    lines = []
    for _ in range(300):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + ".")
        elif kind == 1:
            lines.append(rng.choice(code))
        elif kind == 2:
            lines.append(f"{rng.randint(0, 10**6)} + {rng.random():.4f} = ? ({rng.choice(words)}'s {rng.choice(words)})")
        else:
            lines.append(" ".join(rng.choice(unicode_words + words) for _ in range(rng.randint(2, 6))))
    return lines


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE shaped like SmolLM2's (digits split one by one, then GPT-2 byte-level), trained once."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    assert tokenizer.get_vocab_size() <= MODEL_VOCAB
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tokenizer.to_str()


def write_tokenizer_files(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE}))


def _gguf_vocab() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges as convert_hf_to_gguf.py writes a byte-level BPE vocabulary."""
    spec = json.loads(tokenizer_json())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    special = {added["id"] for added in spec["added_tokens"] if added["special"]}
    tokens, types = [], []
    for i in range(MODEL_VOCAB):
        if i not in by_id:  # the model's rows beyond the tokenizer
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


# ---------------------------------------------------------------------------------------------- writers


def write_hf_folder(case: str, folder: Path, seed: int) -> Path:
    folder = Path(folder)
    make_hf_model(case, seed).save_pretrained(folder)  # safetensors, tied LM head left out
    write_tokenizer_files(folder)
    return folder


GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

def gguf_names(arch: str, num_layers: int):
    """HF name -> GGUF name, from gguf-py's table (the one convert_hf_to_gguf.py renames with), not from ours."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    return lambda hf_name: table.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of every head's rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """The per-frequency divisors convert_hf_to_gguf.py stores as rope_freqs.weight for llama3 scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelen = old_context / rope["low_freq_factor"]
    high_wavelen = old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def quantizable(value: np.ndarray) -> bool:
    """Which tensors a quantized GGUF stores in blocks: the 2-D ones (llama.cpp keeps norms and biases F32)."""
    return value.ndim == 2


def round_trip(value: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a reader recovers from `value` stored as `qtype`."""
    return gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)


def round_trip_model(model, qtype: gguf.GGMLQuantizationType):
    """The reference for a quantized GGUF: the same model with each quantized weight replaced by what it reads as.

    Blocks run along rows and llama.cpp's q/k permutation only reorders rows, so quantizing before or after the
    permutation gives the same values.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = param.numpy()
            if quantizable(value):
                param.copy_(torch.from_numpy(round_trip(value, qtype)))
    return model


def write_gguf(case: str, path: Path, seed: int, qtype: gguf.GGMLQuantizationType | None = None,
               arch: str | None = None) -> Path:
    """The weights of make_hf_model(case, seed) laid out as llama.cpp's converter does; 2-D weights stored as
    `qtype` when given (else F32). `arch` overrides general.architecture (for error tests)."""
    path = Path(path)
    model = make_hf_model(case, seed)
    cfg = model.config
    arch = arch or GGUF_ARCH[case]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{case}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if case == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype is None else gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])

    tokens, types, merges = _gguf_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    if case == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, cfg.rope_parameters))
    gguf_name = gguf_names(arch if arch in GGUF_ARCH.values() else "llama", cfg.num_hidden_layers)
    for name, param in model.named_parameters():  # tied LM head listed once: no output.weight, as llama.cpp
        value = param.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, cfg.num_key_value_heads)
        if qtype is not None and quantizable(value):
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
