from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("disabled", "budget")
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    disabled: bool
    budget: int
    def __init__(self, disabled: _Optional[bool] = ..., budget: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "round_tokens", "drafted_tokens", "mean_accepted")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    round_tokens: int
    drafted_tokens: int
    mean_accepted: float
    def __init__(self, rounds: _Optional[int] = ..., round_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., mean_accepted: _Optional[float] = ...) -> None: ...
