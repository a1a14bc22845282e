from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Features(_message.Message):
    __slots__ = ("data", "shape", "dtype", "region_offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    region_offset: int
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., region_offset: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "budget", "features", "finished", "trace_context", "lookup_only")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    budget: int
    features: Features
    finished: bool
    trace_context: _containers.ScalarMap[str, str]
    lookup_only: bool
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., budget: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., finished: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., lookup_only: _Optional[bool] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("round", "items")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    round: int
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    def __init__(self, round: _Optional[int] = ..., items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("request_id", "token_ids", "parents", "log_probs", "lookup_nodes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_NODES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    lookup_nodes: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., log_probs: _Optional[_Iterable[float]] = ..., lookup_nodes: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("round", "trees", "propose_seconds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    propose_seconds: float
    def __init__(self, round: _Optional[int] = ..., trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., propose_seconds: _Optional[float] = ...) -> None: ...

class DrafterServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterServiceGetInfoResponse(_message.Message):
    __slots__ = ("kind", "max_budget", "feature_layer_ids", "draft_socket", "lookup_trees")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TREES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    max_budget: int
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_socket: str
    lookup_trees: bool
    def __init__(self, kind: _Optional[str] = ..., max_budget: _Optional[int] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., draft_socket: _Optional[str] = ..., lookup_trees: _Optional[bool] = ...) -> None: ...
