"""`treeserve bench` against a real stack of the three services on a tiny model: every run completes, the
speculative outputs equal the plain ones request by request, the verifier's phases are read, and the JSON and
the plot are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tiny_models
from helpers import PROMPTS, SERVING, Services, health, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    model = tiny_models.write_hf_folder("qwen3", tmp_path_factory.mktemp("model"), seed=0)
    services = Services(tmp_path_factory.mktemp("run"), str(model))
    services.start_drafter()
    services.start_verifier()
    wait_for(lambda: health(services.verifier) == SERVING, what="the verifier")
    services.start_gateway(services.verifier)
    wait_for(lambda: health(services.gateway) == SERVING, what="the gateway")
    yield services
    services.stack.stop(grace_s=1)


def bench(services, out, *flags: str) -> dict:
    """`treeserve bench` run from the output's folder, outside the repository: the shipped workloads must come
    from the package, not from a path relative to the working directory."""
    done = subprocess.run([sys.executable, "-m", "treeserve", "bench", "--address", services.gateway, "--out",
                           str(out), "--quiet", *flags], capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out} and {out.with_suffix('.png')}" in done.stdout
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    return json.loads(out.read_text())


def test_greedy_runs_side_by_side(services, tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # the code workload's prompts are longer than the tiny model's context
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    report = bench(services, tmp_path / "greedy.json", "--prompts", str(prompts), "--concurrency", "1,3", "--requests",
                   "6", "--max-new-tokens", "12", "--budgets", "4,8", "--ignore-eos", "--no-warmup",
                   "--verifier-metrics", f"127.0.0.1:{services.verifier_metrics}")
    assert report["command"].startswith("treeserve bench --address")
    assert [(r["mode"], r["budget"], r["concurrency"]) for r in report["runs"]] == [
        ("plain", 0, 1), ("speculative", 4, 1), ("speculative", 8, 1),
        ("plain", 0, 3), ("speculative", 4, 3), ("speculative", 8, 3)]
    for row in report["runs"]:
        assert row["completed"] == 6 and row["errors"] == {} and row["output_tokens"] == 6 * 12
        each = row["by_request"]
        assert each["tokens"] == [12] * 6 and len(each["elapsed_s"]) == 6 and min(each["elapsed_s"]) > 0
        assert all(1 <= rounds <= 11 for rounds in each["rounds"])  # the prefill gives the first of the 12
        assert row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"] > 0
        assert row["tokens_per_s"] > 0 and "verify" in row["round_ms"] and "verify" in row["round_ms_p50"]
        assert row["saturated_tokens_per_s"] > 0  # more requests than workers: a stretch with all of them busy
        # Tokens per verifier round over the batch: one a round at one plain request (its prefill round gives
        # the first), at most a full batch of full trees.
        assert 0 < row["tokens_per_verifier_round"] <= row["concurrency"] * (row["budget"] + 1)
        assert 0 < row["mean_batch"] <= row["concurrency"]
        # Every run prefills its requests' prompts, in rounds apart from the decoding-only ones.
        assert 1 <= row["rounds_with_prompts"] < row["verifier_rounds"] and "round_with_prompts" in row["round_ms"]
        if row["mode"] == "plain":
            assert row["tokens_per_round"] == 1.0
            assert row["concurrency"] > 1 or row["tokens_per_verifier_round"] == row["mean_batch"] == 1.0
        else:
            assert row["identical_to_plain"] == "6/6" and row["tokens_per_round"] >= 1.0
            assert row["divergences"] == []  # what near_ties would check, were the outputs to part (bfloat16)
            assert "draft" in row["round_ms"] and row["speedup"] > 0


def test_sampled_chat_runs_are_lossless_too(services, tmp_path):
    # Request i samples with seed i in both modes, and a seed gives the same tokens with or without trees.
    # --requests 3 below the concurrency: each run still puts 4 requests in flight.
    report = bench(services, tmp_path / "chat.json", "--workload", "chat", "--concurrency", "4", "--requests", "3",
                   "--max-new-tokens", "10", "--temperature", "0.8")
    assert [r["mode"] for r in report["runs"]] == ["plain", "speculative"]
    assert [r["completed"] for r in report["runs"]] == [4, 4] and report["warmup"]  # warm-up runs not counted
    assert report["runs"][1]["saturated_tokens_per_s"] is None  # one wave: no stretch before the drain
    assert report["runs"][1]["identical_to_plain"] == "4/4"
    assert "divergences" not in report["runs"][1]  # greedy runs only: a sampled token's near-tie is another matter


def test_an_open_loop_sends_at_its_request_rate(services, tmp_path):
    """--request-rate: requests arrive on a seeded Poisson schedule, the same in both modes, each run as long as
    its last arrival at least; the runs are lossless and compared per request too."""
    import random

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    report = bench(services, tmp_path / "open.json", "--prompts", str(prompts), "--request-rate", "4,50",
                   "--requests", "6", "--max-new-tokens", "8", "--budgets", "4", "--ignore-eos", "--no-warmup",
                   "--verifier-metrics", f"127.0.0.1:{services.verifier_metrics}")
    assert [(r["mode"], r["request_rate"]) for r in report["runs"]] == [
        ("plain", 4.0), ("speculative", 4.0), ("plain", 50.0), ("speculative", 50.0)]
    for row in report["runs"]:
        arrivals = random.Random(0)
        last_arrival = sum(arrivals.expovariate(row["request_rate"]) for _ in range(5))
        assert row["wall_s"] >= last_arrival
        assert row["completed"] == 6 and row["errors"] == {} and row["output_tokens"] == 6 * 8
        assert "concurrency" not in row and row["saturated_tokens_per_s"] is None
        if row["mode"] == "speculative":
            assert row["identical_to_plain"] == "6/6" and row["per_request_speedup"] > 0


def test_repeats_take_turns_and_pair_each_turn(services, tmp_path):
    """--repeats: the modes take turns (plain first, then speculative first), each speculative run is compared with
    the plain run of its turn, and the summary gives the median ratio and its range."""
    report = bench(services, tmp_path / "turns.json", "--workload", "chat", "--concurrency", "2", "--requests", "2",
                   "--max-new-tokens", "6", "--budgets", "4", "--repeats", "3", "--no-warmup")
    assert [(r["mode"], r["turn"]) for r in report["runs"]] == [
        ("plain", 0), ("speculative", 0), ("speculative", 1), ("plain", 1), ("plain", 2), ("speculative", 2)]
    by_turn = {(r["mode"], r["turn"]): r for r in report["runs"]}
    ratios = []
    for turn in range(3):
        speculative, plain = by_turn["speculative", turn], by_turn["plain", turn]
        assert speculative["speedup"] == round(speculative["tokens_per_s"] / plain["tokens_per_s"], 3)
        assert speculative["identical_to_plain"] == "2/2"
        ratios.append(speculative["speedup"])
    assert by_turn["plain", 1]["identical_to_plain"] == "2/2"  # plain decoding repeats itself too
    [summary] = report["summary"]
    assert summary["concurrency"] == 2 and summary["budget"] == 4 and summary["turns"] == 3
    assert summary["speedup"] == sorted(ratios)[1] and summary["speedup_range"] == [min(ratios), max(ratios)]
    assert summary["identical_to_plain"] == "6/6"


def test_bench_stacks_tables_give_medians_and_ranges_over_turns(tmp_path):
    from treeserve.bench.load import ratio_summary
    from treeserve.bench.bench_stacks import render_tables

    def run(mode, turn, total, **extra):
        return {"mode": mode, "budget": 16 if mode == "speculative" else 0, "turn": turn, "concurrency": 4,
                "tokens_per_s": total, "per_request_tokens_per_s": total / 4, "saturated_tokens_per_s": None, **extra}

    runs = [run("plain", 0, 1000.0), run("speculative", 0, 950.0, speedup=0.95, identical_to_plain="16/16"),
            run("speculative", 1, 1030.0, speedup=1.01, identical_to_plain="16/16"), run("plain", 1, 1020.0),
            run("plain", 2, 990.0), run("speculative", 2, 1000.0, speedup=1.01, identical_to_plain="15/16")]
    [summary] = ratio_summary(runs)
    assert (summary["plain_tokens_per_s"], summary["tokens_per_s"], summary["speedup"]) == (1000.0, 1000.0, 1.01)
    assert summary["speedup_range"] == [0.95, 1.01] and summary["identical_to_plain"] == "47/48"
    (tmp_path / "ngram-code-t0.json").write_text(json.dumps({"runs": runs}))
    tables = render_tables(tmp_path, ["ngram"], ["code"], [0.0])
    assert "medians over 3 turns of each mode" in tables
    assert "| 4 | 1000 | 1000 (1.01x, 0.95-1.01, identical 47/48) |" in tables


def test_bad_flags_and_a_missing_gateway_are_one_line(tmp_path):
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "treeserve", "bench", *flags], capture_output=True, text=True,
                              timeout=120)

    done = run("--address", f"unix://{tmp_path}/none.sock", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 1 and done.stderr.startswith("treeserve bench: error: the gateway at")
    assert len(done.stderr.strip().splitlines()) == 1
    done = run("--address", "localhost:1", "--concurrency", "1,x")
    assert done.returncode == 2 and "expected comma-separated integers" in done.stderr
    done = run("--address", "localhost:1", "--request-rate", "2,fast")
    assert done.returncode == 2 and "expected comma-separated numbers" in done.stderr
    done = run("--address", "localhost:1", "--repeats", "0")
    assert done.returncode == 1 and "--repeats" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = run("--address", "localhost:1", "--request-rate", "0")
    assert done.returncode == 1 and done.stderr.strip() == (
        "treeserve bench: error: --request-rate must be positive requests a second")


def test_bench_stacks_tables_of_open_loops_compare_each_request(tmp_path):
    from treeserve.bench.bench_stacks import parse_args, render_tables

    def run(mode, rate, per_request, total, **extra):
        return {"mode": mode, "budget": 16 if mode == "speculative" else 0, "request_rate": rate,
                "per_request_tokens_per_s": per_request, "tokens_per_s": total, **extra}

    report = {"runs": [run("plain", 5.0, 329.0, 505.0),
                       run("speculative", 5.0, 472.0, 508.0, per_request_speedup=1.434, speedup=1.006,
                           identical_to_plain="48/48"),
                       run("plain", 20.0, 110.0, 1652.0),
                       run("speculative", 20.0, 134.0, 1616.0, per_request_speedup=1.218, speedup=0.978,
                           identical_to_plain="47/48")]}
    (tmp_path / "ngram-code-t0.json").write_text(json.dumps(report))
    tables = render_tables(tmp_path, ["ngram"], ["code"], [0.0])
    assert "each request's tok/s on average" in tables and "| requests a second | plain (ngram) | ngram |" in tables
    assert "| 5 | 329 [505] | 472 (1.43x) [508], identical 48/48 |" in tables
    assert "| 20 | 110 [1652] | 134 (1.22x) [1616], identical 47/48 |" in tables
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", str(tmp_path), "--request-rate", "0"])


def test_bench_stacks_makes_the_tables_in_one_command(tmp_path):
    # The n-gram stack on the tiny model (a DFlash drafter needs a checkpoint for its target): started, benched
    # at two concurrencies, stopped, and its row in tables.md.
    model = tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "tables"
    done = subprocess.run([sys.executable, "-m", "treeserve.bench.bench_stacks", "--out-dir", str(out), "--target",
                           str(model), "--drafters", "ngram", "--prompts", str(prompts), "--temperatures", "0",
                           "--concurrency", "1,2", "--requests", "3", "--max-new-tokens", "8", "--budget", "4",
                           "--metrics-port", "19481", "--up-flags", "--verifier-log-level DEBUG"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert " DEBUG " in (out / "runtime-ngram" / "verifier.log").read_text()  # --up-flags reached the service
    report = json.loads((out / "ngram-prompts-t0.json").read_text())
    assert [(r["mode"], r["concurrency"]) for r in report["runs"]] == [
        ("plain", 1), ("speculative", 1), ("plain", 2), ("speculative", 2)]
    assert all(r["identical_to_plain"] == "3/3" for r in report["runs"] if r["mode"] == "speculative")
    tables = (out / "tables.md").read_text()
    assert "### prompts, temperature 0" in tables and "| plain (ngram) | ngram |" in tables
    assert tables.count("identical 3/3") == 2
    assert not list((out / "runtime-ngram").glob("*.sock"))  # the stack was stopped
    bad = subprocess.run([sys.executable, "-m", "treeserve.bench.bench_stacks", "--out-dir", str(out),
                          "--drafters", "eagle"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--drafters: unknown eagle" in bad.stderr


def test_workloads_are_found_from_any_directory(tmp_path, monkeypatch):
    # The prompt sets ship in the package: `treeserve bench` outside the repository (or in the image) finds them.
    from treeserve.prompt_sets import WORKLOADS, read_prompts

    monkeypatch.chdir(tmp_path)
    for name, path in WORKLOADS.items():
        assert path.is_absolute() and read_prompts(path), name
