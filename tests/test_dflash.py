"""The DFlash drafter model: a z-lab-layout checkpoint written here loads, and its block forward (with context
keys/values cached across rounds in a paged pool, several requests batched) equals a naive implementation
written from the paper's description."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest
import torch
from safetensors.torch import save_file

from treeserve.drafter.dflash import config_from_json, default_target_layer_ids, load_dflash, save_dflash
from treeserve.errors import TreeserveError

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK = 48, 4, 2, 16, 80, 2, 5
TARGET_LAYERS = (1, 3, 5)
TARGET_DEPTH = 8  # the layer count of the target the fixture's drafter was made for
EPS, THETA = 1e-6, 10000.0


def zlab_config() -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": EPS, "rope_theta": THETA,
            "max_position_embeddings": 512, "vocab_size": 100, "block_size": BLOCK, "attention_bias": False,
            "num_target_layers": TARGET_DEPTH,
            "dflash_config": {"target_layer_ids": list(TARGET_LAYERS), "mask_token_id": 99}}


def random_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or 1 / math.sqrt(shape[-1]))

    weights = {"fc.weight": randn(HIDDEN, HIDDEN * len(TARGET_LAYERS)),
               "hidden_norm.weight": 1 + randn(HIDDEN, scale=0.1), "norm.weight": 1 + randn(HIDDEN, scale=0.1)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        weights |= {p + "input_layernorm.weight": 1 + randn(HIDDEN, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + randn(HIDDEN, scale=0.1),
                    p + "self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
                    p + "self_attn.q_norm.weight": 1 + randn(HEAD_DIM, scale=0.1),
                    p + "self_attn.k_norm.weight": 1 + randn(HEAD_DIM, scale=0.1),
                    p + "mlp.gate_proj.weight": randn(INTER, HIDDEN),
                    p + "mlp.up_proj.weight": randn(INTER, HIDDEN),
                    p + "mlp.down_proj.weight": randn(HIDDEN, INTER)}
    return weights


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(zlab_config()))
    weights = random_weights(0)
    save_file(weights, tmp_path / "model.safetensors")
    return tmp_path, weights


# ------------------------------------------------------------------------------------------- naive reference


def rms(x, weight):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope(x, positions):
    """x (N, heads, D): rotate pairs (i, i + D/2) by position * theta^(-2i/D)."""
    half = HEAD_DIM // 2
    freqs = THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
    angle = (positions.double()[:, None] * freqs[None, :]).float()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1)


def naive_block(w, features, block, first_position):
    """One request: context features (C, L*H) at positions 0..C-1, the block's embeddings (b, H) at positions
    first_position.. ; every block row attends to the whole context and the whole block."""
    context = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    c, b = context.shape[0], block.shape[0]
    ctx_pos, blk_pos = torch.arange(c), torch.arange(first_position, first_position + b)
    x = block
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        both = torch.cat((context, h))  # context rows skip the layer norm: they are already normalised
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(c + b, KV_HEADS, HEAD_DIM),
                w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + b, KV_HEADS, HEAD_DIM)
        q, k = rope(q, blk_pos), rope(k, torch.cat((ctx_pos, blk_pos)))
        out = torch.empty(b, HEADS, HEAD_DIM)
        for head in range(HEADS):
            kv = head // (HEADS // KV_HEADS)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(HEAD_DIM)
            out[:, head] = scores.softmax(-1) @ v[:, kv]
        x = x + out.reshape(b, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])


# ------------------------------------------------------------------------------------------------------ tests


def test_checkpoint_loads_with_its_config(checkpoint):
    folder, _ = checkpoint
    model = load_dflash(folder)
    cfg = model.config
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (BLOCK, TARGET_LAYERS, 99)
    assert cfg.feature_size == HIDDEN * len(TARGET_LAYERS) and cfg.layers.num_layers == LAYERS


def block_forward(model, pool, sequences, blocks: list[torch.Tensor]) -> torch.Tensor:
    """The model's block forward over the pool: each block sees its sequence's context and the whole block."""
    from treeserve.models.graphs import stage_trees
    from treeserve.models.paged_kv import PagedAttention

    positions = [torch.arange(s.length, s.length + BLOCK) for s in sequences]
    rows = stage_trees(sequences, [[0] * BLOCK for _ in sequences], positions,
                       [torch.ones(BLOCK, BLOCK, dtype=torch.bool)] * len(sequences), len(sequences), BLOCK,
                       table_width=200)
    out = model(torch.cat(blocks), rows.positions, PagedAttention(pool, rows.paged))
    for sequence in sequences:
        sequence.keep([])  # the block is not context
    return out


def test_block_forward_equals_the_naive_implementation(checkpoint):
    from treeserve.models.paged_kv import PagedKVCache

    folder, weights = checkpoint
    model = load_dflash(folder)
    g = torch.Generator().manual_seed(1)
    lengths = [7, 12]  # two requests with different context lengths, batched in one forward
    features = [torch.randn(n, HIDDEN * len(TARGET_LAYERS), generator=g) for n in lengths]
    blocks = [torch.randn(BLOCK, HIDDEN, generator=g) for _ in lengths]
    pool = PagedKVCache(model.config.layers, 16, 4, torch.float32, "cpu")  # pages of 4: contexts straddle them
    sequences = []
    for feats in features:
        sequence = pool.sequence()
        # Context arrives over rounds: the cache must equal computing it at once.
        model.extend_context(sequence, feats[:3])
        model.extend_context(sequence, feats[3:])
        sequences.append(sequence)
    got = block_forward(model, pool, sequences, blocks)
    want = torch.cat([naive_block(weights, f, b, n) for f, b, n in zip(features, blocks, lengths)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [s.length for s in sequences] == lengths and pool.allocator.free_count == 16 - 2 - 3


def test_a_long_context_over_many_pages(checkpoint):
    from treeserve.models.paged_kv import PagedKVCache

    folder, weights = checkpoint
    model = load_dflash(folder)
    features = torch.randn(300, HIDDEN * len(TARGET_LAYERS), generator=torch.Generator().manual_seed(2))
    pool = PagedKVCache(model.config.layers, 40, 8, torch.float32, "cpu")
    sequence = pool.sequence()
    for start in range(0, 300, 100):
        model.extend_context(sequence, features[start:start + 100])
    block = torch.randn(BLOCK, HIDDEN)
    got = block_forward(model, pool, [sequence], [block])
    torch.testing.assert_close(got, naive_block(weights, features, block, 300), atol=1e-5, rtol=1e-5)


def test_save_then_load_round_trips(tmp_path, checkpoint):
    folder, _ = checkpoint
    model = load_dflash(folder)
    save_dflash(model, tmp_path / "copy", dtype=torch.float32)
    again = load_dflash(tmp_path / "copy")
    assert again.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("dflash_config"), "not a DFlash config"),
    (lambda c: c.update(layer_types=["sliding_attention"] * LAYERS), "full-attention"),
    (lambda c: c.update(block_size=1), "block_size"),
])
def test_bad_configs_are_clear_errors(checkpoint, change, message):
    folder, _ = checkpoint
    config = zlab_config()
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TreeserveError, match=message):
        load_dflash(folder)


def test_missing_or_misshaped_tensors_are_clear_errors(checkpoint):
    folder, weights = checkpoint
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, folder / "model.safetensors")
    with pytest.raises(TreeserveError, match="missing tensors: fc.weight"):
        load_dflash(folder)
    save_file(weights | {"norm.weight": torch.ones(HIDDEN + 1)}, folder / "model.safetensors")
    with pytest.raises(TreeserveError, match="norm.weight has shape"):
        load_dflash(folder)
    with pytest.raises(TreeserveError, match="config.json is missing"):
        load_dflash(folder / "nowhere")


def test_default_target_layers_spread_from_1_to_l_minus_3():
    assert default_target_layer_ids(30, 5) == (1, 8, 14, 20, 27)  # Python rounds 7.5 to even
    assert default_target_layer_ids(36, 5)[0] == 1 and default_target_layer_ids(36, 5)[-1] == 33


# -------------------------------------------------------------- the reference's config rules (z-lab/dflash)

# What the reference's loaders index config.json for (its MLX loader fails on any of them missing).
REFERENCE_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
                          "max_position_embeddings")


def reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default: one target layer per draft layer, spread from 1 to L - 3 (the middle one for a
    single draft layer), rounded half to even; exact fractions here, floats there (same result at these sizes)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = Fraction(num_target_layers - 4, num_draft_layers - 1)
    return [round(1 + i * step) for i in range(num_draft_layers)]


def reference_reads(raw: dict) -> dict:
    """What the reference's draft model takes from config.json, by its rules: `dflash_config` must be there,
    `num_target_layers` is read even where the ids are given, and missing ids default from it."""
    dflash = raw["dflash_config"]
    depth = raw["num_target_layers"]
    layer_ids = dflash.get("target_layer_ids", reference_layer_ids(depth, raw["num_hidden_layers"]))
    return {**{key: raw[key] for key in REFERENCE_SHAPE_FIELDS}, "num_target_layers": depth,
            "block_size": raw["block_size"], "target_layer_ids": list(layer_ids),
            "mask_token_id": dflash["mask_token_id"]}


def as_reference_fields(cfg) -> dict:
    """Our config, under the names reference_reads gives."""
    c = cfg.layers
    return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_context,
            "num_target_layers": cfg.num_target_layers, "block_size": cfg.block_size,
            "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}


def test_a_saved_checkpoint_reads_the_same_by_the_reference_rules(checkpoint, tmp_path):
    folder, _ = checkpoint
    save_dflash(load_dflash(folder), tmp_path / "copy", dtype=torch.float32)
    raw = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert raw["num_target_layers"] == TARGET_DEPTH
    assert reference_reads(raw) == as_reference_fields(load_dflash(tmp_path / "copy").config)


def test_the_shipped_checkpoint_records_its_target_layer_count():
    from treeserve.drafter import shipped_dflash

    raw = json.loads((shipped_dflash("smollm2-135m") / "config.json").read_text())
    assert reference_reads(raw)["target_layer_ids"] == [1, 14, 27] and raw["num_target_layers"] == 30
    assert as_reference_fields(config_from_json(raw)) == reference_reads(raw)


@pytest.mark.parametrize("depth, draft_layers", [(30, 1), (30, 2), (30, 3), (30, 5), (36, 5), (8, 4), (28, 6)])
def test_missing_target_layer_ids_default_as_the_reference_does(depth, draft_layers):
    raw = zlab_config() | {"num_target_layers": depth, "num_hidden_layers": draft_layers}
    del raw["dflash_config"]["target_layer_ids"]
    want = reference_layer_ids(depth, draft_layers)
    assert list(config_from_json(raw).target_layer_ids) == want
    del raw["num_target_layers"]  # an older config: the target's layer count comes from the target
    assert list(config_from_json(raw, num_target_layers=depth).target_layer_ids) == want


def test_the_target_layer_count_is_checked_and_needed_for_default_ids():
    raw = zlab_config()
    with pytest.raises(TreeserveError, match="made for a target of 8 layers; this one has 30"):
        config_from_json(raw, num_target_layers=30)
    with pytest.raises(TreeserveError, match="reads target layer 5, but the target has 4"):
        config_from_json(raw | {"num_target_layers": 4})
    del raw["num_target_layers"], raw["dflash_config"]["target_layer_ids"]
    with pytest.raises(TreeserveError, match="needs dflash_config.target_layer_ids or num_target_layers"):
        config_from_json(raw)


# ------------------------------------------------------------------------------- drafting inside the engine

from random_targets import ENGINE_FAMILIES, random_dflash_drafter, random_target, target_features, word_tokenizer  # noqa: E402,E501
from treeserve.params import GenerationParams  # noqa: E402
from treeserve.verifier import Generation, generate  # noqa: E402

VOCAB = 64  # random_dflash_drafter's mask token is VOCAB - 1 of the target it is given


@pytest.mark.parametrize("tree", ["chain", "ddtree", "merged"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_dflash_speculation_is_lossless(family, tree):
    """DFlash trees, and prompt lookup merged with them (`--drafter merged`), change no token."""
    from treeserve.drafter.merged import MergedDrafter

    target = random_target(family, seed=3, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    for prompt in ([1, 2, 3, 4, 5], [7, 7, 9, 7, 7, 9, 7]):
        plain = generate(target, tokenizer, prompt, params).token_ids
        for budget in (1, 5, 16):
            drafter = (MergedDrafter(random_dflash_drafter(target, "ddtree")) if tree == "merged"
                       else random_dflash_drafter(target, tree))
            result = generate(target, tokenizer, prompt, params, drafter, budget)
            assert result.token_ids == plain, (prompt, budget)


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_a_batch_of_requests_drafts_what_each_would_alone(tree):
    """Requests of many context lengths, extended round by round (a round's context rows written inside the
    next block forward, or before it when there are more than a block of them) and proposed together in
    chunks of max_batch, get the trees each gets alone: the best tree of its budget from its own block
    distributions, its context written from scratch by the model's extend_context."""
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.drafter.trees import ddtree_from_distributions

    target = random_target("qwen3", seed=8, vocab_size=VOCAB, weight_scale=2.0)
    model = random_dflash_drafter(target, tree, seed=2).model
    block = model.config.block_size
    together = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, tree, max_batch=2)
    alone = DFlashDrafter(model, target.model.embed_tokens.weight, target.lm_head.weight, tree, max_batch=1)
    rng = random.Random(3)
    # Prompts of fewer and of more rows than a block; then rounds that add 1 .. block tokens.
    histories = [[rng.randrange(VOCAB - 1) for _ in range(length)] for length in (2, block, 3 * block, 40, 5)]
    budgets = [0, 1, 7, 30, 128]
    contexts = [together.new_context() for _ in histories]
    added = [[] for _ in histories]
    for round_number in range(3):
        for context, tokens, new in zip(contexts, histories, added):
            # Features of the tokens that entered the target's KV since: all but the newest (the next root).
            features = target_features(target, tokens[:-1], (0, 1))[max(len(context.tokens) - 1, 0):]
            together.extend(context, new if context.tokens else tokens, features)
        trees = together.propose(contexts, budgets)
        for tokens, budget, tree_got in zip(histories, budgets, trees):
            own = alone.new_context()
            own.tokens = list(tokens)
            model.extend_context(own.sequence, target_features(target, tokens[:-1], (0, 1)))
            roots, log_probs = alone.block_log_probs([own])
            assert tree_got == alone.propose([own], [budget])[0], (round_number, len(tokens))
            if tree == "ddtree":
                assert tree_got == ddtree_from_distributions(roots, log_probs, [budget])[0]
            assert tree_got.size - 1 == min(budget, block - 1 if tree == "chain" else budget)
            alone.release(own)
        for tokens, new in zip(histories, added):  # the next round's accepted tokens
            new[:] = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, block))]
            tokens += new
    for context in contexts:
        together.release(context)
    assert together.pool.allocator.free_count == together.pool.allocator.num_blocks
    with pytest.raises(TreeserveError, match="budgets must be between 0 and 128"):
        together.propose(contexts[:1], [129])


