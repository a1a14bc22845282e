"""A service's settings as one frozen dataclass, from which come its command-line flags, the
TREESERVE_<SERVICE>_<FLAG> environment defaults and their validation (the same for both); `treeserve up`
reaches every field (treeserve.cli.launcher.service_argv).

A field is declared with `option(default, help, ...)`; its type annotation (int, float, str or list[str]) says
how a value is read. A flag on the command line wins over the environment, which wins over the default. A
settings class may define `problems()`, the checks that span fields, as a list of messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Callable, ClassVar

from treeserve.errors import TreeserveError
from treeserve.tree import MAX_BUDGET


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes print one line (not the usage block) and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


@dataclasses.dataclass(frozen=True)
class Option:
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    upper: bool = False  # read case-insensitively, kept upper-case (log levels)
    metavar: str | None = None


def option(default: Any, help: str, *, choices: tuple[str, ...] = (), minimum: float | None = None,
           upper: bool = False, metavar: str | None = None):
    """A settings field. `default` may be a function of no arguments (a default that depends on the environment
    it runs in, such as a socket path), called when settings are read."""
    meta = {"option": Option(help, choices, minimum, upper, metavar)}
    if callable(default) or isinstance(default, list):
        factory = default if callable(default) else (lambda: list(default))
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Settings:
    """Base of a service's settings dataclass: SERVICE names its environment variables, PROG its command."""

    SERVICE: ClassVar[str]
    PROG: ClassVar[str]
    DESCRIPTION: ClassVar[str] = ""

    def problems(self) -> list[str]:
        return []

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return [field for field in dataclasses.fields(cls) if "option" in field.metadata]

    @classmethod
    def flag(cls, field: dataclasses.Field) -> str:
        return "--" + field.name.replace("_", "-")

    @classmethod
    def env_name(cls, field: dataclasses.Field) -> str:
        return f"TREESERVE_{cls.SERVICE.upper()}_{field.name.upper()}"

    @classmethod
    def parser(cls, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
        """The command-line parser: every field a flag, its values read later (`parse`), so that flags and
        environment go through one validation."""
        parser = parser or OneLineErrorParser(
            prog=cls.PROG, description=cls.DESCRIPTION,
            epilog=f"Every flag can also come from the environment as TREESERVE_{cls.SERVICE.upper()}_<FLAG> "
                   "(dashes as underscores; lists comma-separated); a flag on the command line wins.")
        hints = typing.get_type_hints(cls)
        for field in cls.fields():
            opt: Option = field.metadata["option"]
            many = hints[field.name] == list[str]
            parser.add_argument(cls.flag(field), dest=field.name, default=None, metavar=opt.metavar,
                                action="append" if many else "store", help=help_text(field, opt, many))
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None):
        """Settings from the command line, then the environment, then the defaults; a bad value exits through
        parser.error with one line naming the flag or the variable."""
        parser = parser or cls.parser()
        given = vars(parser.parse_args(argv))
        try:
            return cls.read(given, os.environ)
        except TreeserveError as error:
            parser.error(str(error))

    @classmethod
    def read(cls, given: dict[str, Any], environ) -> "Settings":
        """Settings from given flag values (None: not given) and an environment; raises TreeserveError."""
        hints = typing.get_type_hints(cls)
        values = {}
        for field in cls.fields():
            opt: Option = field.metadata["option"]
            if given.get(field.name) is not None:
                text, source = given[field.name], f"argument {cls.flag(field)}"
            elif cls.env_name(field) in environ:
                text, source = environ[cls.env_name(field)], cls.env_name(field)
            else:
                continue  # the dataclass's default
            values[field.name] = convert(text, hints[field.name], opt, source)
        settings = cls(**values)
        problems = settings.problems()
        if problems:
            raise TreeserveError(problems[0])
        return settings


