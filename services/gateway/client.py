"""A client of the gateway: `generate_via_gateway` for programs, `treeserve client` on the command line."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc

from treeserve.errors import TreeserveError
from treeserve.params import GenerationParams
from treeserve.serving import MESSAGE_OPTIONS, NO_BDP_PROBE, default_address, normalize_address
from treeserve.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from treeserve.wire import FINISH_REASONS, params_to_proto

FINISH_NAMES = {value: name for name, value in FINISH_REASONS.items()}


async def generate_via_gateway(address: str, prompt: str, params: GenerationParams, chat: bool = False,
                               budget: int | None = None, drafter_enabled: bool = True, on_text=None,
                               timeout: float | None = None) -> dict:
    """Streams one request through the gateway at `address`, calling on_text(text) as text settles; returns
    the object `treeserve generate --json` prints (prefill_s is the time to the first token). Raises
    grpc.aio.AioRpcError when the gateway refuses or fails the request."""
    sampling, stop = params_to_proto(params)
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, chat=chat, sampling=sampling, stop=stop,
        speculation=generation_pb2.SpeculationParams(disabled=not drafter_enabled, budget=budget or 0))
    token_ids, texts, final, first_token_s = [], [], None, None
    started = time.perf_counter()
    options = MESSAGE_OPTIONS + NO_BDP_PROBE  # the gateway may be draining this stream (serving.NO_BDP_PROBE)
    async with grpc.aio.insecure_channel(normalize_address(address), options=options) as channel:
        async for reply in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=timeout):
            if reply.token_ids and first_token_s is None:
                first_token_s = time.perf_counter() - started
            token_ids += reply.token_ids
            if reply.text:
                texts.append(reply.text)
                if on_text is not None:
                    on_text(reply.text)
            if reply.finish_reason:
                final = reply
    elapsed = time.perf_counter() - started
    if final is None:
        raise TreeserveError("the gateway ended the stream without a final message")
    return {
        "token_ids": token_ids, "text": "".join(texts), "finish_reason": FINISH_NAMES[final.finish_reason],
        "prompt_tokens": final.usage.prompt_tokens, "rounds": final.stats.rounds,
        "mean_accepted": round(final.stats.mean_accepted, 4),
        "tokens_per_s": round(len(token_ids) / elapsed, 3) if elapsed > 0 else 0.0,
        "prefill_s": round(first_token_s if first_token_s is not None else elapsed, 4),
        "elapsed_s": round(elapsed, 4), "seed": final.seed,
    }


def add_client_arguments(parser) -> None:
    """The flags of `treeserve client`: the gateway's address and speculation, plus those of generate."""
    from treeserve.cli import add_generation_arguments

    parser.add_argument("--address", default=os.environ.get("TREESERVE_GATEWAY_ADDRESS", default_address("gateway")),
                        help="the gateway (default $TREESERVE_GATEWAY_ADDRESS or %(default)s)")
    parser.add_argument("--budget", type=int, help="drafted tree nodes per round (default: the verifier's)")
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding, no draft trees")
    parser.add_argument("--timeout", type=float, help="deadline for the whole request, in seconds")
    add_generation_arguments(parser)


def write_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main_client(args) -> int:
    """`treeserve client`: stream the text to stdout (or print the --json object); errors are one line."""
    from treeserve.cli import generation_params, print_result, read_prompt

    try:
        if args.budget is not None and args.budget < 1:
            raise TreeserveError(f"--budget must be at least 1, got {args.budget}")
        params, prompt = generation_params(args), read_prompt(args)
        result = asyncio.run(generate_via_gateway(args.address, prompt, params, args.chat, args.budget,
                                                  not args.no_speculation, None if args.json else write_text,
                                                  args.timeout))
    except TreeserveError as error:
        print(f"treeserve client: error: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:
        print(f"treeserve client: error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print_result(result, args.json)
    return 0


def stream_demo(address: str, prompt: str, max_new_tokens: int = 96) -> None:
    """`treeserve up --demo-prompt`: one chat request streamed to the terminal."""
    from treeserve.cli import print_result

    print(f"demo> {prompt}", flush=True)
    result = asyncio.run(generate_via_gateway(address, prompt, GenerationParams(max_new_tokens=max_new_tokens),
                                              chat=True, on_text=write_text))
    print_result(result, as_json=False)
