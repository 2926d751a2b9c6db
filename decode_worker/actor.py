"""The decode worker's Ray actor: the shared worker body (pdserve/worker/actor.py) serving the
decode role: KVTransfer in, the Decode stream out."""

from decode_worker.role import DecodeRole
from pdserve.worker.actor import WorkerActor, WorkerSpec


class DecodeWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "decode":
            raise ValueError(f"DecodeWorker needs role 'decode', got {spec.role!r}")
        super().__init__(spec)

    def role(self) -> DecodeRole:
        return DecodeRole()