def help_text(field: dataclasses.Field, opt: Option, many: bool) -> str:
    text = opt.help
    if opt.choices:
        text += f"; one of {', '.join(opt.choices)}"
    if many:
        text += " (repeatable)"
    default = field.default if field.default is not dataclasses.MISSING else None
    if default not in (None, "") and "default" not in opt.help:
        text += f" (default {default})"
    return text.replace("%", "%%")


def convert(text: str | list[str], kind, opt: Option, source: str):
    """One value as its field's type, checked against its choices and minimum."""
    if kind == list[str]:
        items = text if isinstance(text, list) else text.split(",")
        return [item.strip() for item in items if item.strip()]
    converter: Callable[[str], Any] = {int: int, float: float, str: str}[kind]
    try:
        value = converter(text.strip() if kind is not str else text)
    except ValueError:
        raise TreeserveError(f"{source}: invalid {kind.__name__} value: {text!r}") from None
    if opt.upper:
        value = value.upper()
    if opt.choices and value not in opt.choices:
        raise TreeserveError(f"{source}: invalid choice {value!r} (choose from {', '.join(opt.choices)})")
    if opt.minimum is not None and value < opt.minimum:
        raise TreeserveError(f"{source}: {value!r} is below {opt.minimum:g}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEVICES, DTYPES, GRAPHS = ("cpu", "cuda"), ("float32", "bfloat16"), ("auto", "on", "off")
BUSY_LOOP = ("auto", "on", "off")
BUSY_LOOP_HELP = ("poll between rounds instead of sleeping, at the cost of a core while serving (auto: on with "
                  "--device cuda, where a round is short enough for a sleeping thread's wake-up to show)")
SPECULATION = ("auto", "fixed", "adaptive")
DRAFTER_KINDS = ("auto", "ngram", "dflash", "merged", "model")
TREE_KINDS = ("chain", "ddtree")


def busy_loop_wanted(busy_loop: str, device: str) -> bool:
    """Whether a service with these --busy-loop and --device values keeps its loop polling."""
    return busy_loop == "on" or (busy_loop == "auto" and device == "cuda")


def default_address(service: str) -> Callable[[], str]:
    def address() -> str:
        from treeserve.serving import default_address as address_of

        return address_of(service)
    return address


def split_host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets, [::1]:8000) as (host, port); raises TreeserveError otherwise."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise TreeserveError(f"{address!r}: use HOST:PORT")
    return host, int(port)


def address_problems(*addresses: str, metrics_listen: str = "", http: str = "") -> list[str]:
    """What is wrong with these listen or peer addresses, and with a metrics or HTTP HOST:PORT (empty: off)."""
    from treeserve.serving import normalize_address

    problems = []
    for address in addresses:
        try:
            normalize_address(address)
        except TreeserveError as error:
            problems.append(str(error))
    for flag, value in (("--metrics-listen", metrics_listen), ("--http", http)):
        try:
            if value:
                split_host_port(value)
        except TreeserveError as error:
            problems.append(f"{flag} {error}")
    return problems


