"""KVFrames: how a prefill worker cuts a transfer into LAYER frames (one setting, declared once).

Composed into PrefillConfig (prefill_worker/role.py), WorkerSpec (pdserve/worker/actor.py) and
ClusterSpec (deploy/config.py; its file key and flag are on the field). The default comes from
the frame-size curve in docs/benchmarks.md
(`python -m bench.kv_transfer_wire --chunk-sizes 64K,256K,1M,2M,4M,8M`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.field_error import FieldError
from pdserve.grpc_options import MAX_MESSAGE_BYTES
from pdserve.settings import setting

# NOTE: 4 MiB: on the frame-size curve (docs/benchmarks.md, 512 MiB over loopback) CPU per GB
# falls steeply up to 2 MiB (64 KiB frames cost 4x as much); 4 MiB was lowest on the sender in
# three sweeps, and 8 MiB gained nothing on either end while doubling the staging buffer. A frame
# never spans layers, so a larger cap does not delay the layer-wise overlap.
DEFAULT_MAX_CHUNK_BYTES = 4 << 20
# NOTE: a frame is its payload plus a msgpack header (a checksum per block: a few KiB at most);
# this much headroom keeps every frame under the gRPC message limit of both ends.
HEADER_ROOM_BYTES = 1 << 20


@dataclass(frozen=True)
class KVFrames:
    """How a prefill worker cuts a transfer into LAYER frames."""

    max_chunk_bytes: int = setting(
        DEFAULT_MAX_CHUNK_BYTES, flag="--max-chunk-bytes", key="prefill.max_chunk_bytes", metavar="BYTES",
        help="KV payload per LAYER frame a prefill worker sends a decode worker at most, whole blocks, at "
             "least one (docs/benchmarks.md has the curve)")

    def __post_init__(self) -> None:
        limit = MAX_MESSAGE_BYTES - HEADER_ROOM_BYTES
        if not 1 <= self.max_chunk_bytes <= limit:
            raise FieldError("max_chunk_bytes", f"must be between 1 and {limit:,} (the gRPC message limit "
                             "less room for the header)", self.max_chunk_bytes)
