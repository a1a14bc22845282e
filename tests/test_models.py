"""The target models and their loaders, checked against transformers as an independent reference.

Tiny random models of every family are written as an HF folder and as a GGUF file (tiny_models.py); what
load_target reads back must give transformers' logits. Tree forwards and KV cache compaction are checked against
plain causal forwards. The real SmolLM2 GGUF is checked against transformers' own GGUF reader (real_model).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import random
import shutil

import gguf
import pytest
import safetensors.torch
import tokenizers
import torch

import tiny_models
from tiny_models import FAMILIES
from treeserve.errors import TreeserveError
from treeserve.loading import load_target
from treeserve.loading.weights import checkpoint_state
from treeserve.models import KVCache, TreeAttention
from treeserve.tree import DraftTree

SEED = 0
FORMATS = ["hf", "gguf"]


# ---------------------------------------------------------------------------------------------- helpers


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def new_cache(model, capacity: int = 64) -> KVCache:
    return KVCache(model.config, capacity, model.dtype, "cpu")


def forward(model, cache: KVCache, tokens, mask=None, positions=None, hidden_layer_ids=()):
    """One forward of `tokens` after what `cache` holds: causal unless `mask` is given, positions following on."""
    tokens = torch.as_tensor(tokens)
    n = len(tokens)
    mask = causal_mask(n) if mask is None else mask
    positions = cache.length + torch.arange(n) if positions is None else positions
    return model(tokens, positions, TreeAttention(cache, mask), hidden_layer_ids=hidden_layer_ids)


def fresh_logits(model, tokens, hidden_layer_ids=()):
    """Logits (and hidden states) of a causal forward over `tokens` from an empty cache."""
    return forward(model, new_cache(model), tokens, hidden_layer_ids=hidden_layer_ids)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4, what: str = "logits"):
    """Float32 agreement: the largest difference is small next to the largest value (logits reach ~30 here)."""
    tolerance = rel * max(1.0, expected.abs().max().item())
    difference = (actual.float() - expected.float()).abs().max().item()
    assert difference <= tolerance, f"{what}: max |difference| {difference:.3g} > {tolerance:.3g}"


def random_tokens(n: int, seed: int, vocab: int = tiny_models.MODEL_VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def random_tree(size: int, seed: int) -> DraftTree:
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return DraftTree(random_tokens(size, seed + 1), parents)


def root_path(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root down to `node` (ascending, since parents precede children)."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@torch.no_grad()
def reference_logits(reference, tokens) -> torch.Tensor:
    return reference(torch.tensor([tokens])).logits[0]


# ---------------------------------------------------------------------------------------------- fixtures


pytestmark = pytest.mark.usefixtures("one_thread")  # every forward here is small, the real model's too


@pytest.fixture(scope="module")
def reference():
    """case -> the transformers model the tiny files were written from."""
    return functools.cache(lambda case: tiny_models.make_hf_model(case, SEED))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(case, format) -> path of the tiny model written in that format, written once per module."""

    @functools.cache
    def write(case: str, fmt: str):
        folder = tmp_path_factory.mktemp(f"{case}-{fmt}")
        if fmt == "hf":
            return tiny_models.write_hf_folder(case, folder / "model", SEED)
        return tiny_models.write_gguf(case, folder / "model.gguf", SEED)

    return write


@pytest.fixture(scope="module")
def loaded(written):
    """(case, format) -> load_target of that file, loaded once per module."""
    return functools.cache(lambda case, fmt: load_target(str(written(case, fmt))))


# ---------------------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", FAMILIES)
def test_logits_match_transformers(case, fmt, loaded, reference):
    tokens = random_tokens(24, seed=1)
    logits, _ = fresh_logits(loaded(case, fmt).model, tokens)
    assert_close(logits, reference_logits(reference(case), tokens))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", FAMILIES)
