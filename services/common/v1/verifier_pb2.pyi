from treeserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    stop: _generation_pb2.StopConditions
    speculation: _generation_pb2.SpeculationParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[_generation_pb2.StopConditions, _Mapping]] = ..., speculation: _Optional[_Union[_generation_pb2.SpeculationParams, _Mapping]] = ...) -> None: ...

class VerifierServiceGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "stats", "seed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generation_pb2.FinishReason
    usage: _generation_pb2.Usage
    stats: _generation_pb2.SpeculationStats
    seed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., stats: _Optional[_Union[_generation_pb2.SpeculationStats, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class VerifierServiceSessionRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: SessionStart
    cancel: str
    def __init__(self, start: _Optional[_Union[SessionStart, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("request", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: VerifierServiceGenerateRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[VerifierServiceGenerateRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifierServiceSessionResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SessionUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SessionUpdate, _Mapping]]] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("request_id", "response", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: VerifierServiceGenerateResponse
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[VerifierServiceGenerateResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class VerifierServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierServiceGetInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "eos_token_ids", "max_budget", "default_budget", "drafters", "session_socket")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_budget: int
    default_budget: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    session_socket: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_budget: _Optional[int] = ..., default_budget: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., session_socket: _Optional[str] = ...) -> None: ...
