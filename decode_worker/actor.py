"""The decode worker's Ray actor: the shared worker body (pdserve/worker/actor.py) serving the
decode role: KVTransfer in, the Decode stream out.

A spec with decode_hold_after_tokens (debug only, decode_worker/faults.py) builds the role with
that stream hold; wait_held() and release_hold() reach it from another process, so a cluster test
can break or drain a worker with every stream at a known token."""

from decode_worker.faults import DecodeFaultPlan
from decode_worker.role import DecodeConfig, DecodeRole
from pdserve.worker.actor import WorkerActor, WorkerSpec


class DecodeWorker(WorkerActor):
    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role != "decode":
            raise ValueError(f"DecodeWorker needs role 'decode', got {spec.role!r}")
        hold = spec.decode_hold_after_tokens
        plan = None if hold is None else DecodeFaultPlan(hold_after_tokens=hold)
        self.decode_role = DecodeRole(DecodeConfig(fault_plan=plan))
        super().__init__(spec)

    def role(self) -> DecodeRole:
        return self.decode_role

    # --- the debug hold, asked by tests -------------------------------------------------------------
    def wait_held(self, count: int, timeout_s: float) -> list[str]:
        """The request ids held so far, once `count` streams are (faults.StreamHold.wait_held)."""
        return self._hold().wait_held(count, timeout_s)

    def release_hold(self) -> None:
        self._hold().release()

    def _hold(self):
        if self.decode_role.hold is None:
            raise RuntimeError("this decode worker has no stream hold: its spec's decode_hold_after_tokens "
                               "is None")
        return self.decode_role.hold