def test_config_matches_transformers(case, fmt, loaded, reference):
    model = loaded(case, fmt).model
    ours, theirs = model.config, reference(case).config
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads,
            ours.num_kv_heads, ours.head_dim) == (theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size,
                                                  theirs.num_hidden_layers, theirs.num_attention_heads,
                                                  theirs.num_key_value_heads, head_dim)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # GGUF stores it as float32
    assert ours.rope_theta == pytest.approx(theirs.rope_parameters["rope_theta"])
    # A tied head is the embedding itself (HF leaves lm_head out of the file, GGUF leaves out output.weight).
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == theirs.tie_word_embeddings
    # Mistral's sliding window caps the context of an HF folder; llama.cpp's llama arch has no such key.
    capped = case == "mistral" and fmt == "hf"
    assert ours.max_context == (theirs.sliding_window if capped else theirs.max_position_embeddings)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", FAMILIES)
def test_rope_frequencies_match_transformers(case, fmt, loaded, reference):
    """Also checked apart from the logits, where a slightly wrong low frequency hardly shows at short positions
    (llama3 scaling: rope_parameters in the HF config, precomputed rope_freqs.weight factors in the GGUF)."""
    ours = loaded(case, fmt).model.rope_inv_freq
    rotary = reference(case).model.rotary_emb
    assert rotary.attention_scaling == 1.0
    torch.testing.assert_close(ours, rotary.inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", FAMILIES)
def test_hidden_states_match_transformers(case, loaded, reference):
    model = loaded(case, "gguf").model
    layers = list(range(model.config.num_layers))
    tokens = random_tokens(16, seed=2)
    logits, hidden = fresh_logits(model, tokens, hidden_layer_ids=layers)
    with torch.no_grad():
        expected = reference(case)(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    # transformers: hidden_states[0] is the embedding, [i + 1] the output of layer i, except that the last one
    # has the final norm applied; DFlash reads layer i as hidden_states[i + 1], so ours must be the same.
    for layer in layers:
        assert_close(hidden[layer], expected[layer + 1][0], what=f"hidden state of layer {layer}")
    assert torch.equal(logits, fresh_logits(model, tokens)[0])  # asking for features leaves the logits alone


def test_transformers4_style_config(written, reference, tmp_path):
    """Checkpoints saved before transformers 5 keep rope_theta and rope_scaling (with "type" in the oldest
    ones) at the top level of config.json instead of rope_parameters."""
    folder = tmp_path / "model"
    shutil.copytree(written("llama3", "hf"), folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    tokens = random_tokens(24, seed=1)
    logits, _ = fresh_logits(load_target(str(folder)).model, tokens)
    assert_close(logits, reference_logits(reference("llama3"), tokens))


def test_sharded_safetensors(reference, tmp_path):
    folder = tmp_path / "model"
    reference("qwen2").save_pretrained(folder, max_shard_size="100KB")
    tiny_models.write_tokenizer_files(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").exists()
    tokens = random_tokens(24, seed=1)
    logits, _ = fresh_logits(load_target(str(folder)).model, tokens)
    assert_close(logits, reference_logits(reference("qwen2"), tokens))


# ---------------------------------------------------------------------------------------------- trees and cache


@pytest.mark.parametrize("case", FAMILIES)
def test_tree_forward_equals_sequential_forward(case, loaded):
    model = loaded(case, "hf").model
    prefix = random_tokens(7, seed=3)
    tree = random_tree(14, seed=4)  # node 0 is the root: the last committed token, not yet in the cache

    cache = new_cache(model)
    forward(model, cache, prefix)
    cache.keep(list(range(len(prefix))))
    positions = cache.length + torch.tensor(tree.depths())
    logits, hidden = forward(model, cache, tree.tokens, mask=tree.ancestor_mask(), positions=positions,
                             hidden_layer_ids=(0,))

    assert max(tree.depths()) >= 3 and len(tree.children()[0]) >= 2  # a real tree: deep and branching
    for node in range(tree.size):
        path = prefix + [tree.tokens[i] for i in root_path(tree, node)]
        expected, expected_hidden = fresh_logits(model, path, hidden_layer_ids=(0,))
        assert_close(logits[node], expected[-1], what=f"logits at node {node}")
        assert_close(hidden[0][node], expected_hidden[0][-1], what=f"hidden state at node {node}")


@pytest.mark.parametrize("accepted", ["branch", "first-rows"])
@pytest.mark.parametrize("case", FAMILIES)
def test_keep_then_chain_equals_fresh_forward(case, accepted, loaded):
    """After a tree forward, keep(accepted path) must leave the cache as if only that path had been run."""
    model = loaded(case, "gguf").model
    prefix = random_tokens(5, seed=5)
    tree = random_tree(12, seed=6)
    paths = [root_path(tree, node) for node in range(tree.size)]
    if accepted == "branch":  # rows that must move down in the cache
        rows = max((p for p in paths if p != list(range(len(p)))), key=len)
    else:  # rows already in place: nothing to move
        rows = max((p for p in paths if p == list(range(len(p)))), key=len)
    assert len(rows) >= 2

    cache = new_cache(model)
    forward(model, cache, prefix)
    cache.keep(list(range(len(prefix))))
    forward(model, cache, tree.tokens, mask=tree.ancestor_mask(),
            positions=cache.length + torch.tensor(tree.depths()))
    cache.keep(rows)
    assert cache.length == len(prefix) + len(rows)
    continuation = random_tokens(4, seed=7)
    logits, _ = forward(model, cache, continuation)

    full = prefix + [tree.tokens[i] for i in rows] + continuation
    expected, _ = fresh_logits(model, full)
    assert_close(logits, expected[-len(continuation):])


def test_a_forward_beyond_the_cache_capacity_is_refused(loaded):
    model = loaded("llama", "hf").model
    cache = new_cache(model, capacity=8)
    forward(model, cache, random_tokens(6, seed=10))
    cache.keep(list(range(6)))
    with pytest.raises(TreeserveError, match="KV cache full"):
        forward(model, cache, random_tokens(3, seed=11))


# ---------------------------------------------------------------------------------------------- quantized and bf16


@pytest.mark.parametrize("case, qtype", [
    pytest.param("llama", gguf.GGMLQuantizationType.Q8_0, id="llama-Q8_0"),  # llama: q/k rows permuted too
    pytest.param("qwen3", gguf.GGMLQuantizationType.Q4_1, id="qwen3-Q4_1"),  # the real model's type
])
def test_quantized_gguf_matches_transformers_on_dequantized_weights(case, qtype, tmp_path):
    path = tiny_models.write_gguf(case, tmp_path / "model.gguf", SEED, qtype=qtype)
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors} == {qtype, gguf.GGMLQuantizationType.F32}
    model = load_target(str(path)).model
    exact = tiny_models.make_hf_model(case, SEED)
    rounded = tiny_models.round_trip_model(tiny_models.make_hf_model(case, SEED), qtype)
    # Not vacuous: quantization really moved the weights.
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exact.get_parameter(name), rounded.get_parameter(name))
    torch.testing.assert_close(checkpoint_state(model)[name], rounded.get_parameter(name), rtol=0, atol=0)

    tokens = random_tokens(20, seed=8)
    logits, _ = fresh_logits(model, tokens)
    assert_close(logits, reference_logits(rounded, tokens))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_bfloat16_is_close_to_float32(case, fmt, written, loaded):
    model32 = loaded(case, fmt).model
    model16 = load_target(str(written(case, fmt)), dtype="bfloat16").model
    assert model16.dtype == torch.bfloat16 and model16.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    tokens = random_tokens(24, seed=9)
    logits32, _ = fresh_logits(model32, tokens)
    logits16, _ = fresh_logits(model16, tokens)
    assert logits16.dtype == torch.bfloat16  # logits come back in the weights' dtype
    assert_close(logits16.float(), logits32, rel=0.1)  # bf16 keeps ~3 significant digits, through 2 layers
    agree = (logits16.argmax(-1) == logits32.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"bf16 and fp32 pick the same top token at only {agree:.0%} of positions"


# ---------------------------------------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # double\n",
    "for i in range(10):\n\tprint(i)\n",
    "1234567890 and 3.14159, 2024-01-01",
    "naïve café — Straße, 日本語 and привет 🙂👍🏽",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines",
    "it's, they're, we've, I'm, you'll, he'd",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "",
]


@pytest.fixture(scope="module")
def reference_tokenizer():
    return tokenizers.Tokenizer.from_str(tiny_models.tokenizer_json())


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_tokenizer_json(text, loaded, reference_tokenizer):
    expected = reference_tokenizer.encode(text).ids
    for fmt in FORMATS:
        tokenizer = loaded("llama", fmt).tokenizer
        ids = tokenizer.encode(text)
        assert ids == expected, fmt
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_stop_ids(loaded):
    for fmt in FORMATS:
        tokenizer = loaded("qwen2", fmt).tokenizer
        assert tokenizer.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
        assert tokenizer.decode([1] + tokenizer.encode("hi") + [2]) == "hi"  # specials skipped by default
        assert tokenizer.eos_ids == {tiny_models.EOS_ID}
        assert tokenizer.eos_token == "<|im_end|>"
        assert tokenizer.vocab_size <= tiny_models.MODEL_VOCAB


@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_template_renders(fmt, loaded):
    tokenizer = loaded("qwen3", fmt).tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tokenizer.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode_chat("Hi!")
    reply_header = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 1 and ids[-len(reply_header):] == reply_header


def test_the_chat_template_is_compiled_once_and_the_tokenizer_still_pickles(loaded):
    tokenizer = loaded("qwen3", "hf").tokenizer
    ids = tokenizer.encode_chat("Hi!")
    compiled = tokenizer.__dict__["_chat"]  # kept after the first render...
    assert tokenizer.encode_chat("Hi!") == ids and tokenizer.__dict__["_chat"] is compiled  # ...and used again
    again = pickle.loads(pickle.dumps(tokenizer))  # without the compiled template, which is made anew
    assert "_chat" not in again.__dict__ and again.encode_chat("Hi!") == ids
    with pytest.raises(dataclasses.FrozenInstanceError):  # so the compiled template cannot outlive its source
        tokenizer.chat_template = "{{ messages }}"


def test_a_broken_chat_template_is_a_clear_error(loaded):
    tokenizer = loaded("qwen3", "hf").tokenizer
    broken = dataclasses.replace(tokenizer, chat_template="{% for m in messages %}{{ m.content }}")  # no endfor
    refusing = dataclasses.replace(tokenizer, chat_template="{{ raise_exception('system turns only') }}")
    for bad, message in ((broken, "could not be rendered"), (refusing, "system turns only")):
        for _ in range(2):  # not only the first render: the template is compiled once and kept
            with pytest.raises(TreeserveError, match=message):
                bad.render_chat([{"role": "user", "content": "Hi"}])


# ---------------------------------------------------------------------------------------------- loader errors


def copy_hf(written, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(written("llama", "hf"), folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder, change):
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    safetensors.torch.save_file(tensors, str(path))


def truncate(path, keep_fraction: float):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep_fraction)])


