"""Protobuf sources and the gRPC stubs that `make protos` generates from them."""
