"""The prefill worker's Ray actor: the shared worker body (pdserve/worker/actor.py) serving the
prefill role, which pushes KV only to the decode workers the registry lists as live."""

from pdserve.worker.actor import WorkerActor, WorkerSpec
from prefill_worker.peers import RegisteredDecodeTargets
from prefill_worker.role import PrefillConfig, PrefillRole


class PrefillWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "prefill":
            raise ValueError(f"PrefillWorker needs role 'prefill', got {spec.role!r}")
        super().__init__(spec)

    def role(self) -> PrefillRole:
        return PrefillRole(PrefillConfig(self.spec.kv_frames),
                           decode_targets=RegisteredDecodeTargets(self.registry.live_workers))
