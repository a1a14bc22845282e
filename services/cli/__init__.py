"""The `treeserve` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.params import GenerationParams
from treeserve.settings import DEVICES, DTYPES, GRAPHS, SPECULATION, TREE_KINDS, OneLineErrorParser
from treeserve.tree import MAX_BUDGET

DRAFTERS = ("auto", "none", "ngram", "dflash", "merged", "model")
DRAFTER_HELP = ("auto (default): merged, with the DFlash drafter shipped for the target (smollm2-135m), else "
                "ngram; none: plain autoregressive decoding; ngram: prompt-lookup trees; dflash: a DFlash block "
                "drafter with --tree; merged: prompt lookup's best continuation, then the DFlash tree for the rest "
                "of the budget; model: a small LM at --drafter-path")
DRAFTER_PATH_HELP = ("dflash, merged: a DFlash checkpoint folder (config.json + model.safetensors; default: the one "
                     "shipped for the target); model: a draft model with the target's tokenizer (name, HF folder, "
                     ".gguf)")


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generated tokens at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: random, reported with --json)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when the output contains TEXT (repeatable)")
    parser.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                        help="stop after this token id (repeatable; EOS always stops)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="treeserve", description="Lossless speculative decoding with draft trees.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    gen = commands.add_parser("generate", help="generate text in-process",
                              description="Generate from a target model in this process, with speculative "
                                          "decoding by the chosen drafter. Output equals the target's own.")
    gen.add_argument("--target", default="smollm2-135m",
                     help="model name (smollm2-135m), Hugging Face model folder, or .gguf file "
                          "(default smollm2-135m)")
    gen.add_argument("--drafter", choices=DRAFTERS, default="auto", help=DRAFTER_HELP)
    gen.add_argument("--drafter-path", help=DRAFTER_PATH_HELP)
    gen.add_argument("--tree", choices=TREE_KINDS, default="ddtree",
                     help="how a DFlash drafter builds trees: chain (its argmax path) or ddtree (the best tree "
                          "for the budget; default)")
    gen.add_argument("--budget", type=int, default=16,
                     help=f"drafted tree nodes per round, 1 to {MAX_BUDGET} (default 16)")
    gen.add_argument("--device", default="cpu", choices=DEVICES, help="default cpu")
    gen.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel ranks: the target split over N processes (N GPUs with --device cuda; "
                          "under torchrun, its ranks); default 1")
    gen.add_argument("--dtype", default="float32", choices=DTYPES, help="default float32")
    gen.add_argument("--cuda-graphs", choices=GRAPHS, default="auto",
                     help="verify trees (and run a DFlash drafter's block) by replaying CUDA graphs, on every "
                          "tensor-parallel rank with its collectives (auto: with --device cuda)")
    add_generation_arguments(gen)

    from treeserve.gateway.client import add_client_arguments

    client = commands.add_parser("client", help="generate through a running gateway",
                                 description="Send one request to a treeserve gateway and stream its text; "
                                             "--json prints the same object as generate --json.")
    add_client_arguments(client)

    from treeserve.bench.load import add_bench_arguments

    bench = commands.add_parser("bench", help="measure a running gateway at several concurrencies",
                                description="Load a treeserve gateway with fixed prompt sets at each concurrency, "
                                            "speculative and plain side by side; JSON results and a PNG plot.")
    add_bench_arguments(bench)

    up = commands.add_parser("up", help="run gateway, verifier and drafter on Unix sockets",
                             description="Start the three services on this machine (Unix sockets in a runtime "
                                         "folder), wait until they serve, print the gateway address; Ctrl-C stops all.")
    up.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default smollm2-135m)")
    up.add_argument("--drafter", choices=DRAFTERS, default="auto", help=DRAFTER_HELP)
    up.add_argument("--drafter-path", help=DRAFTER_PATH_HELP)
    up.add_argument("--tree", choices=TREE_KINDS, default="ddtree", help="--drafter dflash: chain or ddtree (default)")
    up.add_argument("--budget", type=int, default=16, help=f"default tree budget, 1 to {MAX_BUDGET} (default 16)")
    up.add_argument("--device", default="cpu", choices=DEVICES)
    up.add_argument("--dtype", default="float32", choices=DTYPES)
    up.add_argument("--tp", type=int, default=1, help="the verifier's tensor-parallel ranks (default 1)")
    up.add_argument("--max-batch", type=int, default=64,
                    help="requests per verification round at most, and what the CUDA graphs cover (default 64)")
    up.add_argument("--cuda-graphs", choices=GRAPHS, default="auto",
                    help="replay the verifier's and the DFlash drafter's forwards from CUDA graphs: auto (on with "
                         "--device cuda), on, off (for debugging)")
    up.add_argument("--speculation", choices=SPECULATION, default="auto",
                    help="the verifier's: fixed (every request drafts its budget), adaptive (each round's budget "
                         "chosen for tokens per second, 0 = plain decoding) or auto (the default: the one measured to "
                         "pay on every device, adaptive)")
    up.add_argument("--verifier-metrics", metavar="HOST:PORT",
                    help="serve the verifier's Prometheus metrics here (what treeserve bench reads round times from)")
    up.add_argument("--http", metavar="HOST:PORT",
                    help="also serve the gateway's OpenAI-compatible HTTP API here, e.g. 127.0.0.1:8000 (port 0: a "
                         "free one), printed as `http: URL` (default: off)")
    up.add_argument("--runtime-dir", help="folder for sockets and logs (default: a new temporary folder)")
    up.add_argument("--start-timeout-s", type=float, default=600, help="how long to wait for the services")
    up.add_argument("--grace-s", type=float, default=10, help="drain period on stop (default 10)")
    up.add_argument("--demo-prompt", help="once serving, stream one request with this prompt")
    add_service_flags(up)

    health = commands.add_parser("health", help="ask a service whether it is serving (the container healthcheck)",
                                 description="Ask the service at ADDRESS for its grpc.health.v1 status and print "
                                             "it; exit 0 if SERVING, 1 otherwise.")
    health.add_argument("address", help="unix:///path/to.sock or host:port")
    health.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the answer (default 5)")

    add_drafter_training_commands(commands)
    return parser


def add_service_flags(up) -> None:
    """Every service flag that `up`'s own flags above do not set, as --<service>-<flag> (for example
    --verifier-kv-cache-tokens), passed on to that service; unset, the service's environment and defaults apply."""
    from treeserve.cli.launcher import UP_SETS
    from treeserve.settings import SERVICE_SETTINGS

    for service, settings in SERVICE_SETTINGS.items():
        group = up.add_argument_group(f"{service} flags", f"passed to the {service} as --FLAG (see python -m "
                                                           f"treeserve.{service} --help)")
        for field in settings.fields():
            if field.name in UP_SETS[service]:
                continue
            flag = field.name.replace("_", "-")
            group.add_argument(f"--{service}-{flag}", dest=f"{service}__{field.name}", metavar=flag.upper(),
                               action="append" if field.type in ("list[str]", list[str]) else "store",
                               help=field.metadata["option"].help.replace("%", "%%"))


