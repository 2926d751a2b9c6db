"""The decode worker: receives a prompt's KV and decodes it in one continuous batch.

    prefill worker --KVTransfer.Push--> kv_service.py (per-peer cap, time limit)
      -> receiver.py verifies each block and writes it into a reservation; at END the KV is parked
    router --DecodeService.Decode--> service.py (DecodeServicer): resume the parked KV (checked
      against the request), or prefill here when no KV came -> stream tokens back

role.py wires these into a WorkerServer (pdserve/worker/server.py); actor.py is the Ray actor.
"""
