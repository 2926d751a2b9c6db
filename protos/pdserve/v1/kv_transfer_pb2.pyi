from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVChunk(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    payload: bytes
    def __init__(self, header: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("transfer_id", "blocks_written", "bytes_received")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    blocks_written: int
    bytes_received: int
    def __init__(self, transfer_id: _Optional[str] = ..., blocks_written: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...
