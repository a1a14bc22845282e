"""The three services with a verifier on two gloo ranks (--tp 2, CPU): the tokens of one rank; a rank that dies
takes the verifier down cleanly (its streams closed with UNAVAILABLE, the process gone, no hang); SIGTERM stops
every rank."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest

from helpers import PROMPTS, SERVING, Services, expected, health, request, run_all, scrape, wait_for
from treeserve.loading import load_target
from treeserve.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.slow


def follower_pids(parent: int) -> list[int]:
    """Processes `parent` started as tensor-parallel ranks (multiprocessing's spawned children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def services(tmp_path_factory, model_path):
    services = Services(tmp_path_factory.mktemp("run"), model_path)
    services.start_drafter()
    services.start_verifier("--tp", "2")
    wait_for(lambda: health(services.verifier) == SERVING, timeout_s=120, what="the verifier on two ranks")
    services.start_gateway(services.verifier)
    wait_for(lambda: health(services.gateway) == SERVING, what="the gateway")
    yield services
    services.stack.stop(grace_s=1)


def test_two_ranks_stream_the_tokens_of_one(services, model_path):
    target = load_target(model_path)
    results = run_all(services.gateway, [request(p, 30) for p in PROMPTS])
    for prompt, (tokens, _) in zip(PROMPTS, results):
        assert tokens == expected(target, prompt, 30)


def test_a_dflash_drafter_beside_two_ranks_gets_features_and_loses_nothing(tmp_path, model_path):
    """The features a DFlash drafter conditions on come from rank 0 alone, whole (after the all-reduces)."""
    import torch

    from random_targets import random_dflash_drafter
    from treeserve.drafter.dflash import save_dflash

    target = load_target(model_path)
    save_dflash(random_dflash_drafter(target.model, "ddtree").model, tmp_path / "dflash", dtype=torch.float32)
    (tmp_path / "run").mkdir()
    services = Services(tmp_path / "run", model_path)
    try:
        services.drafter = services.stack.start("drafter", [
            "--kind", "dflash", "--drafter-path", str(tmp_path / "dflash"), "--target", model_path, "--tree",
            "ddtree", "--grace-s", "1"])
        wait_for(lambda: health(services.drafter) == SERVING, timeout_s=120, what="the DFlash drafter")
        services.start_verifier("--tp", "2")
        wait_for(lambda: health(services.verifier) == SERVING, timeout_s=120, what="the verifier on two ranks")
        services.start_gateway(services.verifier)
        wait_for(lambda: health(services.gateway) == SERVING, what="the gateway")
        results = run_all(services.gateway, [request(p, 20) for p in PROMPTS[:4]])
        for prompt, (tokens, _) in zip(PROMPTS, results):
            assert tokens == expected(target, prompt, 20)
        metrics = scrape(services.verifier_metrics)
        assert metrics[("treeserve_drafts_total", ())] > 0  # trees were drafted from the features and verified
    finally:
        services.stack.stop(grace_s=1)


def test_a_dead_rank_takes_the_verifier_down_cleanly(services):
    verifier = services.process("verifier")
    followers = follower_pids(verifier.pid)
    assert len(followers) == 1

    async def stream_while_the_rank_dies():
        async with grpc.aio.insecure_channel(services.gateway) as channel:
            # Speculation off: one token per round, so the stream is still running when the rank dies.
            stream = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request(PROMPTS[0], 200, disabled=True))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for reply in stream:
                    if followers:
                        os.kill(followers.pop(), signal.SIGKILL)
            return failed.value.code()

    assert asyncio.run(stream_while_the_rank_dies()) == grpc.StatusCode.UNAVAILABLE
    assert verifier.wait(timeout=60) != 0  # gone, not hanging


def test_sigterm_stops_every_rank(services):
    verifier = services.process("verifier")
    if verifier.poll() is None:  # the previous test normally took it down already
        verifier.kill()
        verifier.wait(30)
    services.start_verifier("--tp", "2")
    wait_for(lambda: health(services.verifier) == SERVING, timeout_s=120, what="a new verifier on two ranks")
    verifier = services.process("verifier")
    followers = follower_pids(verifier.pid)
    assert len(followers) == 1
    verifier.send_signal(signal.SIGTERM)
    assert verifier.wait(timeout=60) == 0
    wait_for(lambda: not Path(f"/proc/{followers[0]}").exists() or
             Path(f"/proc/{followers[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
             timeout_s=30, what="the follower rank to exit")