def up_settings(*flags: str) -> argparse.Namespace:
    """`treeserve up`'s settings from these flags and its own defaults for the rest: how the benches start a
    stack (`launcher.start_stack`) exactly as `treeserve up` would."""
    return build_parser().parse_args(["up", *flags])


def add_drafter_training_commands(commands) -> None:
    """train-drafter and make-prompts. Their arguments live here: building the parser (for every command, the
    container healthcheck included) must not import torch, which the training module needs."""
    train = commands.add_parser(
        "train-drafter", help="train a DFlash drafter for a target on its own responses",
        description="Regenerate responses to the --data prompts with the target (kept in OUT), then train a DFlash "
                    "drafter on them; resumes from OUT/trainer-state.pt; writes a z-lab checkpoint to OUT.")
    train.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default smollm2-135m)")
    train.add_argument("--out", required=True, type=Path, help="output folder (checkpoint, data, training.json)")
    train.add_argument("--data", required=True, type=Path,
                       help='training prompts, JSONL of {"prompt": ..., "chat": true|false} (see make-prompts)')
    train.add_argument("--limit", type=int, help="train on the first N prompts of --data only (default: all)")
    train.add_argument("--responses", type=Path,
                       help="the target's responses to --data, kept and reused here (default OUT/data.jsonl): "
                            "runs that share one file regenerate once; a file answering more of the same prompts "
                            "serves a --limit run")
    train.add_argument("--regenerate-only", action="store_true",
                       help="stop once the responses are written (regenerate once, then train several drafters)")
    train.add_argument("--eval-data", type=Path, help="held-out prompts (default: the last --held-out of --data)")
    train.add_argument("--held-out", type=int, default=64, help="held-out sequences (default 64)")
    train.add_argument("--max-new-tokens", type=int, default=256, help="response cap when regenerating (256)")
    train.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (default 0: greedy)")
    train.add_argument("--gen-batch", type=int, default=64, help="requests regenerated at once (default 64)")
    train.add_argument("--block-size", type=int, default=16, help="root + drafted positions (default 16)")
    train.add_argument("--layers", type=int, default=1, help="draft decoder layers (default 1)")
    train.add_argument("--intermediate-size", type=int, help="draft MLP width (default: the target's)")
    train.add_argument("--target-layers", type=int, default=3, help="target layers feeding the context (default 3)")
    train.add_argument("--target-layer-ids", help="explicit 0-based target layer ids, comma-separated")
    start = train.add_mutually_exclusive_group()
    start.add_argument("--init-from-target", action="store_true",
                       help="start the draft layers from the target's last layers where shapes match")
    start.add_argument("--init-from", type=Path, metavar="DRAFTER",
                       help="start from this drafter checkpoint (its layers, block size and target layers must be "
                            "the ones the flags ask for), to go on training it on new data")
    train.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    train.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step (default 16)")
    train.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    train.add_argument("--warmup", type=int, help="warm-up steps (default 5%% of --steps)")
    train.add_argument("--loss-decay", type=float, default=7.0, metavar="GAMMA",
                       help="weight exp(-(k-1)/GAMMA) on block position k (default 7; <= 0: uniform)")
    train.add_argument("--log-every", type=int, default=10, help="progress line every N steps (default 10)")
    train.add_argument("--eval-every", type=int, default=250, help="held-out evaluation every N steps (250)")
    train.add_argument("--save-every", type=int, default=500, help="resumable checkpoint every N steps (500)")
    train.add_argument("--seed", type=int, default=0, help="data order, anchors and init (default 0)")
    train.add_argument("--device", choices=DEVICES, help="default cuda when available (bf16), else cpu")
    train.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                       help="dtype of the saved drafter weights (default bfloat16)")

    prompts = commands.add_parser(
        "make-prompts", help="build training or held-out prompts from code and docs (JSONL, .xz/.gz compressed)",
        description="Cut functions, classes and runs of lines out of code, and passages out of documentation and "
                    "manual pages, and write them as chat prompts (code tasks; summarise, explain, rewrite, question, "
                    "continue for prose), deterministically for a seed. Sources: --from folders, registered "
                    "--sources, or a --preset (training, held-out-code, held-out-prose, or all three).")
    where = prompts.add_mutually_exclusive_group(required=True)
    where.add_argument("--from", dest="roots", action="append", type=Path, metavar="DIR",
                       help="folder to take code and docs from (repeatable)")
    where.add_argument("--sources", metavar="NAME,...", help="registered sources (see --list-sources)")
    where.add_argument("--preset", choices=("training", "held-out-code", "held-out-prose", "all"),
                       help="a registered set; all: training to --out, held-out sets to --held-out-dir")
    where.add_argument("--list-sources", action="store_true", help="print the registered sources and exit")
    where.add_argument("--install-commands", action="store_true",
                       help="print the commands that install the registered sources and exit")
    prompts.add_argument("--out", type=Path, help="the prompts file to write (JSONL; .xz or .gz: compressed)")
    prompts.add_argument("--held-out-dir", type=Path, default=Path("services/common/prompts"),
                         help="--preset all: folder of the held-out sets (default services/common/prompts, where treeserve ships them)")
    prompts.add_argument("--limit", type=int, help="prompts at most (default 10000, or the preset's size)")
    prompts.add_argument("--seed", type=int, default=0, help="which snippets and their order (default 0)")
    prompts.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                         help="--from: skip paths (relative to --from) or folder/file names matching GLOB")
    prompts.add_argument("--licence", default="not recorded", help="--from: the licence written into each prompt")
    prompts.add_argument("--per-file", type=int, default=8,
                         help="prompts per file at most, plus one per 150 lines of code or 40 of prose (default 8)")


