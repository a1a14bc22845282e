"""The SentencePiece BPE tokenizer ("llama" tokenizer model: Llama 2, Mistral) rebuilt from GGUF metadata.

The reference is transformers' own GGUF tokenizer loader run on the same metadata. For a "llama" vocabulary it
has two shapes: the one it picks for architecture "phi3" is HF's legacy Llama tokenizer (a normalizer that
prepends "▁" to every run of text, as SentencePiece and llama.cpp do), which is what we build; the one it picks
for architecture "llama" (transformers 5's LlamaTokenizer, Metaspace with prepend_scheme="first") adds no "▁"
before text that already starts with a space or follows a special token. So each file is written under both
architectures, and the "llama" one is compared only where the two shapes agree.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import pytest

from treeserve.errors import TreeserveError
from treeserve.loading.gguf_file import GGUFFile

UNK, BOS, EOS = 0, 1, 2
WORDS = ["hello", "world", "the", "tokenizer", "token", "speculative", "decoding", "tree", "draft", "llama",
         "ing", "er", "is", "it", "a"]
TEXTS = [
    "hello world",
    "the tokenizer is speculative decoding",
    "helloworld tokenizers drafting llamas",  # words glued or extended: pieces, not whole words
    "xyz quip, brb!",  # characters with no piece: byte fallback
    "héllo 世界",  # é is a piece, 世界 falls back to its UTF-8 bytes
    "🦙 llama",  # a 4-byte character
    " hello",  # a leading space: SentencePiece still prepends its own "▁"
    "hello ",
    "  hello   world  ",
    " ",
    "",
    "a\nb\n\nc",
    "hello\tworld",
    "llama, a tree. 12!",
    "already▁spaced",  # "▁" in the text is taken as a space
    "<s>hi</s>there",  # control tokens in the text stay whole
    "hello</s>",
    "<unk> x",
]


def spm_vocab(seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """Llama-like: <unk> <s> </s>, the 256 byte tokens, then pieces with scores, then single characters.

    Every substring (2+ characters) of each word, with and without its "▁", is a piece, so each piece splits
    into two others and merges can be derived. Scores are small random integers: ties are frequent, which
    also checks the tie-breaking of the merge order.
    """
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = {}  # an ordered set
    for word in WORDS:
        for text in (word, "▁" + word):
            for i in range(len(text)):
                for j in range(i + 2, len(text) + 1):
                    pieces[text[i:j]] = None
    for piece in [*pieces, "▁▁", "▁▁▁", "▁▁▁▁"]:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(float(rng.randint(-200, 0)))
    for k, char in enumerate(sorted({c for w in WORDS for c in "▁" + w} | set(",.!'é12"))):
        tokens.append(char)  # single characters last, with the lowest scores, as in Llama's vocabulary
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 - k)
    return tokens, scores, types


def write_spm_gguf(path: Path, arch: str = "llama", merges: list[str] | None = None, model: str = "llama",
                   **flags) -> Path:
    """Only tokenizer metadata (and the architecture key GGUFWriter needs): no tensors."""
    tokens, scores, types = spm_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    if "add_bos" in flags:
        writer.add_add_bos_token(flags["add_bos"])
    if "space_prefix" in flags:
        writer.add_add_space_prefix(flags["space_prefix"])
    if merges is not None:
        writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def model_merges(backend) -> list[list[str]]:
    return json.loads(backend.to_str())["model"]["merges"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    write_spm_gguf(folder / "llama.gguf")
    write_spm_gguf(folder / "phi3.gguf", arch="phi3")
    return folder


@pytest.fixture(scope="module")
def ours(folder):
    return GGUFFile(folder / "llama.gguf").tokenizer()


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' legacy-Llama shape: normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer."""
    return transformers_tokenizer(folder / "phi3.gguf")