@dataclasses.dataclass(frozen=True)
class VerifierSettings(Settings):
    SERVICE: ClassVar[str] = "verifier"
    PROG: ClassVar[str] = "python -m treeserve.verifier"
    DESCRIPTION: ClassVar[str] = "Serve a target model, verifying draft trees from one or more drafters."

    target: str = option("smollm2-135m", "model name, HF folder or .gguf")
    device: str = option("cpu", "where the target runs", choices=DEVICES)
    dtype: str = option("float32", "the target's weights and activations", choices=DTYPES)
    listen: str = option(default_address("verifier"), "unix:///path/to.sock or host:port")
    drafter: list[str] = option([], "a drafter to use; dns:///name:port means every address the name resolves to "
                                    "(replicas); none given: plain decoding only", metavar="ADDRESS")
    default_budget: int = option(16, "tree budget (drafted nodes) for requests that leave it unset", minimum=1)
    default_max_new_tokens: int = option(64, "for requests that leave max_new_tokens unset", minimum=1)
    max_batch: int = option(64, "requests per round at most", minimum=1)
    kv_cache_tokens: int = option(0, "tokens the paged KV cache holds, over all requests (default 0: on a GPU, 90% "
                                     "of the memory free after room for the largest forward; on the CPU, 16384)",
                                  minimum=0)
    cuda_graphs: str = option("auto", "replay tree verification from CUDA graphs captured at start-up, on every "
                                      "tensor-parallel rank with its collectives (auto: with --device cuda); off "
                                      "is for debugging", choices=GRAPHS)
    speculation: str = option("auto", "fixed: every request drafts its own budget each round; adaptive: each "
                                      "round's budget (0 = plain decoding) is chosen for tokens per second from "
                                      "measured verification costs and each request's acceptance; auto: the one "
                                      "measured to pay on every device, adaptive", choices=SPECULATION)
    adaptive_min_budget: int = option(0, "adaptive: the smallest round budget (0: plain decoding allowed)", minimum=0)
    adaptive_max_budget: int = option(MAX_BUDGET, "adaptive: the largest round budget (a request's own budget caps "
                                                  "it too)", minimum=0)
    adaptive_give_up_s: float = option(1.0, "adaptive: after this many seconds of rounds at a batch size in which "
                                            "drafting would not pay, new requests there decode plainly (but one in "
                                            "16) and running ones stop drafting; 0: at once", minimum=0)
    tp: int = option(1, "tensor-parallel ranks: this process is rank 0 and starts the others on this host (one GPU "
                        "each), unless a launcher such as torchrun set RANK and WORLD_SIZE", minimum=1)
    draft_timeout_s: float = option(2.0, "a drafter slower than this is treated as down for the round", minimum=0)
    busy_loop: str = option("auto", BUSY_LOOP_HELP, choices=BUSY_LOOP)
    grace_s: float = option(10.0, "drain period on SIGTERM, seconds", minimum=0)
    metrics_listen: str = option("", "serve Prometheus metrics over HTTP here (default: off)", metavar="HOST:PORT")
    log_level: str = option("INFO", "how much to log", choices=LOG_LEVELS, upper=True)

    def problems(self) -> list[str]:
        problems = address_problems(self.listen, metrics_listen=self.metrics_listen)
        if self.default_budget > MAX_BUDGET:
            problems.append(f"--default-budget must be between 1 and {MAX_BUDGET}")
        if self.cuda_graphs == "on" and self.device != "cuda":
            problems.append("--cuda-graphs on needs --device cuda")
        if not self.adaptive_min_budget <= self.adaptive_max_budget <= MAX_BUDGET:
            problems.append("--adaptive-min-budget and --adaptive-max-budget must satisfy 0 <= min <= max <= "
                            f"{MAX_BUDGET}")
        return problems

    @property
    def adaptive(self) -> bool:
        """Whether rounds choose their budget. Fixed trees lose to plain decoding in most serving cells on a GPU,
        and on the CPU from 16 requests up on chat, where adaptive speculation does not (docs/benchmarks.md)."""
        return self.speculation in ("auto", "adaptive")