def test_each_round_searches_at_the_narrowest_width_that_holds_its_budgets_and_gets_the_widest_trees():
    """Widths are the powers of two from 16 up to the widest tree (and it); a round takes the narrowest that holds
    its largest budget, and every width that holds the budgets gives the widest's trees."""
    from treeserve.drafter.dflash import DFlashDrafter
    from treeserve.drafter.trees import unpack_trees

    target = random_target("qwen3", seed=8, vocab_size=VOCAB, weight_scale=0.5)  # flat: wide trees, near-ties
    drafter = random_dflash_drafter(target, "ddtree", seed=2)
    assert drafter.tree_widths == [16, 32, 64, 128]
    assert [drafter.width_for(b) for b in (0, 1, 16, 17, 64, 100, 128)] == [16, 16, 16, 32, 64, 128, 128]
    model, head = drafter.model, (target.model.embed_tokens.weight, target.lm_head.weight)
    assert DFlashDrafter(model, *head, "ddtree", max_budget=40).tree_widths == [16, 32, 40]
    assert DFlashDrafter(model, *head, "chain").tree_widths == [model.config.block_size - 1]
    rng = random.Random(4)
    contexts = []
    for length in (2, 9, 40):
        tokens = [rng.randrange(VOCAB - 1) for _ in range(length)]
        contexts.append(drafter.new_context())
        drafter.extend(contexts[-1], tokens, target_features(target, tokens[:-1], (0, 1)))
    roots = [context.tokens[-1] for context in contexts]
    for largest in (1, 5, 16, 17, 32, 50, 64, 128):
        budgets = [largest] + [rng.randint(0, largest) for _ in contexts[1:]]
        log_probs = drafter._run_block(contexts, budgets)
        widest = unpack_trees(roots, drafter._trees(log_probs, 128).tolist())
        assert [tree.size - 1 for tree in widest] == budgets
        for width in [w for w in drafter.tree_widths if w >= largest]:
            assert unpack_trees(roots, drafter._trees(log_probs, width).tolist()) == widest, (largest, width)
        assert drafter.propose(contexts, budgets) == widest
    for context in contexts:
        drafter.release(context)


