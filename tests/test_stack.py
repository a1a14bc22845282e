"""The three services as a user starts them: `treeserve up`, then `treeserve client`, on a tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import tiny_models
from helpers import start_up, stop_up

pytestmark = pytest.mark.slow


def treeserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeserve", *args], capture_output=True, text=True, timeout=300,
                          **kwargs)


def test_up_removes_its_own_runtime_folder_on_stop(tmp_path):
    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    temp = tmp_path / "tmp"
    temp.mkdir()
    up, address = start_up(target, "--drafter", "none", env={**os.environ, "TMPDIR": str(temp)})
    assert address.startswith(f"unix://{temp}/treeserve-")
    code, errors = stop_up(up)
    assert code == 0, errors
    assert not list(temp.iterdir())


def streamed_chat(url: str, prompt: str, max_tokens: int) -> str:
    """A streamed chat completion over HTTP, read as curl -N shows it: its text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        lines = [line.decode().strip() for line in reply if line.strip()]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)


def test_up_client_http_and_shutdown(tmp_path):
    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    runtime = tmp_path / "run"
    up = subprocess.Popen([sys.executable, "-m", "treeserve", "up", "--target", target, "--runtime-dir", str(runtime),
                           "--grace-s", "2", "--max-batch", "4", "--cuda-graphs", "off", "--http", "127.0.0.1:0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()  # printed once all three serve
        assert line.startswith("gateway: unix://"), (line, up.stderr.read() if up.poll() is not None else "")
        address = line.split(": ", 1)[1].strip()
        http_line = up.stdout.readline()
        assert re.fullmatch(r"http: http://127\.0\.0\.1:\d+\n", http_line), http_line
        assert not http_line.endswith(":0\n")  # the free port up chose, as the gateway serves it
        chat = treeserve("client", "--address", address, "--prompt", "the cat sat", "--chat", "--max-new-tokens", "12",
                         "--json")
        assert chat.returncode == 0, chat.stderr
        assert streamed_chat(http_line.split(": ", 1)[1].strip(), "the cat sat", 12) == json.loads(chat.stdout)["text"]
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


def test_a_process_that_started_services_stops_them_when_sent_sigterm(tmp_path):
    """A bench killed by SIGTERM (as `timeout` kills it) still stops the services it started: they run in sessions
    of their own, and would otherwise outlive it holding their sockets and ports."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from treeserve.cli.launcher import Stack\n"
        "stack = Stack(Path(sys.argv[1]))\n"
        "try:\n"
        "    stack.start('drafter', ['--kind', 'ngram'])\n"
        "    stack.wait_serving(60)\n"
        "    print(stack.children['drafter'][0].pid, flush=True)\n"
        "    while True:\n"  # (short sleeps: a signal another thread takes wakes no long one)
        "        time.sleep(0.1)\n"
        "finally:\n"
        "    stack.stop(1)\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    drafter_pid = int(bench.stdout.readline())
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{drafter_pid}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{drafter_pid}"), "the drafter outlived the process that started it"
        assert not list(tmp_path.glob("*.sock"))
    finally:  # (whatever failed, leave nothing running)
        bench.kill()
        if os.path.exists(f"/proc/{drafter_pid}"):
            os.kill(drafter_pid, signal.SIGKILL)
