"""Tensor parallelism on the CPU (gloo): `treeserve generate --tp 2` gives the tokens of --tp 1, and each rank
holds only its part of every layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tiny_models
from random_targets import tiny_config
from treeserve.errors import TreeserveError
from treeserve.parallel import Shard


def test_a_shard_holds_its_heads_and_columns_and_the_slices_rebuild_each_tensor():
    cfg = tiny_config("qwen2")  # 4 heads over 2 key/value heads, MLP 96
    local = Shard(1, 2).config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 48)
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (cfg.hidden_size, cfg.head_dim, cfg.vocab_size // 2)
    with pytest.raises(TreeserveError, match="num_kv_heads .2. does not divide by 4"):
        Shard(0, 4).config(cfg)
    weight = torch.arange(48.0 * 6).reshape(48, 6)
    for name, dim in [("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.self_attn.v_proj.bias", 0),
                      ("model.layers.0.mlp.up_proj.weight", 0), ("model.layers.0.self_attn.o_proj.weight", 1),
                      ("model.layers.1.mlp.down_proj.weight", 1), ("lm_head.weight", 0)]:
        tensor = weight if name.endswith("weight") else weight[:, 0]
        parts = [Shard(rank, 2).slice(name, tensor) for rank in range(2)]
        assert parts[0].shape[dim] == tensor.shape[dim] // 2, name
        assert torch.equal(torch.cat(parts, dim=dim), tensor), name
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert Shard(1, 2).slice(name, weight) is weight


def generate(target, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "treeserve", "generate", "--target", str(target), "--prompt",
                           "the cat sat on the mat and the cat", "--max-new-tokens", "20", "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow  # each --tp 2 run starts two processes that import torch
@pytest.mark.parametrize("case, flags", [
    ("qwen2", ["--drafter", "ngram", "--budget", "8"]),  # q/k/v biases split with their rows
    ("llama", ["--drafter", "ngram", "--temperature", "0.8", "--seed", "3"]),
    ("qwen3", ["--drafter", "none"]),  # q/k norms on each rank's heads
    ("llama3", ["--drafter", "ngram", "--budget", "16"]),
    ("mistral", ["--drafter", "ngram", "--budget", "4"]),
])
def test_generate_on_two_ranks_gives_the_tokens_of_one(tmp_path, case, flags):
    target = tiny_models.write_hf_folder(case, tmp_path / case, seed=0)
    one, two = generate(target, *flags), generate(target, "--tp", "2", *flags)
    assert two["token_ids"] == one["token_ids"] and two["text"] == one["text"]
    assert two["rounds"] == one["rounds"]


def test_a_count_that_does_not_divide_is_one_clear_line(tmp_path):
    target = tiny_models.write_hf_folder("qwen3", tmp_path / "qwen3", seed=0)  # 2 key/value heads
    done = subprocess.run([sys.executable, "-m", "treeserve", "generate", "--target", str(target), "--prompt", "hi",
                           "--tp", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["treeserve generate: error: --tp 4: the model's num_kv_heads (2) does not "
                                                "divide by 4"]


def test_a_step_goes_to_the_other_ranks_as_arrays_and_comes_back_as_the_same_tensors():
    """Rank 0's steps are pickled with their host tensors as NumPy arrays (torch's own tensor pickling was 3-4x
    slower over gloo): the follower gets the same dataclasses, tuples and tensors, dtypes included."""
    import pickle

    from treeserve.models.graphs import stage_trees
    from treeserve.models.paged_kv import PagedKVCache
    from treeserve.verifier.tensor_parallel import from_wire, to_wire

    pool = PagedKVCache(tiny_config("llama"), 40, 4, torch.float32, "cpu")
    sequence = pool.sequence()
    sequence.reserve(6)
    sequence.keep(list(range(6)))
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    staged = stage_trees([sequence], [[5, 6, 7]], [torch.tensor([6, 7, 7])], [mask], 2, 3, 8)
    payload = {"key": (2, 3), "staged": staged, "feature_layer_ids": (0, 1),
               "moves": [(torch.tensor([9]), torch.tensor([7]))],
               "packed_rows": (torch.tensor([0, 0]), torch.tensor([0, 1]), 2), "logits_rows": None}
    wire = pickle.dumps(to_wire(payload))
    assert b"_rebuild_tensor" not in wire
    back = from_wire(pickle.loads(wire))
    assert back["key"] == (2, 3) and back["feature_layer_ids"] == (0, 1) and back["logits_rows"] is None
    assert back["packed_rows"][2] == 2 and type(back["staged"]) is type(staged)
    pairs = [(back["staged"].tokens, staged.tokens), (back["staged"].positions, staged.positions),
             *zip(back["staged"].paged.tensors(), staged.paged.tensors()), (back["moves"][0][0], torch.tensor([9])),
             (back["packed_rows"][1], torch.tensor([0, 1]))]
    for got, want in pairs:
        assert got.dtype == want.dtype and torch.equal(got, want)
