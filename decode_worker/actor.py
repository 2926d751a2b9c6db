"""The decode worker: a Ray actor that receives KV, runs one continuous batch, streams tokens."""

from pdserve.worker.actor import WorkerActor, WorkerSpec


class DecodeWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "decode":
            raise ValueError(f"DecodeWorker needs role 'decode', got {spec.role!r}")
        super().__init__(spec)
