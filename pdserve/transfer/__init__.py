"""What both ends of a KV transfer agree on: the channel contract and why a transfer failed.

    prefill_worker/sender.py --frames--> KVChannel --> decode_worker/receiver.py
                                  (prefill_worker/channels.py over gRPC, to decode_worker/kv_service.py)

channel.py (Frame, PushResult, KVChannel, TransferState), errors.py (FailureKind,
TransferFailed), status.py (FailureKind <-> gRPC status). The wire codec is pdserve/kvwire.py.
"""