def test_a_context_that_outgrows_the_drafter_pool_continues_without_trees():
    """In-process: a pool of 32 context tokens fills after a few rounds; the generation then decodes plainly,
    with the target's own tokens, and the drafter's blocks all come back."""
    from treeserve.drafter.dflash import DFlashDrafter

    target = random_target("qwen2", seed=9, vocab_size=VOCAB, weight_scale=2.0)
    small = random_dflash_drafter(target, "chain")
    drafter = DFlashDrafter(small.model, small.embedding, small.lm_head, "chain", max_batch=1, kv_cache_tokens=32)
    prompt, params = [3, 4, 5, 3, 4, 5, 3], GenerationParams(max_new_tokens=60, ignore_eos=True)
    generation = Generation(target, word_tokenizer(VOCAB), prompt, params, drafter, budget=4)
    while not generation.finished:
        generation.step()
    assert generation.drafter is None  # it let go of the drafter once the pool was full
    assert generation.result().token_ids == generate(target, word_tokenizer(VOCAB), prompt, params).token_ids
    assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks


def test_the_drafter_context_holds_the_target_features_of_every_committed_token_but_the_root():
    target = random_target("qwen3", seed=4, vocab_size=VOCAB, weight_scale=2.0)
    drafter = random_dflash_drafter(target, "ddtree")
    generation = Generation(target, word_tokenizer(VOCAB), [5, 6, 7, 5, 6], GenerationParams(max_new_tokens=20),
                            drafter, budget=8)
    while not generation.finished and len(generation.output_ids) < 12:
        generation.step()
    context = generation.draft_context
    tokens = generation.prompt_ids + generation.output_ids
    assert context.tokens == tokens and context.sequence.length == len(tokens) - 1
    drafter.write_context()  # the last round's rows wait for the next block forward
    fresh = drafter.pool.sequence()
    drafter.model.extend_context(fresh, target_features(target, tokens[:-1], (0, 1)))
    flat = drafter.pool.data.flatten(2, 3)  # (keys/values, layers, slots, kv heads, head dim)
    torch.testing.assert_close(flat[:, :, context.sequence.slots(0, fresh.length)],
                               flat[:, :, fresh.slots(0, fresh.length)], atol=1e-5, rtol=1e-5)
    fresh.release()
    generation.release()
    assert drafter.pool.allocator.free_count == drafter.pool.allocator.num_blocks  # every block came back


