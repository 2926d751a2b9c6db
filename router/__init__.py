"""Router: the gRPC front door that picks prefill and decode workers by longest cached prefix."""