def missing_path(written, tmp_path):
    return tmp_path / "no-such-model"


def folder_without_config(written, tmp_path):
    folder = copy_hf(written, tmp_path)
    (folder / "config.json").unlink()
    return folder


def unknown_hf_architecture(written, tmp_path):
    folder = copy_hf(written, tmp_path)
    edit_config(folder, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    return folder


def unknown_gguf_architecture(written, tmp_path):
    return tiny_models.write_gguf("llama", tmp_path / "gpt2.gguf", SEED, arch="gpt2")


def missing_tensor(written, tmp_path):
    folder = copy_hf(written, tmp_path)
    edit_weights(folder, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    return folder


def misshaped_tensor(written, tmp_path):
    folder = copy_hf(written, tmp_path)
    edit_weights(folder, lambda tensors: tensors.update({
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    return folder


def truncated_safetensors(written, tmp_path):
    folder = copy_hf(written, tmp_path)
    truncate(folder / "model.safetensors", 0.5)
    return folder


def truncated_gguf_data(written, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(written("llama", "gguf"), path)
    truncate(path, 0.5)  # cut in the tensor data
    return path


def truncated_gguf_header(written, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(written("llama", "gguf"), path)
    truncate(path, 0.01)  # cut inside the metadata
    return path


@pytest.mark.parametrize("make_target, messages", [pytest.param(make, messages, id=make.__name__) for make, messages in [
    (missing_path, ["not found", "no-such-model"]),
    (folder_without_config, ["no config.json"]),
    (unknown_hf_architecture, ["unsupported architecture", "gpt_neox"]),
    (unknown_gguf_architecture, ["unsupported architecture", "gpt2"]),
    (missing_tensor, ["missing tensors", "model.layers.1.mlp.up_proj.weight"]),
    (misshaped_tensor, ["model.layers.0.self_attn.k_proj.weight", "(48, 64)", "(32, 64)"]),
    (truncated_safetensors, ["truncated or corrupt"]),
    (truncated_gguf_data, ["truncated or corrupt", "cut.gguf"]),
    (truncated_gguf_header, ["truncated or corrupt", "cut.gguf"]),
]])
def test_loader_errors_name_the_problem(make_target, messages, written, tmp_path):
    target = make_target(written, tmp_path)
    with pytest.raises(TreeserveError) as error:
        load_target(str(target))
    for message in messages:
        assert message in str(error.value)


# ---------------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2_path():
    from treeserve.loading import embedded_path

    return str(embedded_path("smollm2-135m"))


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_path):
    """SmolLM2 as transformers reads the GGUF: its own metadata reader, its own torch dequantizer (not the gguf
    library that treeserve uses), its llama.cpp -> config key map and its q/k un-permutation.

    `from_pretrained(gguf_file=...)` would do the same but needs accelerate (not a test dependency) and, on its
    legacy llama path, takes ~40 s here; these are the pieces it is built from.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict, read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    metadata, names = read_gguf_metadata(smollm2_path)
    assert metadata["general.architecture"] == "llama"
    config = LlamaConfig(**{hf: metadata[f"llama.{key}"] for key, hf in GGUF_CONFIG_MAPPING["llama"].items()
                            if f"llama.{key}" in metadata},
                         tie_word_embeddings="output.weight" not in names)
    with torch.device("meta"):  # skip random initialisation of 135M parameters
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)

    header = GgufHeader.from_file(smollm2_path)
    raw = load_gguf_state_dict(header)
    unpermute = LlamaTensorProcessor(config.to_dict())
    gguf_name = tiny_models.gguf_names("llama", config.num_hidden_layers)
    state = {}
    for name, param in model.named_parameters():
        file_name = gguf_name(name)
        info = next(t for t in header.tensors if t.name == file_name)
        data = raw[file_name][...]
        if info.ggml_type in GGML_BLOCK:
            data = dequantize(data.reshape(-1), info.ggml_type).reshape(info.shape)
        data = unpermute.process(data.float(), file_name).weights
        assert tuple(data.shape) == tuple(param.shape), name
        state[name] = data
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were left on meta
    return model.eval()


@pytest.mark.real_model
def test_real_model_logits_match_transformers(smollm2, transformers_smollm2):
    tokens = smollm2.tokenizer.encode_chat("What is the capital of France? Answer in one word.")
    logits, _ = fresh_logits(smollm2.model, tokens)
    with torch.no_grad():
        expected = transformers_smollm2(torch.tensor([tokens])).logits[0]
    assert_close(logits, expected)  # float32 agreement through all 30 layers (seen: ~2e-6 of the logit scale)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.real_model
def test_real_model_tokenizer_matches_transformers(smollm2, smollm2_path):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(smollm2_path)
    expected, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in TEXTS + ["x = [i ** 2 for i in range(100)]  # squares", "  Indented\r\nWindows line"]:
        ids = smollm2.tokenizer.encode(text)
        assert ids == expected.encode(text).ids, text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.real_model
def test_real_model_known_properties(smollm2):
    cfg = smollm2.model.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    tokenizer = smollm2.tokenizer
    assert tokenizer.encode("<|im_end|>") == [2] and 2 in tokenizer.eos_ids
    assert tokenizer.render_chat([{"role": "user", "content": "Hi"}]).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
