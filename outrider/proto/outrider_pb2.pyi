from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class DraftSampling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SAMPLING_UNSPECIFIED: _ClassVar[DraftSampling]
    DRAFT_SAMPLING_DETERMINISTIC: _ClassVar[DraftSampling]
    DRAFT_SAMPLING_WITH_REPLACEMENT: _ClassVar[DraftSampling]
    DRAFT_SAMPLING_WITHOUT_REPLACEMENT: _ClassVar[DraftSampling]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
DRAFT_SAMPLING_UNSPECIFIED: DraftSampling
DRAFT_SAMPLING_DETERMINISTIC: DraftSampling
DRAFT_SAMPLING_WITH_REPLACEMENT: DraftSampling
DRAFT_SAMPLING_WITHOUT_REPLACEMENT: DraftSampling

class Limits(_message.Message):
    __slots__ = ("max_batch", "max_nodes", "max_depth", "max_top_k", "max_q_width")
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_Q_WIDTH_FIELD_NUMBER: _ClassVar[int]
    max_batch: int
    max_nodes: int
    max_depth: int
    max_top_k: int
    max_q_width: int
    def __init__(self, max_batch: _Optional[int] = ..., max_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ..., max_top_k: _Optional[int] = ..., max_q_width: _Optional[int] = ...) -> None: ...

class FeatureSpec(_message.Message):
    __slots__ = ("layer_ids", "hidden_size", "projected", "dtype")
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    projected: bool
    dtype: str
    def __init__(self, layer_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., projected: _Optional[bool] = ..., dtype: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "target_model_id", "vocab_size", "vocab_fingerprint", "method", "target_num_layers", "target_hidden_size", "limits")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TARGET_NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    target_model_id: str
    vocab_size: int
    vocab_fingerprint: str
    method: str
    target_num_layers: int
    target_hidden_size: int
    limits: Limits
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., target_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., method: _Optional[str] = ..., target_num_layers: _Optional[int] = ..., target_hidden_size: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "draft_model_id", "target_model_id", "vocab_size", "vocab_fingerprint", "method", "features", "limits", "projection_sha256", "incarnation")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_SHA256_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    draft_model_id: str
    target_model_id: str
    vocab_size: int
    vocab_fingerprint: str
    method: str
    features: FeatureSpec
    limits: Limits
    projection_sha256: str
    incarnation: int
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., draft_model_id: _Optional[str] = ..., target_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., method: _Optional[str] = ..., features: _Optional[_Union[FeatureSpec, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., projection_sha256: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class FeatureProjectionRequest(_message.Message):
    __slots__ = ("max_chunk_bytes",)
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_chunk_bytes: int
    def __init__(self, max_chunk_bytes: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "min_tokens", "stop_ids", "num_prompt")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., num_prompt: _Optional[int] = ...) -> None: ...

class TreeBudget(_message.Message):
    __slots__ = ("max_nodes", "max_depth", "top_k", "q_width")
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    Q_WIDTH_FIELD_NUMBER: _ClassVar[int]
    max_nodes: int
    max_depth: int
    top_k: int
    q_width: int
    def __init__(self, max_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ..., top_k: _Optional[int] = ..., q_width: _Optional[int] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("seq_id", "round", "new_tokens", "features", "sampling", "budget", "finished", "reset", "answered")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    sampling: SamplingParams
    budget: TreeBudget
    finished: bool
    reset: bool
    answered: bool
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., budget: _Optional[_Union[TreeBudget, _Mapping]] = ..., finished: _Optional[bool] = ..., reset: _Optional[bool] = ..., answered: _Optional[bool] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ...) -> None: ...

class CandidateTree(_message.Message):
    __slots__ = ("seq_id", "round", "tokens", "parents", "q_nodes", "q_top_k", "q_token_ids", "q_probs", "sampling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_NODES_FIELD_NUMBER: _ClassVar[int]
    Q_TOP_K_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    q_nodes: _containers.RepeatedScalarFieldContainer[int]
    q_top_k: int
    q_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    sampling: DraftSampling
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., q_nodes: _Optional[_Iterable[int]] = ..., q_top_k: _Optional[int] = ..., q_token_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., sampling: _Optional[_Union[DraftSampling, str]] = ...) -> None: ...

class SpeculativeTree(_message.Message):
    __slots__ = ("new_tokens", "tree")
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    tree: CandidateTree
    def __init__(self, new_tokens: _Optional[_Iterable[int]] = ..., tree: _Optional[_Union[CandidateTree, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("trees", "speculative")
    TREES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[CandidateTree]
    speculative: _containers.RepeatedCompositeFieldContainer[SpeculativeTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[CandidateTree, _Mapping]]] = ..., speculative: _Optional[_Iterable[_Union[SpeculativeTree, _Mapping]]] = ...) -> None: ...
