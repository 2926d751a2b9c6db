"""KV handoff between engines: a layer-wise sender, a fail-closed receiver, two transports.

    prefill engine --step observer--> LayerwiseSender --frames--> KVChannel --> KVReceiver --> decode engine
                                                     (GrpcKVChannel or LoopbackKVChannel)

faults.py: a debug-only FaultInjectingChannel around the KVChannel (drop, corrupt, delay),
present only on a worker built with a FaultPlan.
"""
