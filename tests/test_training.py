"""DFlash drafter training: the many-anchor training forward equals the inference path, the loss weighs block
positions as DFlash does, a tiny drafter learns, a run resumes exactly, the regenerated data is the target's own
output, and make-prompts / train-drafter behave on the command line."""

from __future__ import annotations

import io
import json
import math
import random

import pytest
import torch

from random_targets import random_target, word_tokenizer
from treeserve.cli import main
from treeserve.drafter.training import corpus, corpus_sources
from treeserve.drafter.training import train as T
from treeserve.drafter.dflash import load_dflash
from treeserve.errors import TreeserveError
from treeserve.models import KVCache, TreeAttention
from treeserve.params import GenerationParams
from treeserve.verifier.engine import generate

VOCAB, LAYER_IDS = 96, (0, 1)


def tiny_drafter(target, layers=2, block_size=5, seed=1, scale=0.0):
    """scale > 0: weights well away from the init (norms off one), so every term of the forward matters."""
    cfg = T.drafter_config(target.config, VOCAB - 1, layers, block_size, LAYER_IDS, intermediate_size=40)
    model = T.new_drafter(cfg, seed)
    if scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5, generator=g)
                else:
                    param.normal_(0.0, scale, generator=g)
    return model


def random_samples(count, seed=0, length=(13, 24)):
    rng = random.Random(seed)
    return [T.Sample(tuple(rng.randrange(VOCAB - 1) for _ in range(rng.randint(*length))), rng.randint(0, 4))
            for _ in range(count)]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes


@pytest.fixture(scope="module")
def target():
    return random_target("llama", seed=3, vocab_size=VOCAB, weight_scale=2.0)


@pytest.fixture(scope="module")
def dataset(target):
    """The target's own greedy answers to 40 random prompts: 32 to train on, 8 held out."""
    rng = random.Random(0)
    prompts = {i: [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))] for i in range(40)}
    samples = T.regenerate(target, word_tokenizer(VOCAB), prompts, 40, concurrency=40, log=None)
    return [samples[i] for i in range(40)]


# ------------------------------------------------------------------------------------------- training forward


def test_target_features_equal_the_cached_forward(target):
    tokens = torch.tensor(random_samples(1, seed=5)[0].tokens)
    got = T.target_features(target, tokens[None], LAYER_IDS)[0]
    n = len(tokens)
    cache = KVCache(target.config, n, torch.float32, "cpu")
    _, hidden = target(tokens, torch.arange(n), TreeAttention(cache, torch.ones(n, n, dtype=torch.bool).tril()),
                       hidden_layer_ids=LAYER_IDS)
    torch.testing.assert_close(got, torch.cat(hidden, dim=-1), atol=1e-5, rtol=1e-5)


def test_training_forward_equals_the_inference_path(target):
    """Two padded sequences, three anchors each (one at the first response position, one at the last possible),
    against DFlashModel.extend_context + forward over a paged pool + the target's LM head, one anchor at a
    time."""
    from treeserve.models.graphs import stage_trees
    from treeserve.models.paged_kv import PagedAttention, PagedKVCache

    model = tiny_drafter(target, scale=0.3)
    pool = PagedKVCache(model.config.layers, 16, 4, torch.float32, "cpu")
    block = model.config.block_size
    samples = [T.Sample(tuple(random_samples(1, seed=6, length=(20, 20))[0].tokens), 3),
               T.Sample(tuple(random_samples(1, seed=7, length=(13, 13))[0].tokens), 2)]
    anchors = torch.tensor([[3, 9, 20 - block], [13 - block, 2, 5]])
    tokens = T.pad_tokens(samples)
    features = T.target_features(target, tokens, LAYER_IDS)
    logits = T.block_logits(model, target, tokens, features, anchors)
    assert logits.shape == (2, 3, block - 1, VOCAB)
    for row, sample in enumerate(samples):
        sequence = torch.tensor(sample.tokens)
        alone = T.target_features(target, sequence[None], LAYER_IDS)[0]
        for column, anchor in enumerate(anchors[row].tolist()):
            context = pool.sequence()
            model.extend_context(context, alone[:anchor])
            ids = torch.tensor([sample.tokens[anchor]] + [model.config.mask_token_id] * (block - 1))
            rows = stage_trees([context], [ids.tolist()], [torch.arange(anchor, anchor + block)],
                               [torch.ones(block, block, dtype=torch.bool)], 1, block, 16)
            with torch.no_grad():  # as at inference: the pool is written, never differentiated
                hidden = model(target.model.embed_tokens(ids), rows.positions, PagedAttention(pool, rows.paged))
                want = target.lm_head(hidden)[1:]
            context.release()
            torch.testing.assert_close(logits[row, column], want, atol=2e-5, rtol=1e-5)


