"""Divergences between greedy outputs, as `treeserve bench` records them, and their check against the target
(`python -m treeserve.bench.near_ties`): a near-tie of the target's top tokens passes, a clear preference fails
(also between two tokens below the top), an output that ended where the other went on or a request that failed is
reported unchecked, never passed."""

from __future__ import annotations

import json

import pytest

from treeserve.divergence import divergence, first_divergence
from treeserve.loading import load_target
from treeserve.params import GenerationParams
from treeserve.verifier import generate
from treeserve.bench.near_ties import check, logit_gap, main, next_token_logits, usable

PROMPT = "the cat sat on the mat"
CPU = ("--device", "cpu", "--dtype", "float32")


def test_divergence_is_the_first_position_that_differs():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert divergence([1, 2, 3], [1, 5, 3]) == {"at": 1, "shared": [1], "first": 2, "other": 5}
    assert divergence([1, 2], [1, 2, 7]) == {"at": 2, "shared": [1, 2], "first": None, "other": 7}


@pytest.fixture(scope="module")
def case(model_path, tmp_path_factory):
    """A bench report whose one run recorded three divergences of request 0 at its 4th token: to the target's
    runner-up (a gap of `gap`), to its least likely token, and past the end of the first output."""
    target = load_target(model_path)
    prompt_ids = target.tokenizer.encode(PROMPT)
    output = generate(target.model, target.tokenizer, prompt_ids,
                      GenerationParams(max_new_tokens=8, ignore_eos=True)).token_ids
    at = 3
    logits = next_token_logits(target.model, prompt_ids + output[:at])
    assert logits.argmax().item() == output[at]
    runner_up, least = logits.topk(2).indices[1].item(), logits.argmin().item()
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    found = [divergence(output, output[:at] + [other]) for other in (runner_up, least)]
    found.append(divergence(output[:at], output))
    report = {"prompts": str(prompts), "temperature": 0, "runs": [
        {"mode": "plain", "turn": 0, "concurrency": 4},
        {"mode": "speculative", "turn": 0, "concurrency": 4, "identical_to_plain": "0/1", "divergences": [
            {"request": 0, "prompt": 0} | entry for entry in found]}]}
    gap = logit_gap(target.model, prompt_ids + output[:at], output[at], runner_up)
    return target, report, gap, logits


def test_a_near_tie_passes_and_a_clear_preference_does_not(case):
    target, report, gap, _ = case
    tolerance = 1.01 * gap.gap / gap.scale  # the runner-up just within it
    summary = check(report, usable(report), target, tolerance)
    assert summary["checked"] == 2 and summary["near_ties"] == 1
    [bad] = summary["not_near_ties"]
    assert summary["largest_relative_gap"] == pytest.approx(bad["gap"] / bad["scale"])
    assert bad["request"] == 0 and bad["at"] == 3 and bad["gap"] > gap.gap
    assert summary["unchecked"] == [{"mode": "speculative", "turn": 0, "concurrency": 4, "request_rate": None,
                                     "request": 0, "at": 3}]
    just_outside = 0.99 * gap.gap / gap.scale  # not a near-tie either
    assert check(report, usable(report), target, just_outside)["near_ties"] == 0


def test_the_command_exits_nonzero_unless_every_divergence_is_a_near_tie(case, model_path, tmp_path, capsys):
    target, report, gap, _ = case
    tolerance = str(1.01 * gap.gap / gap.scale)
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps(report))
    assert main([str(mixed), "--target", model_path, "--device", "cpu", "--dtype", "float32",
                 "--tolerance", tolerance, "--out", str(tmp_path / "s.json")]) == 1
    assert "2 divergences checked, 1 near-ties, 1 not, 1 unchecked" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["summaries"][str(mixed)]["near_ties"] == 1
    report["runs"][1]["divergences"] = report["runs"][1]["divergences"][:1]  # the runner-up alone
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(report))
    assert main([str(clean), "--target", model_path, *CPU, "--tolerance", tolerance]) == 0
    assert main([str(tmp_path / "missing.json"), "--target", model_path, *CPU]) == 1
    assert "near_ties: error:" in capsys.readouterr().err
    # Nothing recorded is not a pass: a sampled run, or one made before the bench recorded divergences.
    for change in ({"temperature": 0.7}, {"runs": [{k: v for k, v in row.items() if k != "divergences"}
                                                   for row in report["runs"]]}):
        unusable = tmp_path / "unusable.json"
        unusable.write_text(json.dumps(report | change))
        assert main([str(unusable), "--target", model_path, *CPU]) == 1
        assert "no recorded divergences" in capsys.readouterr().err


def test_two_tokens_below_the_top_are_no_near_tie_however_close(case):
    """The target's second and third choices may be close to each other; outputs parting between them still went
    past what the target clearly prefers."""
    target, report, _, logits = case
    found = report["runs"][1]["divergences"][0]
    second, third = logits.topk(3).indices[1:].tolist()
    apart = (logits[second] - logits[third]).abs().item()
    below = (logits.max() - logits[third]).item()
    assert below > apart
    context = target.tokenizer.encode(PROMPT) + found["shared"]
    gap = logit_gap(target.model, context, second, third)
    assert gap.gap == pytest.approx(below, rel=1e-5)
    assert not gap.near_tie(1.01 * apart / gap.scale)


def test_failed_requests_are_unchecked_not_passed(case):
    target, report, gap, _ = case
    row = dict(report["runs"][1], identical_to_plain="0/5",  # five requests, the one divergence recorded: four failed
               divergences=report["runs"][1]["divergences"][:1])
    edited = report | {"runs": [report["runs"][0], row]}
    summary = check(edited, usable(edited), target, 1.01 * gap.gap / gap.scale)
    assert summary["near_ties"] == 1 and summary["unchecked"][0]["failed_requests"] == 4
