"""The GPU benches run end to end on the CPU with tiny shapes, so they cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os

import pytest

import tiny_models


def test_graph_bench_on_the_cpu(tmp_path):
    from treeserve.bench.graph_bench import main

    out = tmp_path / "graph.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--tree-sizes",
                 "1,5", "--context", "40", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["verification"]
    assert [(r["batch"], r["tree_nodes"]) for r in rows] == [(1, 1), (1, 5), (2, 1), (2, 5)]
    assert all(r["ms"] > 0 and r["graphs"] is False for r in rows)
    assert report["command"].startswith("python -m treeserve.bench.graph_bench --shape tiny")
    assert all("device_us_by_kernel" not in r for r in rows)  # profiling is asked for with --kernels

    assert main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1", "--tree-sizes", "5",
                 "--context", "40", "--repeats", "2", "--kernels", "3", "--out", str(out)]) == 0
    row, = json.loads(out.read_text())["verification"]
    assert row["device_us"] == 0 and row["device_us_by_kernel"] == {}  # no device work on the CPU


def test_device_time_by_name_ranks_a_calls_kernels():
    """Per call, the longest names first, the rest summed apart."""
    from treeserve.round_traces import device_time_by_name

    work = [("gemm", 30.0), ("attention", 12.0), ("gemm", 30.0), ("norm", 2.0), ("copy", 1.0), ("attention", 12.0)]
    assert device_time_by_name(work, calls=2, top=2) == {"gemm": 30.0, "attention": 12.0, "(the rest)": 1.5}
    assert list(device_time_by_name(work, calls=2, top=5)) == ["gemm", "attention", "norm", "copy"]


@pytest.mark.slow
def test_stack_bench_on_the_cpu(tmp_path):
    """Two prompts through the three services, plain then n-gram: identical outputs and phases per round."""
    from treeserve.bench.stack_bench import main

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"one two three {i} one two three {i}", "chat": False})
                                 for i in range(2)))
    out = tmp_path / "stack.json"
    assert main(["--target", str(target), "--device", "cpu", "--dtype", "float32", "--graphs", "off",
                 "--drafters", "ngram", "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "12",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["drafter"] for r in rows] == ["none", "ngram"]
    assert rows[1]["identical_to_plain"] == "2/2"
    assert {"verify", "round"} <= set(rows[0]["round_ms"]) and "draft" in rows[1]["round_ms"]


def test_projection_follows_its_formula_and_never_loses_to_plain(tmp_path):
    """The projection from a graph_bench and an acceptance_bench report written here: every cell as its formula
    says, eager rows and failed cells ignored, and the adaptive choice plain decoding where trees do not pay (a
    compute-bound batch of 64) and never below it."""
    from treeserve.bench.projection import main
    from treeserve.verifier.graphs import TREE_BUCKETS

    def verify_ms(batch: int, nodes: int) -> float:  # a fixed cost plus one that grows with the rows verified
        return 5.0 + 0.05 * batch * nodes

    batches, nodes = (1, 4, 16, 64), [n for n in TREE_BUCKETS if n <= 65]
    rows = [{"batch": b, "tree_nodes": n, "context": 1024, "ms": verify_ms(b, n), "graphs": True}
            for b in batches for n in nodes]
    rows += [{"batch": 1, "tree_nodes": 17, "context": 1024, "ms": 0.001, "graphs": False},  # eager: not a cost
             {"batch": 4, "tree_nodes": 129, "context": 1024, "graphs": True, "error": "out of memory"}]
    costs = tmp_path / "graph-bench.json"
    costs.write_text(json.dumps({"shape": "llama3-8b", "verification": rows}))
    accepted = {"ngram": 2.0, "dflash chain": 3.0, "dflash ddtree": 4.5}  # tokens per round at budget 8
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps({"rows": [
        {"drafter": drafter, "budget": budget, "mean_accepted": tokens + 0.25 * i}
        for drafter, tokens in accepted.items() for i, budget in enumerate((8, 16, 32, 64))]}))
    out = tmp_path / "projection.json"
    assert main(["--costs", str(costs), "--acceptance", str(acceptance), "--drafter-ms", "ngram=0.84",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["projection"] is True and report["command"].startswith("python -m treeserve.bench.projection")
    cell = {(r["batch"], r["drafter"], r["budget"]): r for r in report["rows"] if not r.get("adaptive")}
    row = cell[(1, "ngram", 16)]
    assert row["round_ms"] == pytest.approx(verify_ms(1, 17) + 0.84, abs=1e-3)
    assert row["speedup"] == pytest.approx(row["tokens_per_round"] / row["round_ms"] * verify_ms(1, 1), abs=1e-3)
    assert cell[(1, "dflash-chain", 16)]["round_ms"] == pytest.approx(verify_ms(1, 17), abs=1e-3)  # no drafter ms
    assert cell[(4, "ngram", 64)]["round_ms"] == pytest.approx(verify_ms(4, 65) + 0.84, abs=1e-3)
    adaptive = {(r["batch"], r["drafter"]): r for r in report["rows"] if r.get("adaptive")}
    assert set(adaptive) == {(b, d) for b in batches for d in ("ngram", "dflash-chain", "dflash-ddtree")}
    assert all(r["tokens_per_s"] >= r["plain_tokens_per_s"] for r in adaptive.values())
    assert adaptive[(1, "ngram")]["budget"] > 0 and adaptive[(64, "ngram")]["budget"] == 0
    assert adaptive[(64, "ngram")]["speedup"] == 1.0


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_transformers_baseline_on_the_cpu(tmp_path, fmt):
    """transformers' generate on treeserve's weights (a GGUF too): the same greedy tokens as treeserve."""
    from treeserve.bench.transformers_baseline import main

    target = (tiny_models.write_hf_folder("llama", tmp_path / "model", seed=0) if fmt == "hf"
              else tiny_models.write_gguf("qwen3", tmp_path / "model.gguf", seed=0))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the cat sat on the mat and the cat",
                                                                      "one two three one two three"]))
    out = tmp_path / "baseline.json"
    assert main(["--target", str(target), "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "12",
                 "--device", "cpu", "--dtype", "float32", "--compare", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["greedy", "prompt-lookup"]
    assert all(r["identical_to_treeserve_greedy"] == "2/2" and r["tokens"] == 24 for r in rows)


@pytest.mark.slow
@pytest.mark.real_model
def test_draft_profile_on_the_cpu(tmp_path):
    """The DFlash round profile, one round of one request with the shipped drafter: every step timed, its host
    steps split (and their functions unwrapped after), and its proposals traced."""
    from treeserve.bench.draft_profile import DEVICE_STEPS, LAUNCH_STEPS, STEPS, main
    from treeserve.drafter.dflash import RoundInputs
    from treeserve.models import graphs

    originals = (RoundInputs.stage, graphs._stage_into, graphs.TreeRows.copy_into)

    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--dtype", "float32", "--batches", "1", "--max-budgets", "8", "--budget", "8",
                 "--context", "20", "--repeats", "1", "--trace", str(tmp_path / "traces"), "--trace-rounds", "3",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (row["max_budget"], row["batch"]) == (8, 1)
    assert all(row["ms"][step] > 0 for step in STEPS)
    assert all(row["ms"][step] == 0.0 for step in DEVICE_STEPS + LAUNCH_STEPS)
    split = row["ms"]
    assert 0 < split["split_inputs_stage"] + split["split_rows_stage"] < split["split_propose"]
    assert (RoundInputs.stage, graphs._stage_into, graphs.TreeRows.copy_into) == originals
    timeline = row["ms"]["timeline"]  # (on the CPU, no device work)
    assert timeline["rounds"] == 3 and timeline["host_ms"] > 0 and timeline["device_busy_ms"] == 0
    assert (tmp_path / "traces" / "trace-max8-batch1.json.gz").is_file()


def test_a_proposals_timeline_from_its_trace():
    """Per "propose" span: its host length, the device's busy time (overlaps counted once, work launched inside
    it even where it runs past its end), when that work began and ended, and the runtime calls inside it."""
    from treeserve.round_traces import timeline_medians, timeline_of

    def event(cat, name, ts, dur):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [event("user_annotation", "propose", 100, 300),
              event("cuda_runtime", "cudaGraphLaunch", 150, 20), event("cuda_runtime", "cudaGraphLaunch", 200, 10),
              event("cuda_runtime", "cudaStreamSynchronize", 250, 140),
              event("kernel", "block", 180, 100), event("kernel", "overlapping", 250, 60),
              event("gpu_memcpy", "trees", 330, 10),
              event("user_annotation", "propose", 1000, 100), event("kernel", "late", 1150, 50),
              event("cuda_runtime", "cudaGraphLaunch", 1020, 10), event("cuda_runtime", "outside", 1200, 5)]
    first, second = timeline_of(events, "propose")
    assert first["host_ms"] == 0.3 and first["device_busy_ms"] == 0.14
    assert (first["device_first_ms"], first["device_last_ms"]) == (0.08, 0.24)
    assert first["runtime_ms"] == pytest.approx({"cudaGraphLaunch": 0.03, "cudaStreamSynchronize": 0.14})
    assert second["device_busy_ms"] == 0.05 and second["device_last_ms"] == 0.2
    assert second["runtime_ms"] == {"cudaGraphLaunch": 0.01}
    medians = timeline_medians([first, second])
    assert medians["rounds"] == 2 and medians["host_ms"] == 0.2
    assert medians["runtime_ms"] == {"cudaGraphLaunch": 0.02, "cudaStreamSynchronize": 0.07}


def test_round_ways_on_the_cpu(tmp_path):
    """A plain step in process, through the scheduler, behind gRPC and through the three services, on a tiny
    target: each way timed."""
    from treeserve.bench.round_ways import WAYS, main

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    out = tmp_path / "round-ways.json"
    assert main(["--target", str(target), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "6",
                 "--requests", "2", "--turns", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert all(len(report["ms_a_token"][way]) == 1 and report["ms_a_token"][way][0] > 0 for way in WAYS)
    assert report["share_of_in_process"]["in_process"] == 1.0


def test_round_ways_times_a_drafters_rounds(tmp_path):
    """With --drafter, its rounds in process and through the services, ms a round each."""
    from treeserve.bench.round_ways import DRAFTED_WAYS, main

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    out = tmp_path / "round-ways.json"
    assert main(["--target", str(target), "--device", "cpu", "--dtype", "float32", "--drafter", "ngram",
                 "--budget", "4", "--max-new-tokens", "8", "--requests", "2", "--turns", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["drafter"], report["budget"]) == ("ngram", 4)
    assert all(report["ms_a_round"][way][0] > 0 for way in DRAFTED_WAYS)


def test_round_ways_refuses_a_way_a_drafter_does_not_run(capsys):
    from treeserve.bench.round_ways import main

    with pytest.raises(SystemExit):
        main(["--drafter", "ngram", "--ways", "scheduler"])
    assert "--ways: scheduler" in capsys.readouterr().err


def test_tree_round_on_the_cpu(tmp_path):
    """The verifier's host work in plain and tree rounds on a tiny target, phase by phase, the device stubbed."""
    from treeserve.bench.tree_round import PHASES, main

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    out = tmp_path / "tree-round.json"
    assert main(["--target", str(target), "--batches", "1,3", "--budgets", "0,8", "--feature-layers", "0,1",
                 "--context", "8", "--rounds", "4", "--warm-up", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(row["budget"], row["batch"]) for row in report["rows"]] == [(0, 1), (0, 3), (8, 1), (8, 3)]
    assert all(row["us"][phase] > 0 for row in report["rows"] for phase in ("plan", "forward", "commit", "emit"))
    assert all(row["us"]["total"] >= max(row["us"][phase] for phase in PHASES) for row in report["rows"])
    assert report["command"].startswith("python -m treeserve.bench.tree_round --target")
    # Plain rounds that keep features (in the pool).
    assert main(["--target", str(target), "--batches", "3", "--budgets", "0", "--plain-keeps", "--feature-layers",
                 "0,1", "--context", "8", "--rounds", "40", "--warm-up", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["plain_keeps"] and [(row["budget"], row["batch"]) for row in report["rows"]] == [(0, 3)]
    assert report["rows"][0]["us"]["total_mean"] > 0


def test_draft_round_on_the_cpu(tmp_path):
    """The drafter service's host work a round, phase by phase, for both DFlash drafters, the device stubbed."""
    import torch

    from random_targets import random_dflash_drafter
    from treeserve.bench.draft_round import PHASES, main
    from treeserve.drafter.dflash import save_dflash
    from treeserve.loading import load_target

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    save_dflash(random_dflash_drafter(load_target(str(target)).model, "ddtree").model, tmp_path / "drafter",
                dtype=torch.float32)
    out = tmp_path / "draft-round.json"
    assert main(["--target", str(target), "--drafter-path", str(tmp_path / "drafter"), "--dtype", "float32",
                 "--batches", "1,3", "--budget", "8", "--context", "12", "--rounds", "5", "--warm-up", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(row["drafter"], row["batch"]) for row in report["rows"]] == [
        ("merged", 1), ("merged", 3), ("dflash", 1), ("dflash", 3)]
    assert all(row["rounds"] == 5 for row in report["rows"])
    assert all(row["us"][phase] > 0 for row in report["rows"] for phase in PHASES)
    assert all(row["us"]["total"] >= max(row["us"][phase] for phase in PHASES) for row in report["rows"])


@pytest.mark.slow
def test_service_profile_on_the_cpu(tmp_path):
    """A second of each mode through the three services: tokens, the verifier's phases, and (where py-spy is
    installed) each service's sampled threads."""
    import shutil

    from treeserve.bench.service_profile import main

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three one two three", "chat": False}))
    assert main(["--target", str(target), "--drafter", "ngram", "--prompts", str(prompts), "--concurrency", "2",
                 "--seconds", "1", "--max-new-tokens", "16", "--out-dir", str(tmp_path / "out")]) == 0
    runs = json.loads((tmp_path / "out" / "profile.json").read_text())["runs"]
    assert [(run["mode"], run["concurrency"]) for run in runs] == [("plain", 2), ("speculative", 2)]
    assert all(run["tokens_per_s"] > 0 and run["rounds"] > 0 and "verify" in run["round_ms"] for run in runs)
    assert "draft" in runs[1]["round_ms"]
    if shutil.which("py-spy"):
        assert all(run["services"]["verifier"] for run in runs)


def test_service_profile_traces_rounds_under_torchs_profiler(tmp_path):
    """With --torch-trace, the verifier traces its rounds in both modes and the drafter its rounds when they
    draft: each run holds their timelines, and the traces are kept beside it."""
    from treeserve.bench.service_profile import main
    from treeserve.round_traces import TRACE_DIR_ENV, TRACED_ROUNDS

    target = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three one two three", "chat": False}))
    out = tmp_path / "out"
    assert main(["--target", str(target), "--drafter", "ngram", "--prompts", str(prompts), "--concurrency", "2",
                 "--seconds", "2", "--max-new-tokens", "16", "--torch-trace", "--out-dir", str(out)]) == 0
    assert TRACE_DIR_ENV not in os.environ
    plain, speculative = json.loads((out / "profile.json").read_text())["runs"]
    assert set(plain["timelines"]) == {"verifier"} and set(speculative["timelines"]) == {"verifier", "drafter"}
    for timeline in (plain["timelines"]["verifier"], *speculative["timelines"].values()):
        assert 0 < timeline["rounds"] <= TRACED_ROUNDS and timeline["host_ms"] > 0
    assert sorted(path.name for path in out.glob("*-trace.json.gz")) == [
        "plain-c2-verifier-trace.json.gz", "speculative-c2-drafter-trace.json.gz",
        "speculative-c2-verifier-trace.json.gz"]


def test_round_traces_hold_the_rounds_between_arming_and_finishing(tmp_path):
    """Off until armed; then each round marked in the trace, written after its cap of rounds or when finished
    early (after the round under way), and off again."""
    import torch

    from treeserve.round_traces import RoundTraces, read_events, timeline_of

    def rounds(traces, count):
        for _ in range(count):
            with traces.round():
                torch.ones(4).add_(1)

    assert RoundTraces("test", folder="").round() is RoundTraces("test", folder="").round()  # (unset: nothing)
    traces = RoundTraces("test", folder=str(tmp_path), rounds=3)
    rounds(traces, 2)
    assert not list(tmp_path.iterdir())
    traces.arm()
    rounds(traces, 5)
    (first,) = tmp_path.iterdir()
    assert len(timeline_of(read_events(first))) == 3 and traces.profiler is None
    traces.arm()
    rounds(traces, 1)
    with traces.round():
        traces.finish()
    second = next(path for path in tmp_path.iterdir() if path != first)
    assert len(timeline_of(read_events(second))) == 2
    traces.finish()  # (none under way: nothing)
    assert len(list(tmp_path.iterdir())) == 2


def test_service_profile_reads_py_spy_stacks(tmp_path):
    from treeserve.bench.service_profile import summarize_stacks

    raw = tmp_path / "raw.txt"
    raw.write_text("thread (1): MainThread;run (a.py:1);commit (b.py:2) 3\n"
                   "thread (1): MainThread;run (a.py:1) 1\n"
                   "thread (2): worker;wait (c.py:3) 4\n")
    summary = summarize_stacks(raw)
    assert list(summary) == ["thread (1): MainThread", "thread (2): worker"]
    main = summary["thread (1): MainThread"]
    assert main["share"] == 0.5 and main["samples"] == 4
    assert main["own"] == [["commit (b.py:2)", 3], ["run (a.py:1)", 1]]
    assert main["inclusive"] == [["run (a.py:1)", 4], ["commit (b.py:2)", 3]]
    assert summarize_stacks(tmp_path / "missing.txt") == {}


def test_policy_replay_prices_fixed_trees_and_replays_the_policy(tmp_path):
    """A record where every own tree emits three tokens and lookup's one: fixed trees come out at exactly three
    tokens for twice a plain round's cost, and adaptive speculation, replayed over it, drafts nearly every round."""
    from types import SimpleNamespace

    from treeserve.bench.policy_replay import main, tokens_emitted

    tree = SimpleNamespace(size=4, tokens=[9, 1, 2, 5], parents=[-1, 0, 1, 0])  # root -> 1 -> 2, and root -> 5
    assert [tokens_emitted(tree, answer) for answer in ([1, 2, 3], [1, 7], [5], [4])] == [3, 2, 2, 1]
    length = 31  # 30 tokens after the first: ten rounds of three
    record = {"answer": list(range(length)), "own": {"16": [3] * length, "32": [3] * length}, "lookup": [1] * length}
    positions = tmp_path / "positions.json"
    positions.write_text(json.dumps([record] * 4))
    out = tmp_path / "replay.json"
    assert main(["--positions", str(positions), "--decays", "0.02", "--plain-ms", "1", "--tree-extra-ms", "0.5",
                 "--draft-ms", "0.5", "--catch-up-ms", "0", "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["fixed 32"]["speedup"] == 1.5 and rows["fixed 32"]["rounds"] == {"32": 40}
    adaptive = rows["adaptive, decay 0.02"]
    assert adaptive["rounds"].get("0", 0) <= 8 and 1.3 < adaptive["speedup"] <= 1.5
    # A request's first tree costs 10 ms more (its prompt): 120 tokens in 40 rounds of 2 ms and 40 ms of prompts.
    # Trees that must promise twice plain decoding's rate are played on first tries alone.
    assert main(["--positions", str(positions), "--decays", "0.02", "--margins", "1.0,2.0", "--plain-ms", "1",
                 "--tree-extra-ms", "0.5", "--draft-ms", "0.5", "--catch-up-ms", "0", "--prompt-ms", "10",
                 "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["fixed 32"]["speedup"] == 1.0
    at_par, at_twice = rows["adaptive, decay 0.02, margin 1.0"], rows["adaptive, decay 0.02, margin 2.0"]
    assert at_par["rounds"].get("0", 0) <= 8 and at_twice["rounds"]["0"] > 80
    # Each worked-out choice priced at 1 ms: a lone request's tree decisions reused for runs of 8 rounds work out
    # about one in nine, worked out every round all; the same rounds are played.
    assert main(["--positions", str(positions), "--decays", "0.02", "--reuses", "0,8", "--choice-ms", "1",
                 "--plain-ms", "1", "--tree-extra-ms", "0.5", "--draft-ms", "0.5", "--catch-up-ms", "0",
                 "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    never, runs = (rows[f"adaptive, decay 0.02, trees reused {reuse}"] for reuse in (0, 8))
    assert never["rounds"] == runs["rounds"] and never["speedup"] < 1.0 < 1.15 < runs["speedup"]
    # Plain rounds of a request that could draft priced 2 ms where plain decoding's cost 1: the policy, which
    # measures its plain rounds, drafts where at 1 ms it would not.
    assert main(["--positions", str(positions), "--decays", "0.02", "--margins", "2.0", "--plain-extra-ms", "1",
                 "--plain-ms", "1", "--tree-extra-ms", "0.5", "--draft-ms", "0.5", "--catch-up-ms", "0",
                 "--prompt-ms", "10", "--out", str(out)]) == 0
    dear_plain = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}["adaptive, decay 0.02, margin 2.0"]
    assert dear_plain["rounds"].get("0", 0) < 10 < at_twice["rounds"]["0"]


def test_round_log_splits_a_verifiers_debug_log_into_turns_and_kinds(tmp_path, capsys):
    """Rounds logged as the verifier logs them (RoundReport.log_line, with the services' time stamps), a plain turn
    then a speculative one: read back into those two turns, the speculative one's rounds by kind, its estimates
    beside what the rounds took; a log without round lines is one clear error."""
    import gzip

    from treeserve.bench.round_log import main
    from treeserve.verifier.drafter_link import DraftRound
    from treeserve.verifier.round import Choice, RequestReport, RoundReport

    def report(batch, choice, tokens, draft_ms, verify_ms, catch_up=False, prompts=False):
        drafts = [DraftRound({}, round_trip_s=draft_ms / 2e3, catch_up=catch_up)] if draft_ms else []
        return RoundReport(batch, choice, {}, drafts, with_prompts=prompts, draft_s=draft_ms / 1e3,
                           verify_s=verify_ms / 1e3, requests=[RequestReport(f"r{i}", tokens // batch)
                                                                for i in range(batch)])

    plain = [report(2, None, 2, 0, 3.0, prompts=True)] + [report(2, None, 2, 0, 1.0)] * 3
    tree = Choice(8, (6.0, 0.0025))
    # A round of prompts alone has no choice in a speculative turn either: it goes with the round after it.
    speculative = [report(2, Choice(0, (2.0, 0.001)), 2, 0, 1.0), report(2, tree, 6, 1.0, 1.5),
                   report(2, None, 2, 0, 3.0, prompts=True), report(2, tree, 4, 1.0, 2.0),
                   report(2, tree, 8, 4.0, 2.0, catch_up=True), report(2, Choice(4, (3.0, 0.002), lookup=True), 4,
                                                                          0.4, 1.2)]
    lines = [f"2026-12-07 10:00:{i:02d},000 treeserve.verifier DEBUG {round_.log_line()}\n"
             for i, round_ in enumerate(plain + speculative)]
    log = tmp_path / "verifier.log.gz"
    with gzip.open(log, "wt") as out:
        out.write("2026-12-07 09:59:59,000 treeserve.verifier INFO listening\n" + "".join(lines))
    out = tmp_path / "turns.json"
    assert main([str(log), "--min-rounds", "2", "--out", str(out)]) == 0
    first, second = json.loads(out.read_text())["logs"][0]["turns"]
    assert (first["mode"], first["rounds"], first["tokens"]) == ("plain", 4, 8)
    assert first["kinds"]["plain+prompts"]["rounds"] == 1 and first["rounds_ms"] == 6.0
    assert first["span_ms"] == 3000 + 1.0  # the first round's stamp to the last's, and the last round
    assert (second["mode"], second["rounds"], second["tokens"]) == ("speculative", 6, 26)
    assert set(second["kinds"]) == {"plain", "plain+prompts", "own", "own*", "lookup"}
    own = second["kinds"]["own"]
    assert (own["rounds"], own["tokens"], own["ms"]) == (2, 10, 5.5)
    assert own["expected"] == {"rounds": 2, "tokens": 6.0, "median_ms": 2.5}
    assert own["took"] == {"tokens": 5.0, "median_ms": 2.75}
    assert second["kinds"]["own*"]["median_drafters_ms"] == 2.0
    assert "expected" not in second["kinds"]["plain"]  # a plain choice's estimate is its own measure
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit):
        main([str(empty)])
    assert "no round lines" in capsys.readouterr().err