@dataclasses.dataclass(frozen=True)
class DrafterSettings(Settings):
    SERVICE: ClassVar[str] = "drafter"
    PROG: ClassVar[str] = "python -m treeserve.drafter"
    DESCRIPTION: ClassVar[str] = "Serve a treeserve drafter (DrafterService) over gRPC until SIGTERM or SIGINT."

    listen: str = option(default_address("drafter"), "unix:///path/to.sock or host:port")
    kind: str = option("auto", "auto: merged, with the DFlash drafter shipped for --target (smollm2-135m), else "
                               "ngram; ngram: prompt-lookup trees; dflash: a DFlash block drafter; merged: prompt "
                               "lookup's best continuation, then the DFlash tree for the rest of the budget; model: "
                               "the small LM at --drafter-path", choices=DRAFTER_KINDS)
    drafter_path: str = option("", "dflash, merged: the checkpoint folder (default: the one shipped for --target); "
                                   "model: the draft model (name, HF folder, .gguf)")
    target: str = option("smollm2-135m", "dflash, merged, model: the verifier's model (name, HF folder or .gguf); "
                                         "DFlash uses its embedding and LM head, a draft model must share its "
                                         "tokenizer")
    tree: str = option("ddtree", "dflash, merged: chain (the argmax path) or ddtree (the best tree for the budget)",
                       choices=TREE_KINDS)
    device: str = option("cpu", "dflash, merged, model: where the drafter runs", choices=DEVICES)
    dtype: str = option("float32", "dflash, merged, model: the drafter's weights", choices=DTYPES)
    kv_cache_tokens: int = option(0, "dflash: context tokens its pool holds over all requests (default 0: 262144 on "
                                     "cuda, 32768 on the CPU)", minimum=0)
    max_batch: int = option(64, "dflash with CUDA graphs: requests per round the graphs cover", minimum=1)
    cuda_graphs: str = option("auto", "dflash: replay the block forward from CUDA graphs (auto: with --device cuda)",
                              choices=GRAPHS)
    max_budget: int = option(MAX_BUDGET, "largest tree a request may ask for, in drafted nodes", minimum=1)
    busy_loop: str = option("auto", BUSY_LOOP_HELP, choices=BUSY_LOOP)
    grace_s: float = option(10.0, "on SIGTERM, seconds open streams get to finish", minimum=0)
    metrics_listen: str = option("", "serve Prometheus metrics over HTTP here (default: off)", metavar="HOST:PORT")
    log_level: str = option("INFO", "how much to log", choices=LOG_LEVELS, upper=True)

    def problems(self) -> list[str]:
        problems = address_problems(self.listen, metrics_listen=self.metrics_listen)
        if self.kind == "model" and not self.drafter_path:
            problems.append("--kind model needs --drafter-path")
        if self.cuda_graphs == "on" and self.device != "cuda":
            problems.append("--cuda-graphs on needs --device cuda")
        if self.max_budget > MAX_BUDGET:
            problems.append(f"--max-budget must be between 1 and {MAX_BUDGET}")
        return problems


@dataclasses.dataclass(frozen=True)
class GatewaySettings(Settings):
    SERVICE: ClassVar[str] = "gateway"
    PROG: ClassVar[str] = "python -m treeserve.gateway"
    DESCRIPTION: ClassVar[str] = "The public text API, in front of one or more verifiers."

    target: str = option("smollm2-135m", "the verifier's model (name, HF folder or .gguf), for its tokenizer")
    verifier: list[str] = option(lambda: [default_address("verifier")()], "a verifier", metavar="ADDRESS")
    listen: str = option(default_address("gateway"), "unix:///path/to.sock or host:port")
    max_inflight: int = option(256, "requests in flight at most; more are refused with RESOURCE_EXHAUSTED",
                               minimum=1)
    default_max_new_tokens: int = option(64, "for requests that leave max_new_tokens unset", minimum=1)
    http: str = option("", "also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                           "/v1/models, /health) here, e.g. 127.0.0.1:8000 (default: off)", metavar="HOST:PORT")
    http_timeout_s: float = option(0.0, "deadline of each HTTP request, seconds; past it the request ends with 504 "
                                        "(default 0: none)", minimum=0)
    grace_s: float = option(10.0, "drain period on SIGTERM, seconds", minimum=0)
    metrics_listen: str = option("", "serve Prometheus metrics over HTTP here (default: off)", metavar="HOST:PORT")
    log_level: str = option("INFO", "how much to log", choices=LOG_LEVELS, upper=True)

    def problems(self) -> list[str]:
        if not self.verifier:
            return ["give at least one --verifier"]
        return address_problems(self.listen, *self.verifier, metrics_listen=self.metrics_listen, http=self.http)


SERVICE_SETTINGS = {"verifier": VerifierSettings, "drafter": DrafterSettings, "gateway": GatewaySettings}
