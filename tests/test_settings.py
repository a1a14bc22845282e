"""Every service's settings: flags and TREESERVE_<SERVICE>_<FLAG> variables read and checked one way, each bad
value one clear line; `treeserve up` reaches every field of every service."""

from __future__ import annotations

import typing

import pytest

from treeserve.settings import SERVICE_SETTINGS, DrafterSettings, GatewaySettings, VerifierSettings

# Checked when the service loads what it serves (an unknown model or checkpoint is an error line then).
CHECKED_AT_LOAD = {"target", "drafter_path", "drafter"}


def bad_values(settings, field) -> list[str]:
    """Values the parse itself must refuse for this field."""
    option, kind = field.metadata["option"], typing.get_type_hints(settings)[field.name]
    if option.choices:
        return ["bogus"]
    if kind in (int, float):
        return ["x"] + ([str(option.minimum - 1)] if option.minimum is not None else [])
    if field.name in CHECKED_AT_LOAD:
        return []
    return ["nowhere"]  # addresses, HOST:PORT


CASES = [(settings, field, value) for settings in SERVICE_SETTINGS.values() for field in settings.fields()
         for value in bad_values(settings, field)]


@pytest.mark.parametrize("settings, field, value", CASES,
                         ids=[f"{s.SERVICE}-{f.name}-{v}" for s, f, v in CASES])
@pytest.mark.parametrize("source", ["flag", "environment"])
def test_a_bad_value_exits_with_one_line_naming_it(settings, field, value, source, monkeypatch, capsys):
    for other in SERVICE_SETTINGS[settings.SERVICE].fields():
        monkeypatch.delenv(settings.env_name(other), raising=False)
    if source == "flag":
        argv, named = [settings.flag(field), value], settings.flag(field)
    else:
        argv, named = [], settings.env_name(field)
        monkeypatch.setenv(named, value)
    with pytest.raises(SystemExit) as exit_:
        settings.parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{settings.PROG}: error:")
    assert named in err or field.name.replace("_", "-") in err or "address" in err, err


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("TREESERVE_VERIFIER_KV_CACHE_TOKENS", "4096")
    monkeypatch.setenv("TREESERVE_VERIFIER_DRAFTER", "a:1, b:2")
    monkeypatch.setenv("TREESERVE_VERIFIER_LOG_LEVEL", "debug")
    settings = VerifierSettings.parse(["--max-batch", "8", "--kv-cache-tokens", "0"])
    assert (settings.max_batch, settings.kv_cache_tokens, settings.drafter, settings.log_level) == (
        8, 0, ["a:1", "b:2"], "DEBUG")
    assert VerifierSettings.parse(["--drafter", "c:3"]).drafter == ["c:3"]
    assert VerifierSettings().drafter == [] and VerifierSettings.parse([]).speculation == "auto"


def test_auto_speculation_is_adaptive_on_a_gpu_and_on_the_cpu():
    assert VerifierSettings.parse(["--device", "cuda"]).adaptive
    assert VerifierSettings.parse(["--device", "cpu"]).adaptive
    assert not VerifierSettings.parse(["--speculation", "fixed"]).adaptive
    assert not VerifierSettings.parse(["--device", "cuda", "--speculation", "fixed"]).adaptive
    assert VerifierSettings.parse(["--speculation", "adaptive"]).adaptive


def test_checks_that_span_fields():
    for settings, argv, message in [
        (VerifierSettings, ["--cuda-graphs", "on"], "needs --device cuda"),
        (VerifierSettings, ["--adaptive-min-budget", "9", "--adaptive-max-budget", "4"], "0 <= min <= max"),
        (VerifierSettings, ["--default-budget", "129"], "between 1 and 128"),
        (DrafterSettings, ["--kind", "model"], "needs --drafter-path"),
        (DrafterSettings, ["--max-budget", "500"], "between 1 and 128"),
    ]:
        with pytest.raises(SystemExit):
            settings.parse(argv)
    from treeserve.errors import TreeserveError

    with pytest.raises(TreeserveError, match="at least one --verifier"):
        GatewaySettings.read({"verifier": []}, {})


def test_up_reaches_every_field_of_every_service(capsys):
    """`treeserve up --help` shows, for every field of every service, the flag of up's that sets it or a
    --<service>-<flag> passed on."""
    from treeserve.cli import main
    from treeserve.cli.launcher import UP_SETS

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    shown = capsys.readouterr().out
    for service, settings in SERVICE_SETTINGS.items():
        for field in settings.fields():
            flag = field.name.replace("_", "-")
            assert field.name in UP_SETS[service] or f"--{service}-{flag} " in shown, (service, field.name)


def test_up_passes_its_settings_and_the_service_flags_on(monkeypatch):
    from treeserve.cli import up_settings
    from treeserve.errors import TreeserveError
    from treeserve.cli.launcher import service_argv

    args = up_settings("--device", "cpu", "--budget", "8", "--verifier-kv-cache-tokens", "4096",
                       "--drafter-max-budget", "32", "--gateway-max-inflight", "9")
    verifier = service_argv("verifier", args, drafter=["unix:///tmp/d.sock"])
    assert verifier[verifier.index("--kv-cache-tokens") + 1] == "4096"
    assert verifier[verifier.index("--default-budget") + 1] == "8"
    assert verifier[verifier.index("--drafter") + 1] == "unix:///tmp/d.sock" and "--listen" not in verifier
    assert service_argv("drafter", args)[service_argv("drafter", args).index("--max-budget") + 1] == "32"
    assert "--max-inflight" in service_argv("gateway", args, verifier=["unix:///tmp/v.sock"])
    gateway = service_argv("gateway", up_settings("--http", "127.0.0.1:8123"), verifier=["unix:///tmp/v.sock"])
    assert gateway[gateway.index("--http") + 1] == "127.0.0.1:8123"
    assert "--http" not in service_argv("gateway", args, verifier=["unix:///tmp/v.sock"])  # off unless asked for
    with pytest.raises(TreeserveError, match="the verifier: argument --kv-cache-tokens: -5 is below 0"):
        service_argv("verifier", up_settings("--verifier-kv-cache-tokens", "-5"))
    monkeypatch.setenv("TREESERVE_DRAFTER_MAX_BUDGET", "0")  # what up does not set comes from the environment
    with pytest.raises(TreeserveError, match="TREESERVE_DRAFTER_MAX_BUDGET"):
        service_argv("drafter", up_settings("--drafter-kv-cache-tokens", "0"))


def test_a_bad_up_value_is_one_line_before_anything_starts(tmp_path, capsys):
    import socket

    from treeserve.cli import main

    assert main(["up", "--runtime-dir", str(tmp_path), "--drafter-max-budget", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the drafter: argument --max-budget: 0 is below 1" in err
    assert main(["up", "--runtime-dir", str(tmp_path), "--http", "8000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the gateway: --http '8000': use HOST:PORT" in err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert main(["up", "--runtime-dir", str(tmp_path), "--http", address]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot serve HTTP on {address}: " in err
    assert not list(tmp_path.iterdir())  # nothing started, no log written


def test_a_busy_loop_is_on_with_cuda_unless_told():
    from treeserve.settings import busy_loop_wanted

    assert busy_loop_wanted("auto", "cuda") and not busy_loop_wanted("auto", "cpu")
    assert busy_loop_wanted("on", "cpu") and not busy_loop_wanted("off", "cuda")