def test_a_round_stages_up_to_two_blocks_of_context_rows_and_writes_more_eagerly(monkeypatch):
    """A round's new context rows (a merged tree's long accepted path) go through the block forward's staged inputs
    up to STAGED_BLOCKS blocks a request, and are written eagerly first beyond that (a prompt): either way the
    context holds what a fresh write of those rows holds."""
    from treeserve.drafter.dflash import STAGED_BLOCKS

    target = random_target("qwen3", seed=4, vocab_size=VOCAB, weight_scale=2.0)
    drafter = random_dflash_drafter(target, "ddtree")
    block, layer_ids = drafter.model.config.block_size, drafter.feature_layer_ids
    eager, write = [], drafter.write_context
    monkeypatch.setattr(drafter, "write_context", lambda contexts=None: (eager.append(len(contexts)), write(contexts)))
    ids = [(7 * i) % (VOCAB - 2) + 1 for i in range(STAGED_BLOCKS * block + 3)]
    for rows in (block + 2, STAGED_BLOCKS * block, STAGED_BLOCKS * block + 1):
        context, eager[:] = drafter.new_context(), []
        drafter.extend(context, ids[:rows + 1], target_features(target, ids[:rows], layer_ids))
        drafter.propose([context], [4])
        assert eager == [1 if rows > STAGED_BLOCKS * block else 0], rows
        fresh = drafter.pool.sequence()
        drafter.model.extend_context(fresh, target_features(target, ids[:rows], layer_ids))
        flat = drafter.pool.data.flatten(2, 3)
        torch.testing.assert_close(flat[:, :, context.sequence.slots(0, rows)], flat[:, :, fresh.slots(0, rows)],
                                   atol=1e-5, rtol=1e-5)
        fresh.release()
        drafter.release(context)


