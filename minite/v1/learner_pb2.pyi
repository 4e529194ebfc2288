from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "rollout_logprobs", "reward", "weight_version", "temperature")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    weight_version: int
    temperature: float
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., weight_version: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class SubmitSummary(_message.Message):
    __slots__ = ("accepted", "tokens", "logprob_abs_diff_max", "kl_k3", "bitwise_equal_ratio")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ABS_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    KL_K3_FIELD_NUMBER: _ClassVar[int]
    BITWISE_EQUAL_RATIO_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    tokens: int
    logprob_abs_diff_max: float
    kl_k3: float
    bitwise_equal_ratio: float
    def __init__(self, accepted: _Optional[int] = ..., tokens: _Optional[int] = ..., logprob_abs_diff_max: _Optional[float] = ..., kl_k3: _Optional[float] = ..., bitwise_equal_ratio: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("prompt_ids", "completion_ids", "temperature", "weight_version")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    weight_version: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("step", "weight_version", "total_steps", "running", "done", "reward_mean", "logprob_abs_diff_max", "rollout_replicas", "last_error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ABS_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    total_steps: int
    running: bool
    done: bool
    reward_mean: float
    logprob_abs_diff_max: float
    rollout_replicas: _containers.RepeatedScalarFieldContainer[str]
    last_error: str
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., total_steps: _Optional[int] = ..., running: _Optional[bool] = ..., done: _Optional[bool] = ..., reward_mean: _Optional[float] = ..., logprob_abs_diff_max: _Optional[float] = ..., rollout_replicas: _Optional[_Iterable[str]] = ..., last_error: _Optional[str] = ...) -> None: ...
