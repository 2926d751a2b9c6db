"""A worker process: one engine, its loop thread, its gRPC services and its presence in Redis.

    WorkerServer
      EngineLoop (thread) -- steps the engine, fans outputs out to RequestStreams
      gRPC server: Worker (Prefill/Decode/Abort/Status) + KVTransfer + health
      Presence (thread)   -- registry heartbeat + liveness; KV events go to the index per step
      KVAuditor           -- Worker.Audit, and the optional AuditScrubber (thread) in the background
"""