def generation_params(args) -> GenerationParams:
    params = GenerationParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop_token_ids=tuple(args.stop_token_id), stop_strings=tuple(args.stop))
    params.validate()
    return params


def read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise TreeserveError(f"cannot read prompt file {args.prompt_file}: {error}") from None
    else:
        text = args.prompt
    if not text:
        raise TreeserveError("the prompt is empty")
    return text


def make_drafter(args, target, graphs: bool):
    """The drafter `generate` asked for, loaded for the target (None for plain decoding)."""
    if args.drafter == "none":
        return None
    from treeserve.drafter import load_drafter

    return load_drafter(args.drafter, args.drafter_path, args.tree, target=target, device=args.device,
                        dtype=args.dtype, max_batch=1, graphs=graphs, max_budget=args.budget)


def resolved_drafter(args) -> str:
    """--drafter with auto resolved for --target (without importing torch)."""
    from treeserve.drafter import resolve_kind

    return resolve_kind(args.drafter, args.target)


def stream_text(generation) -> None:
    """Run the generation to the end, printing text as it settles."""
    from treeserve.detokenize import TextStream

    stream = TextStream(generation.tokenizer, generation.stops.ids, generation.params.stop_strings)
    while not generation.finished:
        committed = generation.step()
        sys.stdout.write(stream.push(committed, final=generation.finished))
        sys.stdout.flush()


