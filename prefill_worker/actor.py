"""The prefill worker: a Ray actor that computes prompts and streams their KV to decode workers."""

from pdserve.worker.actor import WorkerActor, WorkerSpec


class PrefillWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "prefill":
            raise ValueError(f"PrefillWorker needs role 'prefill', got {spec.role!r}")
        super().__init__(spec)
