"""The prefill worker: computes a prompt's KV and streams it, layer by layer, to a decode worker.

    router --PrefillService.Prefill--> service.py (PrefillServicer)
      -> the engine loop computes the prompt; sender.py pins each layer's new blocks and queues them
      -> channels.py pushes them over KVTransfer to the decode target (peers.py: only a live,
         registered decode worker; faults.py: a debug fault plan may tamper with the frames)
      -> the first token and the push's totals go back to the router

role.py wires these into a WorkerServer (pdserve/worker/server.py); actor.py is the Ray actor.
"""
