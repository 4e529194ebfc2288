from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_MODE_FINISH_IN_FLIGHT: _ClassVar[UpdateMode]
    UPDATE_MODE_ABORT_IN_FLIGHT: _ClassVar[UpdateMode]
UPDATE_MODE_FINISH_IN_FLIGHT: UpdateMode
UPDATE_MODE_ABORT_IN_FLIGHT: UpdateMode

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n", "top_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    top_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "text", "params", "model")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: TokenIds
    text: str
    params: SamplingParams
    model: str
    def __init__(self, prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "weight_version", "text", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    weight_version: int
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_ids", "choices", "weight_version", "model")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    weight_version: int
    model: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., weight_version: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token_id", "logprob", "finish_reason", "weight_version", "text", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    logprob: float
    finish_reason: str
    weight_version: int
    text: str
    top_logprobs: TopLogprobs
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class UpdateBegin(_message.Message):
    __slots__ = ("version", "mode", "num_tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: UpdateMode
    num_tensors: int
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[_Union[UpdateMode, str]] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "format", "shape", "part", "part_shape", "offset", "part_bytes", "payload", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PART_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    part: str
    part_shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    part_bytes: int
    payload: bytes
    crc32: int
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., part: _Optional[str] = ..., part_shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., part_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class UpdateEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("begin", "chunk", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: UpdateBegin
    chunk: TensorChunk
    end: UpdateEnd
    def __init__(self, begin: _Optional[_Union[UpdateBegin, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., end: _Optional[_Union[UpdateEnd, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "tensors", "seconds", "aborted_sequences")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    tensors: int
    seconds: float
    aborted_sequences: int
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., tensors: _Optional[int] = ..., seconds: _Optional[float] = ..., aborted_sequences: _Optional[int] = ...) -> None: ...

class CpuArena(_message.Message):
    __slots__ = ("manager_handle", "filename", "size")
    MANAGER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    manager_handle: bytes
    filename: bytes
    size: int
    def __init__(self, manager_handle: _Optional[bytes] = ..., filename: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class CudaArena(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class SharedPart(_message.Message):
    __slots__ = ("part", "part_shape", "offset", "nbytes", "crc32", "checksum")
    PART_FIELD_NUMBER: _ClassVar[int]
    PART_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    part: str
    part_shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    crc32: int
    checksum: int
    def __init__(self, part: _Optional[str] = ..., part_shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "format", "shape", "parts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    parts: _containers.RepeatedCompositeFieldContainer[SharedPart]
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., parts: _Optional[_Iterable[_Union[SharedPart, _Mapping]]] = ...) -> None: ...

class SharedUpdate(_message.Message):
    __slots__ = ("version", "mode", "cpu", "cuda", "boot_id", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: UpdateMode
    cpu: CpuArena
    cuda: CudaArena
    boot_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[_Union[UpdateMode, str]] = ..., cpu: _Optional[_Union[CpuArena, _Mapping]] = ..., cuda: _Optional[_Union[CudaArena, _Mapping]] = ..., boot_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ...) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
