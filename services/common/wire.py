"""Conversions between the protobuf messages and the engine's own types, shared by every service."""

from __future__ import annotations

from treeserve.sampling import GenerationParams
from treeserve.v1 import generation_pb2


def params_from_proto(sampling: generation_pb2.SamplingParams, stop: generation_pb2.StopConditions,
                      default_max_new_tokens: int) -> GenerationParams:
    """Unset fields take the defaults the protos document (top_p 0 means 1.0, max_new_tokens 0 the server's
    default). The caller validates: GenerationParams.validate() raises TreeserveError on bad values."""
    return GenerationParams(
        max_new_tokens=stop.max_new_tokens or default_max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop_token_ids=tuple(stop.stop_token_ids),
        stop_strings=tuple(stop.stop_strings),
        ignore_eos=stop.ignore_eos,
    )


def params_to_proto(params: GenerationParams) -> tuple[generation_pb2.SamplingParams, generation_pb2.StopConditions]:
    sampling = generation_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        sampling.seed = params.seed
    stop = generation_pb2.StopConditions(max_new_tokens=params.max_new_tokens, stop_token_ids=params.stop_token_ids,
                                         stop_strings=params.stop_strings, ignore_eos=params.ignore_eos)
    return sampling, stop


FINISH_REASONS = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH}
