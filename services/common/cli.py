"""The `treeserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treeserve.errors import TreeserveError
from treeserve.sampling import GenerationParams
from treeserve.tree import MAX_BUDGET

DRAFTERS = ("none", "ngram")


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes print one line (not the usage block) and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
    gen.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                     help="none: plain autoregressive decoding; ngram: prompt-lookup trees (default)")
    gen.add_argument("--budget", type=int, default=16,
                     help=f"drafted tree nodes per round, 1 to {MAX_BUDGET} (default 16)")
    gen.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="default float32")
    add_generation_arguments(gen)

    from treeserve.gateway.client import add_client_arguments

    client = commands.add_parser("client", help="generate through a running gateway",
                                 description="Send one request to a treeserve gateway and stream its text; "
                                             "--json prints the same object as generate --json.")
    add_client_arguments(client)

    up = commands.add_parser("up", help="run gateway, verifier and drafter on Unix sockets",
                             description="Start the three services on this machine (Unix sockets in a runtime "
                                         "folder), wait until they serve, print the gateway address; Ctrl-C stops all.")
    up.add_argument("--target", default="smollm2-135m", help="model name, HF folder or .gguf (default smollm2-135m)")
    up.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="default ngram; none: plain decoding")
    up.add_argument("--budget", type=int, default=16, help=f"default tree budget, 1 to {MAX_BUDGET} (default 16)")
    up.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    up.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    up.add_argument("--runtime-dir", help="folder for sockets and logs (default: a new temporary folder)")
    up.add_argument("--start-timeout-s", type=float, default=600, help="how long to wait for the services")
    up.add_argument("--grace-s", type=float, default=10, help="drain period on stop (default 10)")
    up.add_argument("--demo-prompt", help="once serving, stream one request with this prompt")
    return parser


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


def make_drafter(name: str):
    if name == "none":
        return None
    from treeserve.drafter import NgramDrafter

    return NgramDrafter()


def stream_text(generation) -> None:
    """Run the generation to the end, printing text as it settles."""
    from treeserve.detokenize import TextStream

    stream = TextStream(generation.tokenizer, generation.stop_ids, generation.params.stop_strings)
    while not generation.finished:
        committed = generation.step()
        sys.stdout.write(stream.push(committed, final=generation.finished))
        sys.stdout.flush()


def run_generate(args) -> int:
    if not 1 <= args.budget <= MAX_BUDGET:
        raise TreeserveError(f"--budget must be between 1 and {MAX_BUDGET}, got {args.budget}")
    params = generation_params(args)
    prompt = read_prompt(args)
    drafter = make_drafter(args.drafter)

    from treeserve.loading import load_target
    from treeserve.verifier import Generation

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    tokenizer = target.tokenizer
    prompt_ids = tokenizer.encode_chat(prompt) if args.chat else tokenizer.encode(prompt)
    generation = Generation(target.model, tokenizer, prompt_ids, params, drafter, args.budget)
    if args.json:
        while not generation.finished:
            generation.step()
    else:
        stream_text(generation)
    result = generation.result()
    summary = {
        "token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens, "rounds": result.rounds,
        "mean_accepted": round(result.mean_accepted, 4), "tokens_per_s": round(result.tokens_per_s, 3),
        "prefill_s": round(result.prefill_s, 4), "elapsed_s": round(result.elapsed_s, 4),
        "seed": result.seed, "target": args.target, "drafter": args.drafter,
        "budget": args.budget if drafter else 0,
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
    if not 1 <= args.budget <= MAX_BUDGET:
        raise TreeserveError(f"--budget must be between 1 and {MAX_BUDGET}, got {args.budget}")
    from treeserve.launcher import run_up

    return run_up(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": run_generate, "client": run_client, "up": run_up_command}[args.command](args)
    except TreeserveError as error:
        print(f"treeserve {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"treeserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