def test_loss_weights_block_positions_by_hand():
    """b = 4 (three predicted positions), two anchors of which the second is padding, gamma 2."""
    logits = torch.tensor([[[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]],
                            [[9.0, 0.0, 0.0], [9.0, 0.0, 0.0], [9.0, 0.0, 0.0]]]])
    labels = torch.tensor([[[0, 2, 1], [1, 1, 1]]])
    valid = torch.tensor([[True, False]])

    def ce(row, label):
        return math.log(sum(math.exp(x) for x in row)) - row[label]

    rows = logits[0, 0].tolist()
    losses = [ce(rows[0], 0), ce(rows[1], 2), ce(rows[2], 1)]
    weights = [1.0, math.exp(-0.5), math.exp(-1.0)]
    want = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
    got = T.block_loss(logits, labels, valid, T.decay_weights(4, 2.0))
    assert got.item() == pytest.approx(want, rel=1e-6)
    uniform = T.block_loss(logits, labels, valid, T.decay_weights(4, 0.0))
    assert uniform.item() == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert T.accepted_lengths(logits, labels, valid).tolist() == [2]  # position 1 right, position 2 wrong


def test_anchors_lie_in_the_response_with_every_label_present():
    samples = [T.Sample(tuple(range(30)), 10), T.Sample(tuple(range(12)), 5), T.Sample(tuple(range(8)), 0)]
    anchors, valid = T.sample_anchors(samples, 8, 5, torch.Generator().manual_seed(0))
    first = anchors[0][valid[0]].tolist()
    assert len(set(first)) == 8 and all(10 <= a <= 25 for a in first)
    assert sorted(anchors[1][valid[1]].tolist()) == [5, 6, 7]  # the only anchors with a + 4 < 12
    assert sorted(anchors[2][valid[2]].tolist()) == [1, 2, 3]  # never 0: the context must not be empty


# ------------------------------------------------------------------------------------------------ the loop


def settings(**changes):
    base = dict(steps=40, batch_size=8, anchors=8, lr=1e-2, log_every=1, eval_every=40, save_every=40)
    return T.TrainSettings(**{**base, **changes})