def check_budget_tp_graphs(args) -> None:
    """The checks `generate` and `up` share, made once before anything loads."""
    if not 1 <= args.budget <= MAX_BUDGET:
        raise TreeserveError(f"--budget must be between 1 and {MAX_BUDGET}, got {args.budget}")
    if args.tp < 1:
        raise TreeserveError(f"--tp must be at least 1, got {args.tp}")
    if args.cuda_graphs == "on" and args.device != "cuda":
        raise TreeserveError("--cuda-graphs on needs --device cuda")


def run_generate(args) -> int:
    check_budget_tp_graphs(args)
    if args.tp == 1:
        return generate_on_rank(args, None)
    generation_params(args)  # bad input fails here once, not once per rank
    read_prompt(args)
    from treeserve import parallel
    from treeserve.verifier.tensor_parallel import follower_main

    if args.seed is None:  # rank 0 samples, but the seed is reported
        from treeserve.sampling import random_seed

        args.seed = random_seed()
    if "RANK" in os.environ:  # started by torchrun (or another launcher) as one of its ranks
        if int(os.environ["WORLD_SIZE"]) != args.tp:
            raise TreeserveError(f"--tp {args.tp}, but the launcher started {os.environ['WORLD_SIZE']} ranks")
        if int(os.environ["RANK"]) != 0:
            return follower_main(args)
        return generate_on_rank(args, parallel.join(args.device))
    followers = parallel.start_followers(follower_main, args, args.tp)
    try:
        return generate_on_rank(args, parallel.join(args.device))
    finally:
        parallel.stop_followers(followers)


