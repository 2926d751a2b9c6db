from protos.pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerView(_message.Message):
    __slots__ = ("status", "state", "router_in_flight", "index_accuracy", "reported_load", "load_report_seq", "estimated_load")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    INDEX_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    REPORTED_LOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_LOAD_FIELD_NUMBER: _ClassVar[int]
    status: _worker_pb2.WorkerStatus
    state: str
    router_in_flight: int
    index_accuracy: float
    reported_load: int
    load_report_seq: int
    estimated_load: int
    def __init__(self, status: _Optional[_Union[_worker_pb2.WorkerStatus, _Mapping]] = ..., state: _Optional[str] = ..., router_in_flight: _Optional[int] = ..., index_accuracy: _Optional[float] = ..., reported_load: _Optional[int] = ..., load_report_seq: _Optional[int] = ..., estimated_load: _Optional[int] = ...) -> None: ...

class ClusterStatusReply(_message.Message):
    __slots__ = ("router_address", "metrics_address", "routing_policy", "requests_in_flight", "index_available", "workers", "ray_address", "ray_namespace")
    ROUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    INDEX_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RAY_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    router_address: str
    metrics_address: str
    routing_policy: str
    requests_in_flight: int
    index_available: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerView]
    ray_address: str
    ray_namespace: str
    def __init__(self, router_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., routing_policy: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., index_available: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerView, _Mapping]]] = ..., ray_address: _Optional[str] = ..., ray_namespace: _Optional[str] = ...) -> None: ...

class AuditClusterRequest(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: int
    def __init__(self, sample: _Optional[int] = ...) -> None: ...

class WorkerAudit(_message.Message):
    __slots__ = ("worker_id", "role", "address", "state", "error", "audit")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    state: str
    error: str
    audit: _worker_pb2.AuditReply
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., audit: _Optional[_Union[_worker_pb2.AuditReply, _Mapping]] = ...) -> None: ...

class AuditClusterReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAudit]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerAudit, _Mapping]]] = ...) -> None: ...