def test_training_lowers_the_loss(target, dataset, tmp_path):
    model = tiny_drafter(target, layers=1, block_size=4)
    before = T.evaluate(model, target, dataset[32:], settings())
    summary = T.train(model, target, dataset[:32], dataset[32:], tmp_path, settings(), log=lambda line: None)
    losses = [loss for _, loss in summary["loss_curve"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.4, losses
    assert summary["held_out"]["loss"] < before["loss"] - 0.2
    assert summary["held_out"]["accepted_length"] >= 1.0
    assert [point["step"] for point in summary["held_out_curve"]] == [40]
    assert summary["held_out_curve"][-1]["loss"] == summary["held_out"]["loss"]
    again = load_dflash(tmp_path)
    assert again.config == model.config


def test_resume_continues_where_the_run_stopped(target, dataset, tmp_path):
    """Stopped after step 5 with a checkpoint at step 4, the resumed run ends with the uninterrupted run's
    weights: data order and anchors come from (seed, step), the optimizer state from trainer-state.pt."""
    common = dict(steps=8, save_every=4, eval_every=100)
    straight = tiny_drafter(target, layers=1, block_size=4)
    T.train(straight, target, dataset[:32], [], tmp_path / "straight", settings(**common), log=lambda line: None)

    def stop_at_step_5(line):
        if line.startswith("train: step 5/"):
            raise KeyboardInterrupt

    resumed_dir = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        T.train(tiny_drafter(target, layers=1, block_size=4), target, dataset[:32], [], resumed_dir,
                settings(**common), log=stop_at_step_5)
    assert torch.load(resumed_dir / T.STATE_NAME, weights_only=True)["step"] == 4
    lines = []
    resumed = tiny_drafter(target, layers=1, block_size=4, seed=99)  # a different init: the state replaces it
    summary = T.train(resumed, target, dataset[:32], [], resumed_dir, settings(**common), log=lines.append)
    assert summary["start_step"] == 4 and lines[0] == "train: resuming from trainer-state.pt at step 4"
    assert [step for step, _ in summary["loss_curve"]] == [5, 6, 7, 8]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


# ------------------------------------------------------------------------------------------------------ data


def test_regenerated_data_is_the_targets_own_output_and_is_reused(target, dataset, tmp_path):
    tokenizer = word_tokenizer(VOCAB)
    for sample in dataset[:3]:
        prompt = list(sample.tokens[:sample.prompt_length])
        alone = generate(target, tokenizer, prompt, GenerationParams(max_new_tokens=40, seed=0))
        assert list(sample.tokens[sample.prompt_length:]) == alone.token_ids
    prompts = [list(s.tokens[:s.prompt_length]) for s in dataset[:4]]
    path = tmp_path / "data.jsonl"
    first = T.load_or_regenerate(path, target, tokenizer, prompts[:3], 40, log=None)
    # All four are in the file afterwards; the three already there are read back, not generated again.
    both = T.load_or_regenerate(path, target, tokenizer, prompts, 40, log=None)
    assert both[:3] == first and both == dataset[:4]
    assert T.load_or_regenerate(path, None, tokenizer, prompts, 40, log=None) == both  # no model needed
    assert T.load_or_regenerate(path, None, tokenizer, prompts[:2], 40, log=None) == both[:2]  # a --limit run
    path.write_text(path.read_text() + '{"index": 4, "prompt_len')  # a run killed while writing
    assert T.load_or_regenerate(path, None, tokenizer, prompts, 40, log=None) == both
    assert path.read_text().endswith("}\n")
    with pytest.raises(TreeserveError, match="other prompts"):
        T.load_or_regenerate(path, target, tokenizer, [[1, 2, 3]] * 4, 40, log=None)


def test_new_drafter_shape_and_mask_token(target):
    cfg = T.drafter_config(target.config, 7, layers=2, block_size=8, target_layer_ids=(1,))
    assert (cfg.layers.family, cfg.layers.hidden_size, cfg.layers.head_dim) == ("qwen3", 48, 12)
    assert cfg.layers.intermediate_size == target.config.intermediate_size and cfg.feature_size == 48
    # The tokenizer stops at 90 of the 96 rows: the first padding row is the mask; without padding, the last row.
    assert T.choose_mask_token(target, word_tokenizer(90)) == 90
    assert T.choose_mask_token(target, word_tokenizer(VOCAB)) == VOCAB - 1
    with pytest.raises(TreeserveError, match="target layer ids"):
        T.drafter_config(target.config, 7, target_layer_ids=(2,))
    init = T.new_drafter(T.drafter_config(target.config, 7, 1, 4, LAYER_IDS), init_from=target)
    assert torch.equal(init.layers[0].mlp.gate_up_proj.weight, target.model.layers[-1].mlp.gate_up_proj.weight)


# ------------------------------------------------------------------------------------------ command lines


@pytest.fixture
def source_tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "skipme").mkdir()
    functions = "\n\n".join(f"def f{i}(x, y):\n    total = x + y\n    for _ in range({i}):\n        total *= 2\n"
                            f"    return total - {i}\n" for i in range(12))
    (root / "pkg" / "mod.py").write_text("import os\n\n" + functions)
    (root / "README.md").write_text("\n".join(f"Line {i} of the documentation." for i in range(30)))
    (root / "skipme" / "other.py").write_text(functions)
    return root


def test_make_prompts_is_deterministic_valid_jsonl(source_tree, tmp_path, capsys):
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for out in outs:
        assert main(["make-prompts", "--from", str(source_tree), "--out", str(out), "--exclude", "skip*",
                     "--seed", "3", "--limit", "8"]) == 0
    assert outs[0].read_text() == outs[1].read_text()
    records = [json.loads(line) for line in outs[0].read_text().splitlines()]
    assert len(records) == 8
    assert all(r["chat"] is True and r["prompt"] and r["kind"] in corpus.KINDS for r in records)
    assert all(r["source"].startswith(("src/pkg/mod.py:", "src/README.md:")) for r in records)
    assert "make-prompts: folders: 8 prompts from 2 files" in capsys.readouterr().err

    def everything(seed):
        where = corpus_sources.Folder(source_tree, exclude=("skip*",))
        folder = corpus_sources.Source("src", corpus_sources.TRAIN, where, "test")
        return corpus_sources.build_set([folder], 1000, seed=seed, log=io.StringIO())

    build = everything(3)
    assert build.sources["src"]["files"] == 2 and len(build.prompts) > 8
    assert everything(4).prompts != build.prompts


@pytest.mark.parametrize("argv, message", [
    (["train-drafter", "--out", "out", "--data", "missing.jsonl"], "prompts file missing.jsonl not found"),
    (["train-drafter", "--out", "out", "--data", "data.jsonl", "--steps", "0"], "--steps must be at least 1"),
    (["train-drafter", "--out", "out", "--data", "data.jsonl", "--block-size", "1"], "--block-size must be at least 2"),
    (["train-drafter", "--out", "out", "--data", "data.jsonl", "--temperature", "inf"],
     "temperature must be a finite number >= 0 (0 is greedy), got inf"),
    (["train-drafter", "--out", "out", "--data", "bad.jsonl"], "bad.jsonl:2: not JSON"),
    (["train-drafter", "--out", "out", "--data", "data.jsonl", "--target-layer-ids", "1,x"], "comma-separated"),
    (["make-prompts", "--from", "nowhere", "--out", "out.jsonl"], "--from nowhere: not a folder"),
])
def test_bad_arguments_are_one_line_errors(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "hi", "chat": false}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\nnot json\n')
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_train_drafter_command_end_to_end(tmp_path, capsys):
    """A tiny Hugging Face target on disk: regenerate, train, save; a second call resumes and reuses the data."""
    from tiny_models import write_hf_folder

    folder = write_hf_folder("qwen3", tmp_path / "target", seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"the quick brown fox {i} jumps", "chat": i % 2 == 0}) + "\n"
                            for i in range(10)))
    out = tmp_path / "drafter"

    def train_drafter(steps):
        return main(["train-drafter", "--target", str(folder), "--out", str(out), "--data", str(data),
                     "--held-out", "2", "--max-new-tokens", "24", "--block-size", "4", "--target-layer-ids", "0,1",
                     "--steps", str(steps), "--batch-size", "4", "--anchors", "4", "--save-every", "2",
                     "--eval-every", "2", "--device", "cpu"])

    assert train_drafter(4) == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["data"]["sequences"] + summary["held_out_data"]["sequences"] <= 10
    assert summary["held_out"]["accepted_length"] >= 1.0 and summary["start_step"] == 0
    # The command as a user types it, without the path of whatever ran it.
    assert summary["command"].startswith("treeserve train-drafter --target ")
    drafter = load_dflash(out)
    assert drafter.config.target_layer_ids == (0, 1) and drafter.config.block_size == 4
    assert len((out / "data.jsonl").read_text().splitlines()) == 10
    capsys.readouterr()
    assert train_drafter(6) == 0  # resumes at step 4, reuses the data
    err = capsys.readouterr().err
    assert "resuming from trainer-state.pt at step 4" in err and "regenerate:" not in err
    assert json.loads((out / "training.json").read_text())["start_step"] == 4
    # Another run goes on from the saved drafter: it starts from those weights, and only from a drafter of the
    # shape its flags ask for.
    go_on = ["train-drafter", "--target", str(folder), "--data", str(data), "--held-out", "2",
             "--max-new-tokens", "24", "--block-size", "4", "--target-layer-ids", "0,1", "--batch-size", "4",
             "--anchors", "4", "--steps", "1", "--lr", "1e-12", "--eval-every", "1", "--device", "cpu",
             "--responses", str(out / "data.jsonl"), "--init-from", str(out)]
    assert main([*go_on, "--out", str(tmp_path / "more")]) == 0
    start, more = load_dflash(out), load_dflash(tmp_path / "more")
    for (name, a), b in zip(start.state_dict().items(), more.state_dict().values()):
        assert torch.equal(a, b), name  # a step at lr 1e-12 leaves each bfloat16 weight where it was
    more_record = json.loads((tmp_path / "more" / "training.json").read_text())
    assert more_record["arguments"]["init_from"] == str(out)
    assert more_record["started_from"] == json.loads((out / "training.json").read_text())  # the whole lineage
    capsys.readouterr()
    assert main([*go_on, "--out", str(tmp_path / "other"), "--block-size", "5"]) == 1
    err = capsys.readouterr().err
    assert "is another drafter than the flags ask for: block_size 4 (flags: 5)" in err and err.count("\n") == 1
