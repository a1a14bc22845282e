"""The three services as a user starts them: `treeserve up`, then `treeserve client`, on a tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tiny_models

pytestmark = pytest.mark.slow


def treeserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeserve", *args], capture_output=True, text=True, timeout=300,
                          **kwargs)


def start_up(target: str, *flags: str, **kwargs) -> tuple[subprocess.Popen, str]:
    """`treeserve up` on `target`, once it prints the gateway's address: (the process, that address)."""
    up = subprocess.Popen([sys.executable, "-m", "treeserve", "up", "--target", target, "--grace-s", "2",
                           "--max-batch", "4", "--cuda-graphs", "off", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    line = up.stdout.readline()  # printed once all three serve
    assert line.startswith("gateway: unix://"), (line, up.stderr.read() if up.poll() is not None else "")
    return up, line.split(": ", 1)[1].strip()


def stop_up(up: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM to `up`: its exit code and what it wrote on stderr."""
    up.send_signal(signal.SIGTERM)
    _, errors = up.communicate(timeout=60)
    return up.returncode, errors


def service_pid(service: str, runtime) -> int | None:
    """The process id of the `service` that `up` started in `runtime` (None while there is none)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"treeserve.{service}" in argv and any(str(runtime) in arg for arg in argv):
            return int(entry)
    return None


def test_up_restarts_a_killed_drafter_and_keeps_serving_exact_tokens(tmp_path):
    from treeserve.cli.launcher import is_serving
    from treeserve.gateway.client import generate_via_gateway
    from treeserve.params import GenerationParams

    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    runtime = tmp_path / "run"
    prompt = "the cat sat on the mat and the cat sat on the mat"
    local = treeserve("generate", "--target", target, "--drafter", "none", "--prompt", prompt,
                      "--max-new-tokens", "48", "--json")
    assert local.returncode == 0, local.stderr
    expected = json.loads(local.stdout)["token_ids"]
    up, address = start_up(target, "--drafter", "ngram", "--runtime-dir", str(runtime))
    try:
        drafter = service_pid("drafter", runtime)
        assert drafter is not None
        killed = []

        def kill_drafter_once(_text):
            if not killed:
                os.kill(drafter, signal.SIGKILL)
                killed.append(True)

        params = GenerationParams(max_new_tokens=48)
        streamed = asyncio.run(generate_via_gateway(address, prompt, params, on_text=kill_drafter_once))
        assert killed and streamed["token_ids"] == expected
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and service_pid("drafter", runtime) in (drafter, None):
            assert up.poll() is None and (runtime / "gateway.sock").exists()
            time.sleep(0.1)
        while time.monotonic() < deadline and not is_serving(f"unix://{runtime}/drafter.sock"):
            time.sleep(0.2)
        assert is_serving(f"unix://{runtime}/drafter.sock")
        later = asyncio.run(generate_via_gateway(address, prompt, params))
        assert later["token_ids"] == expected and up.poll() is None
        assert later["mean_accepted"] > 0  # drafted again: the verifier reconnected to the new drafter
    finally:
        code, errors = stop_up(up)
    assert code == 0, errors
    assert "the drafter exited (code -9); restarting it in 0.5 s" in errors
    assert "restarted the drafter (restart 1)" in errors and "restarts: drafter 1" in errors


def test_up_removes_its_own_runtime_folder_on_stop(tmp_path):
    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    temp = tmp_path / "tmp"
    temp.mkdir()
    up, address = start_up(target, "--drafter", "none", env={**os.environ, "TMPDIR": str(temp)})
    assert address.startswith(f"unix://{temp}/treeserve-")
    code, errors = stop_up(up)
    assert code == 0, errors
    assert not list(temp.iterdir())


def test_up_client_and_shutdown(tmp_path):
    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    runtime = tmp_path / "run"
    up = subprocess.Popen([sys.executable, "-m", "treeserve", "up", "--target", target, "--runtime-dir", str(runtime),
                           "--grace-s", "2", "--max-batch", "4", "--cuda-graphs", "off"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()  # printed once all three serve
        assert line.startswith("gateway: unix://"), (line, up.stderr.read() if up.poll() is not None else "")
        address = line.split(": ", 1)[1].strip()
        prompt = ["--prompt", "the cat sat on the mat and the cat sat", "--max-new-tokens", "24"]
        via_stack = treeserve("client", "--address", address, *prompt, "--json")
        assert via_stack.returncode == 0, via_stack.stderr
        in_process = treeserve("generate", "--target", target, "--drafter", "none", *prompt, "--json")
        assert in_process.returncode == 0, in_process.stderr
        stack_result, local_result = json.loads(via_stack.stdout), json.loads(in_process.stdout)
        assert stack_result["token_ids"] == local_result["token_ids"]
        assert stack_result["text"] == local_result["text"]
        assert set(local_result) <= set(stack_result) | {"target", "drafter", "budget"}
        streamed = treeserve("client", "--address", address, *prompt)
        assert streamed.returncode == 0 and streamed.stdout.strip() == local_result["text"].strip()
        bad = treeserve("client", "--address", address, "--prompt", "x", "--temperature", "-1")
        assert bad.returncode != 0 and "Traceback" not in bad.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = up.wait(timeout=60)
    assert code == 0 and time.monotonic() - started < 30
    assert not list(runtime.glob("*.sock"))


@pytest.mark.parametrize("flags, message", [
    (["--max-batch", "0"], "--max-batch must be at least 1, got 0"),
    (["--cuda-graphs", "on"], "--cuda-graphs on needs --device cuda"),
    (["--budget", "200"], "--budget must be between 1 and 128"),
])
def test_up_refuses_bad_flags_before_starting_anything(tmp_path, flags, message):
    runtime = tmp_path / "run"
    done = treeserve("up", "--target", "no-such-model-is-loaded", "--runtime-dir", str(runtime), *flags)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
    assert not list(runtime.glob("*.log"))  # no service was started