@pytest.fixture(scope="module")
def reference_metaspace(folder):
    """transformers 5's LlamaTokenizer shape: Metaspace(prepend_scheme="first")."""
    return transformers_tokenizer(folder / "llama.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(text, ours, reference):
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
    ids = ours.encode(text)
    assert ids[0] == BOS  # a "llama" file without add_bos_token: llama.cpp and transformers add BOS
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    if "<" not in text:  # no special tokens, which decoding skips: a round trip ("▁" reads as a space)
        assert ours.decode(ids) == text.replace("▁", " ")


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ") and "<" not in t])
def test_matches_transformers_metaspace_shape_where_it_agrees(text, ours, reference_metaspace):
    assert ours.encode(text) == reference_metaspace.encode(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<" not in t])
def test_pieces_spell_the_sentencepiece_normalized_text(text, ours):
    """Independent of transformers: the pieces (bytes decoded) spell "▁" + the text with spaces as "▁"
    (SentencePiece's add_dummy_prefix, and llama.cpp's; none for an empty text)."""
    pieces = [ours.backend.id_to_token(i) for i in ours.encode(text, add_special_tokens=False)]
    spelled = b"".join(bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.encode() for p in pieces)
    assert spelled.decode() == ("▁" + text.replace(" ", "▁") if text else "")


def test_hand_computed_ids(ours):
    vocab = ours.backend.get_vocab()
    assert ours.encode("hello world") == [BOS, vocab["▁hello"], vocab["▁world"]]
    assert ours.encode("a\nb", add_special_tokens=False) == [vocab["▁a"], vocab["<0x0A>"], vocab["<0x62>"]]
    assert ours.encode("世", add_special_tokens=False) == [vocab["▁"], vocab["<0xE4>"], vocab["<0xB8>"], vocab["<0x96>"]]
    assert ours.encode("</s>hello", add_special_tokens=False) == [EOS, vocab["▁hello"]]  # "▁" after a special
    assert ours.bos_token == "<s>" and ours.eos_token == "</s>" and ours.eos_ids == {EOS}


def test_derived_merges_equal_transformers(ours, reference):
    """Ranked by the merged piece's score, higher first, ties as transformers breaks them."""
    merges = model_merges(ours.backend)
    assert merges == model_merges(reference.backend_tokenizer)
    vocab = ours.backend.get_vocab()
    scores = dict(zip(*spm_vocab()[:2]))
    assert all(scores[a + b] >= scores[c + d] for (a, b), (c, d) in zip(merges, merges[1:]))
    assert ["▁hell", "o"] in merges and all(a in vocab and b in vocab for a, b in merges)


def test_merges_from_the_file_are_used(ours, tmp_path):
    derived = [" ".join(m) for m in model_merges(ours.backend)]
    path = write_spm_gguf(tmp_path / "merges.gguf", arch="phi3", merges=derived[::-1])  # worst first
    with_merges = GGUFFile(path).tokenizer()
    assert model_merges(with_merges.backend) == [m.split(" ") for m in derived[::-1]]
    reference = transformers_tokenizer(path)
    for text in TEXTS:
        assert with_merges.encode(text) == reference.encode(text)
    assert any(with_merges.encode(t) != ours.encode(t) for t in TEXTS)


def test_no_space_prefix_and_no_bos(tmp_path):
    """Hand-computed: transformers' GGUF loader ignores add_space_prefix, so it is no reference here."""
    tokenizer = GGUFFile(write_spm_gguf(tmp_path / "t.gguf", space_prefix=False, add_bos=False)).tokenizer()
    vocab = tokenizer.backend.get_vocab()
    assert tokenizer.encode("hello world") == [vocab["hello"], vocab["▁world"]]
    assert tokenizer.encode(" hello") == [vocab["▁hello"]]
    for text in ("hello world", " hello", "  a\nb "):
        assert tokenizer.decode(tokenizer.encode(text)) == text  # no leading space stripped


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path = write_spm_gguf(tmp_path / "bert.gguf", model="bert")
    with pytest.raises(TreeserveError, match="'bert'"):
        GGUFFile(path).tokenizer()