def generate_on_rank(args, shard) -> int:
    """`generate` on one process: the whole target (shard None), or rank 0 of a tensor-parallel one, whose
    followers repeat its forwards (treeserve.verifier.tensor_parallel)."""
    params = generation_params(args)
    prompt = read_prompt(args)
    from treeserve import parallel
    from treeserve.loading import load_target
    from treeserve.models.graphs import graphs_wanted
    from treeserve.verifier import Generation
    from treeserve.verifier.tensor_parallel import Mirror, build_mirrored_verifier

    chosen, args.drafter = args.drafter, resolved_drafter(args)
    if shard is not None and args.drafter in ("dflash", "merged"):  # it would run the target's sharded LM head on rank 0 alone
        if chosen != "auto":
            raise TreeserveError("--tp: the DFlash drafter runs as its own service beside a tensor-parallel "
                                 "verifier; here use --drafter ngram, a draft model, or none")
        args.drafter = "ngram"
    target = load_target(args.target, device=args.device, dtype=args.dtype, shard=shard)
    graphs = graphs_wanted(args.cuda_graphs, args.device)
    drafter = make_drafter(args, target, graphs)
    tokenizer = target.tokenizer
    prompt_ids = tokenizer.encode_prompt(prompt, args.chat)
    budget = args.budget if drafter is not None else 0
    mirror = None if shard is None else Mirror(parallel.control_group())
    try:
        # A pool of exactly this request's size; graphs for its one batch size and tree sizes up to its budget.
        verifier = build_mirrored_verifier(target.model, mirror, max_batch=1, graphs=graphs,
                                           kv_cache_tokens=len(prompt_ids) + params.max_new_tokens + budget,
                                           max_tree=budget + 1)
        generation = Generation(target.model, tokenizer, prompt_ids, params, drafter, budget, verifier=verifier)
        if verifier.use_graphs:
            verifier.capture(generation.features.layer_ids)
        if args.json:
            while not generation.finished:
                generation.step()
        else:
            stream_text(generation)
    finally:
        if mirror is not None:
            mirror.close()
    result = generation.result()
    summary = {
        "token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens, "rounds": result.rounds,
        "mean_accepted": round(result.mean_accepted, 4), "tokens_per_s": round(result.tokens_per_s, 3),
        "prefill_s": round(result.prefill_s, 4), "elapsed_s": round(result.elapsed_s, 4),
        "seed": result.seed, "target": args.target, "drafter": args.drafter,
        "budget": args.budget if drafter else 0, **({"tree": args.tree} if args.drafter in ("dflash", "merged") else {}),
    }
    print_result(summary, args.json)
    return 0


def print_result(summary: dict, as_json: bool) -> None:
    """The end of a generate or client call: the JSON object, or (after streamed text) a one-line summary."""
    if as_json:
        print(json.dumps(summary))
        return
    print()
    print(f"[{len(summary['token_ids'])} tokens in {summary['elapsed_s']:.2f} s ({summary['tokens_per_s']:.1f} "
          f"tok/s), {summary['rounds']} rounds, {summary['mean_accepted']:.2f} tokens/round, "
          f"finish: {summary['finish_reason']}]", file=sys.stderr)


def run_client(args) -> int:
    from treeserve.gateway.client import main_client

    return main_client(args)


def run_up_command(args) -> int:
    check_budget_tp_graphs(args)
    if args.max_batch < 1:
        raise TreeserveError(f"--max-batch must be at least 1, got {args.max_batch}")
    args.drafter = resolved_drafter(args)
    if args.drafter == "model" and not args.drafter_path:
        raise TreeserveError("--drafter model needs --drafter-path")
    from treeserve.cli.launcher import run_up

    return run_up(args)


def run_health(args) -> int:
    from treeserve.cli.launcher import health_status

    status = health_status(args.address, args.timeout_s)
    if status != "SERVING":
        raise TreeserveError(f"{args.address} is {status}")
    print(status)
    return 0


def run_train_drafter(args) -> int:
    from treeserve.drafter.training.train import run

    return run(args)


def run_make_prompts(args) -> int:
    from treeserve.drafter.training.corpus_sources import run

    return run(args)


def run_bench(args) -> int:
    from treeserve.bench.load import main_bench

    return main_bench(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[2:] if argv is None else list(argv[1:])  # the command's own flags, for reports
    commands = {"generate": run_generate, "client": run_client, "up": run_up_command, "health": run_health,
                "train-drafter": run_train_drafter, "make-prompts": run_make_prompts, "bench": run_bench}
    try:
        return commands[args.command](args)
    except TreeserveError as error:
        print(f"treeserve {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"treeserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