def test_oracle_block_distributions_give_long_accepted_paths_and_the_same_tokens(monkeypatch):
    """With block distributions peaked on the target's own continuation, trees hold the accepted path:
    rounds shrink, output stays the target's."""
    target = random_target("llama", seed=5, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    prompt, params = [3, 1, 4, 1, 5], GenerationParams(max_new_tokens=30, ignore_eos=True)
    plain = generate(target, tokenizer, prompt, params).token_ids
    truth = prompt + plain
    drafter = random_dflash_drafter(target, "ddtree")
    real = drafter.row_log_probs
    block = drafter.model.config.block_size

    def oracle(rows):
        log_probs = real(rows).clone()
        for row, position in enumerate(rows.positions.tolist()):
            if row % block and position < len(truth):  # a drafted position (the root's row is committed)
                log_probs[row, truth[position]] = 0.0  # the likeliest token by far
        return log_probs

    monkeypatch.setattr(drafter, "row_log_probs", oracle)
    result = generate(target, tokenizer, prompt, params, drafter, budget=8)
    assert result.token_ids == plain
    assert result.mean_accepted > 4


def test_a_config_without_the_target_layer_count_takes_the_targets(tmp_path):
    """Checkpoints written before the count was recorded load for a target, which gives it, and save with it."""
    from treeserve.drafter.dflash import DFlashDrafter

    target = random_target("qwen3", seed=4, vocab_size=VOCAB)
    save_dflash(random_dflash_drafter(target, "chain").model, tmp_path / "old", dtype=torch.float32)
    written = json.loads((tmp_path / "old" / "config.json").read_text())
    assert written["num_target_layers"] == target.config.num_layers
    (tmp_path / "old" / "config.json").write_text(json.dumps({k: v for k, v in written.items()
                                                             if k != "num_target_layers"}))
    with pytest.raises(TreeserveError, match="layer count"):
        save_dflash(load_dflash(tmp_path / "old"), tmp_path / "again")
    drafter = DFlashDrafter.for_target(tmp_path / "old", target, "chain")
    save_dflash(drafter.model, tmp_path / "again", dtype=torch.float32)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == written


def test_generate_command_with_a_dflash_checkpoint(tmp_path, capsys):
    import tiny_models
    from treeserve.cli import main
    from treeserve.loading import load_target

    target_path = tiny_models.write_hf_folder("qwen3", tmp_path / "target", seed=0)
    target = load_target(str(target_path))
    save_dflash(random_dflash_drafter(target.model, "ddtree").model, tmp_path / "drafter", dtype=torch.float32)
    draft_path = tiny_models.write_hf_folder("qwen3", tmp_path / "draft", seed=1)  # same tokenizer, other weights
    common = ["generate", "--target", str(target_path), "--prompt", "the cat sat on the mat", "--max-new-tokens",
              "20", "--json"]
    outputs = {}
    for name, extra in [("none", ["--drafter", "none"]),
                        ("chain", ["--drafter", "dflash", "--drafter-path", str(tmp_path / "drafter"), "--tree", "chain"]),
                        ("ddtree", ["--drafter", "dflash", "--drafter-path", str(tmp_path / "drafter")]),
                        ("model", ["--drafter", "model", "--drafter-path", str(draft_path)])]:
        assert main(common + extra) == 0
        outputs[name] = json.loads(capsys.readouterr().out)
    assert (outputs["chain"]["token_ids"] == outputs["ddtree"]["token_ids"] == outputs["model"]["token_ids"]
            == outputs["none"]["token_ids"])
    assert outputs["ddtree"]["tree"] == "ddtree" and outputs["ddtree"]["rounds"] > 0
    assert main(common + ["--drafter", "dflash"]) == 1
    assert "--drafter-path" in capsys.readouterr().err


def test_acceptance_bench_reports_every_configuration_lossless(tmp_path, capsys):
    import tiny_models
    from treeserve.bench.acceptance_bench import main
    from treeserve.loading import load_target

    target_path = tiny_models.write_hf_folder("llama", tmp_path / "target", seed=1)
    save_dflash(random_dflash_drafter(load_target(str(target_path)).model, "ddtree").model, tmp_path / "drafter",
                dtype=torch.float32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the cat sat on the mat"}\n{"prompt": "def f(x):", "chat": true}\n')
    out = tmp_path / "results.json"
    assert main(["--target", str(target_path), "--drafter-path", str(tmp_path / "drafter"), "--prompts",
                 str(prompts), "--budgets", "2,8", "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["drafter"], r["budget"]) for r in rows] == [
        ("ngram", 2), ("ngram", 8), ("dflash chain", 2), ("dflash chain", 8), ("dflash ddtree", 2),
        ("dflash ddtree", 8), ("merged", 2), ("merged", 8)]
    assert all(r["identical_to_plain"] == 2 and r["mean_accepted"] >= 1.0 for r in rows)
    assert "| dflash ddtree | 8 |" in capsys.readouterr().out
    # Without --drafter-path a DFlash drafter is the target's shipped one; this target has none: a clear error,
    # not a table without its rows.
    common = ["--target", str(target_path), "--prompts", str(prompts), "--budgets", "2", "--max-new-tokens", "4"]
    assert main(common + ["--drafters", "ngram,ddtree"]) == 1
    assert "no DFlash drafter ships for target" in capsys.readouterr().err
    assert main(common + ["--drafters", "ngram"]) == 0


# ---------------------------------------------------------------------------------- the draft-model drafter

from treeserve.drafter.draft_model import DraftModelDrafter  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_draft_model_drafting_is_lossless(family):
    target = random_target(family, seed=6, vocab_size=VOCAB, weight_scale=2.0)
    draft = random_target(family, seed=7, vocab_size=VOCAB, weight_scale=2.0)  # another model, same vocabulary
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    for prompt in ([1, 2, 3, 4, 5], [7, 7, 9, 7, 7, 9, 7]):
        plain = generate(target, tokenizer, prompt, params).token_ids
        for budget in (1, 6, 20):
            result = generate(target, tokenizer, prompt, params, DraftModelDrafter(draft, top_k=3, width=4), budget)
            assert result.token_ids == plain, (prompt, budget)


def test_the_target_as_its_own_draft_model_is_accepted_whole():
    """Drafting with the target itself puts the target's greedy path in every tree: each round accepts the
    tree's full depth."""
    target = random_target("llama", seed=8, vocab_size=VOCAB, weight_scale=2.0)
    tokenizer = word_tokenizer(VOCAB)
    params = GenerationParams(max_new_tokens=30, ignore_eos=True)
    plain = generate(target, tokenizer, [3, 1, 4], params).token_ids
    result = generate(target, tokenizer, [3, 1, 4], params, DraftModelDrafter(target, top_k=2, width=2), 12)
    assert result.token_ids == plain
    assert result.mean_accepted > 5  # a 12-node tree of width 2 is 6 levels deep: 7 tokens a round at best


def test_draft_model_trees_respect_budget_and_width():
    target = random_target("qwen2", seed=9, vocab_size=VOCAB)
    drafter = DraftModelDrafter(target, top_k=3, width=2)
    contexts = [drafter.new_context() for _ in range(3)]
    for context, tokens in zip(contexts, ([1, 2, 3], [4, 5], [6, 7, 8, 9])):
        drafter.extend(context, tokens)
    trees = drafter.propose(contexts, [0, 5, 9])
    for tree, budget, context in zip(trees, [0, 5, 9], contexts):
        tree.validate(VOCAB)
        assert tree.tokens[0] == context.tokens[-1] and tree.size == budget + 1
        depths = tree.depths()
        assert all(depths.count(d) <= 2 for d in range(1, max(depths) + 1))
    assert contexts[2].cache.length == 3  # the committed tokens but the root


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path):
    import tiny_models

    draft_path = tiny_models.write_hf_folder("llama", tmp_path / "draft", seed=0)
    with pytest.raises(TreeserveError, match="tokenizer"):
        DraftModelDrafter.load(str(draft_path), "cpu", "float32", word_tokenizer(VOCAB))
