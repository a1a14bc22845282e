"""Conversions between the protobuf messages and the engine's own types, shared by every service."""

from __future__ import annotations

from treeserve.errors import TreeserveError
from treeserve.feature_region import PlacedRows
from treeserve.params import GenerationParams
from treeserve.v1 import drafter_pb2, generation_pb2

FEATURE_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names


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


def features_to_proto(features, into: drafter_pb2.Features | None = None) -> drafter_pb2.Features:
    """(tokens, width) hidden states (a torch tensor) as raw little-endian bytes plus their shape and dtype, or for
    rows written to the stream's feature region (a treeserve.feature_region.PlacedRows) where they lie; filled into
    a message's field (`into`) where given, so that the bytes are not copied once more into it."""
    import torch  # here, not at the top: the gateway and clients use this module without torch

    name = str(features.dtype).removeprefix("torch.")
    if name not in FEATURE_DTYPES:
        raise TreeserveError(f"features of dtype {features.dtype} cannot be sent")
    message = drafter_pb2.Features() if into is None else into
    if isinstance(features, PlacedRows):
        message.region_offset = features.offset
    else:
        message.data = features.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    message.shape[:] = list(features.shape)
    message.dtype = name
    return message


def features_from_proto(message: drafter_pb2.Features, region=None, copy: bool = True):
    """The rows a Features message carries, or points to in the stream's feature region (a
    treeserve.feature_region.MappedRegion, None where the stream shared none), as a tensor of their own; with
    `copy=False`, rows in the region as a view of it (MappedRegion.rows says when that is safe)."""
    import torch

    if message.dtype not in FEATURE_DTYPES:
        raise TreeserveError(f"features of unknown dtype {message.dtype!r} (use {', '.join(FEATURE_DTYPES)})")
    dtype = getattr(torch, message.dtype)
    shape, data = tuple(message.shape), message.data  # each read of a bytes field copies it: read it once
    in_region = message.HasField("region_offset")
    size = shape[0] * shape[1] * dtype.itemsize if len(shape) == 2 else -1
    if size < 0 or (not in_region and size != len(data)) or (in_region and data):
        raise TreeserveError(f"features: {len(data)} bytes do not hold shape {shape} of {message.dtype}"
                             f"{' (whose rows are in the feature region)' if in_region else ''}")
    if in_region:
        if region is None:
            raise TreeserveError("features in a feature region, but this stream has none (only a framed stream "
                                 "can share one)")
        return region.rows(message.region_offset, shape, dtype, copy)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
