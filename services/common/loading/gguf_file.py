"""One GGUF file: weights dequantized at load with the `gguf` library, tokenizer rebuilt from its metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from treeserve.errors import TreeserveError
from treeserve.loading.gguf_header import read_header
from treeserve.loading.weights import build_model
from treeserve.models import DecoderLM, ModelConfig, RopeScaling
from treeserve.parallel import Shard
from treeserve.tokenizer import Tokenizer

GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Split patterns of the byte-level BPE pre-tokenizers that GGUF names in tokenizer.ggml.pre.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([_split(LLAMA3_SPLIT), no_regex])
    if pre in ("qwen2", "qwen35"):
        return pre_tokenizers.Sequence([_split(QWEN2_SPLIT), no_regex])
    raise TreeserveError(f"GGUF tokenizer: pre-tokenizer {pre!r} is not supported "
                         "(supported: gpt2, smollm, starcoder, llama-bpe, qwen2)")


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1


class GGUFFile:
    def __init__(self, path: Path):
        self.path = path
        self.metadata, self.tensors, self.file = read_header(path)
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise TreeserveError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        # Rows of raw bytes, the layout gguf's dequantize expects for every type.
        raw = self.file[info.offset:info.offset + info.nbytes].reshape(-1, info.nbytes // max(1, _rows(info.shape)))
        try:
            values = gguf.quants.dequantize(raw, info.kind)
        except NotImplementedError:
            raise TreeserveError(f"{self.path}: tensor {name} uses quantization {info.kind.name}, "
                                 "which the gguf library cannot dequantize") from None
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))

    def config(self) -> ModelConfig:
        if self.arch not in GGUF_FAMILIES:
            raise TreeserveError(f"{self.path}: unsupported architecture {self.arch!r}; "
                                 f"supported: {', '.join(GGUF_FAMILIES)}")
        a = self.arch
        heads = int(self.require(f"{a}.attention.head_count"))
        hidden = int(self.require(f"{a}.embedding_length"))
        head_dim = int(self.get(f"{a}.attention.key_length", hidden // heads))
        rotary = int(self.get(f"{a}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise TreeserveError(f"{self.path}: partial rotary embeddings ({rotary} of {head_dim}) are not supported")
        vocab = self.get(f"{a}.vocab_size") or len(self.require("tokenizer.ggml.tokens"))
        scaling_kind = self.get(f"{a}.rope.scaling.type", "none")
        scaling = None
        if scaling_kind == "linear":
            scaling = RopeScaling("linear", float(self.require(f"{a}.rope.scaling.factor")))
        elif scaling_kind != "none":
            raise TreeserveError(f"{self.path}: rope scaling {scaling_kind!r} is not supported")
        freq_factors = None
        if "rope_freqs.weight" in self.tensors:  # llama3 scaling, precomputed per frequency by the converter
            freq_factors = tuple(float(f) for f in self.tensor("rope_freqs.weight").flatten())
        return ModelConfig(
            family=GGUF_FAMILIES[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.require(f"{a}.feed_forward_length")),
            num_layers=int(self.require(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.require(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
            max_context=int(self.require(f"{a}.context_length")),
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_scaling=scaling,
            rope_freq_factors=freq_factors,
        )

    def hf_names(self) -> dict[str, str]:
        """HF parameter name -> GGUF tensor name, for every tensor this file has."""
        names = {}
        for gguf_name in self.tensors:
            if gguf_name in GLOBAL_TENSORS:
                names[GLOBAL_TENSORS[gguf_name]] = gguf_name
            elif gguf_name.startswith("blk."):
                _, layer, rest = gguf_name.split(".", 2)
                if rest in LAYER_TENSORS:
                    names[f"model.layers.{layer}.{LAYER_TENSORS[rest]}"] = gguf_name
        return names

    def _byte_level_bpe(self, tokens: list[str]) -> tokenizers.Tokenizer:
        merges = [tuple(m.split(" ", 1)) for m in self.require("tokenizer.ggml.merges")]
        pre = self.get("tokenizer.ggml.pre", "default")
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                         ignore_merges=pre in ("llama-bpe", "llama3"))
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        if pre in ("qwen2", "qwen35"):
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        return backend

    def _sentencepiece_bpe(self, tokens: list[str]) -> tokenizers.Tokenizer:
        """The SentencePiece BPE of Llama 2 / Mistral files, built as HF's fast Llama tokenizer (and llama.cpp)."""
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = self.get("tokenizer.ggml.merges")
        if merges is not None:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        else:  # SentencePiece keeps scores, not merges: every split of a piece into two pieces is a merge, ranked
            # by the merged piece's score, higher first (ties: longer left part first, as transformers does)
            scores = dict(zip(tokens, self.require("tokenizer.ggml.scores")))
            merges = sorted(((t[:i], t[i:]) for t in tokens for i in range(1, len(t))
                             if t[:i] in vocab and t[i:] in vocab),
                            key=lambda m: (scores[m[0] + m[1]], len(m[0]), len(m[1])), reverse=True)
        unk_id = self.get("tokenizer.ggml.unknown_token_id")
        # byte_fallback: a character with no piece becomes its UTF-8 bytes as <0xAB> tokens instead of <unk>
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                                  unk_token=tokens[unk_id] if unk_id is not None else None))
        # SentencePiece writes spaces as "▁" and, with add_space_prefix, starts every text (and every run
        # of text after a special token) with one; no pre-tokenizer: pieces may span words
        space_prefix = self.get("tokenizer.ggml.add_space_prefix", True)
        prefix = [normalizers.Prepend("▁")] if space_prefix else []
        backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        # decoding undoes it: "▁" back to spaces, <0xAB> tokens back to bytes, minus the prefix space
        strip = [decoders.Strip(" ", left=1)] if space_prefix else []
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             *strip])
        return backend

    def tokenizer(self) -> Tokenizer:
        kind = self.require("tokenizer.ggml.model")
        tokens = list(self.require("tokenizer.ggml.tokens"))
        types = list(self.get("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens))
        special_types = {gguf.TokenType.CONTROL}
        if kind == "gpt2":
            backend = self._byte_level_bpe(tokens)
        elif kind == "llama":
            backend = self._sentencepiece_bpe(tokens)
            special_types.add(gguf.TokenType.UNKNOWN)  # <unk> is special too, as in llama.cpp and HF's Llama
        else:
            raise TreeserveError(f"{self.path}: tokenizer model {kind!r} is not supported "
                                 "(supported: gpt2 byte-level BPE, llama SentencePiece BPE)")
        backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                            for t, kind_ in zip(tokens, types) if kind_ == gguf.TokenType.USER_DEFINED])
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                    for t, kind_ in zip(tokens, types) if kind_ in special_types])
        bos_id = self.get("tokenizer.ggml.bos_token_id")
        eos_id = self.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
        if bos is not None and self.get("tokenizer.ggml.add_bos_token", kind == "llama"):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        eos_ids = {int(eos_id)} if eos_id is not None else set()
        eot_id = self.get("tokenizer.ggml.eot_token_id")
        if eot_id is not None:
            eos_ids.add(int(eot_id))
        return Tokenizer(backend, frozenset(eos_ids), bos, tokens[eos_id] if eos_id is not None else None,
                         self.get("tokenizer.chat_template"))


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama q/k rows with rotary halves interleaved per head; restore the HF layout."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf(path: Path, dtype: torch.dtype, device, shard: Shard | None = None) -> tuple[DecoderLM, Tokenizer]:
    file = GGUFFile(path)
    cfg = file.config()
    cfg.validate()
    tokenizer = file.tokenizer()
    names = file.hf_names()

    def read(name: str) -> torch.Tensor:
        tensor = file.tensor(names[name])
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rope_rows(tensor, cfg.num_heads)
        elif cfg.family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rope_rows(tensor, cfg.num_kv_heads)
        return tensor

    try:
        return build_model(cfg, names, read, str(path), dtype, device, shard), tokenizer
    except (ValueError, IndexError) as error:  # tensor bytes that do not fit its shape (truncation is caught earlier)
        raise TreeserveError(f"{path}: tensor data is truncated or corrupt ({error})") from None
