"""`generate --tp 2` on two GPUs in bfloat16 against `--tp 1` (run on the two-GPU host; skipped elsewhere).

The ranks' partial sums meet in NCCL all-reduces, which add in another order than one GPU's GEMM, so bfloat16
outputs may part ways; every divergence must be a near-tie of the one-rank target's logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tiny_models
from test_cuda import assert_equal_or_near_tie
from treeserve.loading import load_target

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PROMPT = "the cat sat on the mat and the cat"


def generate(target, tp: int, *flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "treeserve", "generate", "--target", str(target), "--device", "cuda",
                           "--dtype", "bfloat16", "--tp", str(tp), "--max-new-tokens", "48", "--json",
                           "--prompt", PROMPT, *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", ["llama", "llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_two_gpus_match_one_up_to_near_ties(tmp_path, case, drafter):
    folder = tiny_models.write_hf_folder(case, tmp_path / case, seed=0)
    one, two = (generate(folder, tp, "--drafter", drafter, "--budget", "8") for tp in (1, 2))
    target = load_target(str(folder), device="cuda", dtype="bfloat16")
    prompt = target.tokenizer.encode(PROMPT)
    assert_equal_or_near_tie(target.model, prompt, one["token_ids"], two["token_ids"], tolerance=2 ** -6)
