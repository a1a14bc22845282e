"""python -m treeserve.bench.transformers_baseline: the outside baseline, transformers' own `generate`.

The same target (loaded by treeserve's loader, so a GGUF works too, then handed to transformers with its
weights under HF names), the same prompts and the same number of new tokens, one request at a time: greedy
`generate`, its prompt-lookup mode (transformers' n-gram speculation), and assisted generation with a smaller
model when --assistant names one. Reports tokens per second per mode, and how many outputs equal treeserve's
greedy output (with --compare). transformers is a test dependency of treeserve, not a run-time one.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import torch

from treeserve.settings import OneLineErrorParser
from treeserve.errors import TreeserveError
from treeserve.prompt_sets import WORKLOADS

MODES = ("greedy", "prompt-lookup", "assisted")


def hf_model(spec: str, device: str, dtype: str):
    """The transformers model of `spec`, with treeserve's weights (any format treeserve loads)."""
    try:
        import transformers
    except ImportError:
        raise TreeserveError("this baseline needs transformers (pip install '.[test]')") from None
    from treeserve.loading import load_target
    from treeserve.loading.weights import checkpoint_state

    target = load_target(spec, device="cpu", dtype="float32")
    cfg = target.model.config
    if cfg.rope_scaling is not None or cfg.rope_freq_factors is not None:
        raise TreeserveError(f"{spec}: RoPE scaling is not mapped to transformers here; use the HF folder")
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    config = classes[cfg.family](
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_context,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": cfg.rope_theta},
        eos_token_id=sorted(target.tokenizer.eos_ids), bos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(checkpoint_state(target.model), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise TreeserveError(f"{spec}: weights do not map onto transformers' {cfg.family} model "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model.to(device, getattr(torch, dtype)).eval(), target.tokenizer


def timed_generate(model, ids: list[int], max_new_tokens: int, device: str, **mode) -> tuple[list[int], float]:
    inputs = torch.tensor([ids], device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, **mode)
    if device == "cuda":
        torch.cuda.synchronize()
    return out[0, len(ids):].tolist(), time.perf_counter() - started


def parse_args(argv=None):
    p = OneLineErrorParser(prog="python -m treeserve.bench.transformers_baseline", description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", default=str(WORKLOADS["code"]))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--modes", default="greedy,prompt-lookup", help=f"of {', '.join(MODES)} (default greedy,"
                   "prompt-lookup)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt-lookup: tokens proposed (default 10)")
    p.add_argument("--assistant", help="assisted: the smaller model (a spec treeserve loads)")
    p.add_argument("--compare", action="store_true",
                   help="also run treeserve's plain greedy decoding in-process and count equal outputs")
    p.add_argument("--out", help="write the figures here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from treeserve.prompt_sets import encode_prompts, read_prompts

    try:
        modes = args.modes.split(",")
        if unknown := set(modes) - set(MODES):
            raise TreeserveError(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
        if "assisted" in modes and not args.assistant:
            raise TreeserveError("--modes assisted needs --assistant")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise TreeserveError("no CUDA device (use --device cpu)")
        model, tokenizer = hf_model(args.target, args.device, args.dtype)
        assistant = hf_model(args.assistant, args.device, args.dtype)[0] if "assisted" in modes else None
        prompts = encode_prompts(tokenizer, read_prompts(Path(args.prompts))[:args.limit])
    except TreeserveError as error:
        print(f"transformers_baseline: error: {error}", file=sys.stderr)
        return 1
    options = {"greedy": {}, "prompt-lookup": {"prompt_lookup_num_tokens": args.prompt_lookup_tokens},
               "assisted": {"assistant_model": assistant}}
    timed_generate(model, prompts[0], 4, args.device)  # warm-up: kernels chosen, caches built
    outputs, rows = {}, []
    for mode in modes:
        tokens, seconds, outputs[mode] = 0, 0.0, []
        for ids in prompts:
            out, elapsed = timed_generate(model, ids, args.max_new_tokens, args.device, **options[mode])
            outputs[mode].append(out)
            tokens, seconds = tokens + len(out), seconds + elapsed
        rows.append({"mode": mode, "tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 2)})
        print(f"transformers {mode:14s} {tokens / seconds:8.1f} tok/s ({tokens} tokens)", flush=True)
    if args.compare:
        from treeserve.loading import load_target
        from treeserve.params import GenerationParams
        from treeserve.verifier import generate

        target = load_target(args.target, device=args.device, dtype=args.dtype)
        params = GenerationParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        ours = [generate(target.model, target.tokenizer, ids, params).token_ids for ids in prompts]
        for row in rows:
            same = sum(a == b for a, b in zip(outputs[row["mode"]], ours))
            row["identical_to_treeserve_greedy"] = f"{same}/{len(prompts)}"
            print(f"transformers {row['mode']}: {same}/{len(prompts)} outputs equal treeserve's greedy")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m treeserve.bench.transformers_baseline "
                       + shlex.join(sys.argv[1:] if argv is None else argv), "target": args.target,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
