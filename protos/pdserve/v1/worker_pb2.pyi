from protos.pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_target", "decode_cached_blocks", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    decode_target: str
    decode_cached_blocks: int
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., decode_target: _Optional[str] = ..., decode_cached_blocks: _Optional[int] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "usage", "bytes_sent", "blocks_sent", "prefill_ms", "transfer_ms", "first_logprob")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    usage: _generation_pb2.Usage
    bytes_sent: int
    blocks_sent: int
    prefill_ms: float
    transfer_ms: float
    first_logprob: _generation_pb2.TokenLogprob
    def __init__(self, first_token: _Optional[int] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., bytes_sent: _Optional[int] = ..., blocks_sent: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_here", "first_token", "detokenize", "cache_salt", "first_logprob", "generated_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    prefill_here: bool
    first_token: int
    detokenize: bool
    cache_salt: bytes
    first_logprob: _generation_pb2.TokenLogprob
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., prefill_here: _Optional[bool] = ..., first_token: _Optional[int] = ..., detokenize: _Optional[bool] = ..., cache_salt: _Optional[bytes] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeReply(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "usage", "used_transferred_kv", "prefill_ms", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    USED_TRANSFERRED_KV_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    usage: _generation_pb2.Usage
    used_transferred_kv: bool
    prefill_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., used_transferred_kv: _Optional[bool] = ..., prefill_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ResyncIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResyncIndexReply(_message.Message):
    __slots__ = ("cached_blocks",)
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    def __init__(self, cached_blocks: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "node", "epoch", "active_requests", "waiting_requests", "num_blocks", "free_blocks", "cached_blocks", "used_blocks", "parked_transfers", "held_blocks", "bytes_sent", "bytes_received", "transfer_outcomes", "model_fingerprint", "block_size", "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total", "metrics_address", "serving", "send_outcomes", "preemptions_total", "kv_audited_blocks_total", "kv_audit_mismatches_total", "kv_audit_evicted_total", "kv_audit_seconds_total", "host_blocks", "host_used_blocks", "disk_blocks", "disk_used_blocks", "host_cached_tokens_total", "disk_cached_tokens_total", "steps_total", "step_seconds_total", "kernels", "architecture")
    class TransferOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SendOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARKED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SEND_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_AUDITED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_AUDIT_MISMATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_AUDIT_EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_AUDIT_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    node: str
    epoch: int
    active_requests: int
    waiting_requests: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    parked_transfers: int
    held_blocks: int
    bytes_sent: int
    bytes_received: int
    transfer_outcomes: _containers.ScalarMap[str, int]
    model_fingerprint: str
    block_size: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    metrics_address: str
    serving: bool
    send_outcomes: _containers.ScalarMap[str, int]
    preemptions_total: int
    kv_audited_blocks_total: int
    kv_audit_mismatches_total: int
    kv_audit_evicted_total: int
    kv_audit_seconds_total: float
    host_blocks: int
    host_used_blocks: int
    disk_blocks: int
    disk_used_blocks: int
    host_cached_tokens_total: int
    disk_cached_tokens_total: int
    steps_total: int
    step_seconds_total: float
    kernels: _containers.RepeatedCompositeFieldContainer[KernelChoice]
    architecture: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., epoch: _Optional[int] = ..., active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., parked_transfers: _Optional[int] = ..., held_blocks: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., transfer_outcomes: _Optional[_Mapping[str, int]] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., metrics_address: _Optional[str] = ..., serving: _Optional[bool] = ..., send_outcomes: _Optional[_Mapping[str, int]] = ..., preemptions_total: _Optional[int] = ..., kv_audited_blocks_total: _Optional[int] = ..., kv_audit_mismatches_total: _Optional[int] = ..., kv_audit_evicted_total: _Optional[int] = ..., kv_audit_seconds_total: _Optional[float] = ..., host_blocks: _Optional[int] = ..., host_used_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_used_blocks: _Optional[int] = ..., host_cached_tokens_total: _Optional[int] = ..., disk_cached_tokens_total: _Optional[int] = ..., steps_total: _Optional[int] = ..., step_seconds_total: _Optional[float] = ..., kernels: _Optional[_Iterable[_Union[KernelChoice, _Mapping]]] = ..., architecture: _Optional[str] = ...) -> None: ...

class KernelChoice(_message.Message):
    __slots__ = ("setting", "kernel", "reason")
    SETTING_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    setting: str
    kernel: str
    reason: str
    def __init__(self, setting: _Optional[str] = ..., kernel: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StepsRequest(_message.Message):
    __slots__ = ("after",)
    AFTER_FIELD_NUMBER: _ClassVar[int]
    after: int
    def __init__(self, after: _Optional[int] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("number", "seconds", "prefill_tokens", "prefill_start", "decode_seqs", "decode_context", "gap_seconds", "started_at")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    number: int
    seconds: float
    prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    prefill_start: _containers.RepeatedScalarFieldContainer[int]
    decode_seqs: int
    decode_context: int
    gap_seconds: float
    started_at: float
    def __init__(self, number: _Optional[int] = ..., seconds: _Optional[float] = ..., prefill_tokens: _Optional[_Iterable[int]] = ..., prefill_start: _Optional[_Iterable[int]] = ..., decode_seqs: _Optional[int] = ..., decode_context: _Optional[int] = ..., gap_seconds: _Optional[float] = ..., started_at: _Optional[float] = ...) -> None: ...

class StepsReply(_message.Message):
    __slots__ = ("steps", "steps_total")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    steps_total: int
    def __init__(self, steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., steps_total: _Optional[int] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: int
    def __init__(self, sample: _Optional[int] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("worker_id", "cached_blocks", "checked", "exact", "mismatched", "evicted", "evicted_in_use", "skipped", "rule", "elapsed_ms", "max_abs_diff", "max_rel_diff", "complete", "recomputed_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_IN_USE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_DIFF_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cached_blocks: int
    checked: int
    exact: int
    mismatched: int
    evicted: int
    evicted_in_use: int
    skipped: int
    rule: str
    elapsed_ms: float
    max_abs_diff: float
    max_rel_diff: float
    complete: bool
    recomputed_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., checked: _Optional[int] = ..., exact: _Optional[int] = ..., mismatched: _Optional[int] = ..., evicted: _Optional[int] = ..., evicted_in_use: _Optional[int] = ..., skipped: _Optional[int] = ..., rule: _Optional[str] = ..., elapsed_ms: _Optional[float] = ..., max_abs_diff: _Optional[float] = ..., max_rel_diff: _Optional[float] = ..., complete: _Optional[bool] = ..., recomputed_tokens: _Optional[int] = ...) -> None: ...
