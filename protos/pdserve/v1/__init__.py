"""Version 1 of the pdserve gRPC API: .proto sources and their committed generated stubs.

Regenerate with `make protos` after editing a .proto; tests/test_protos_fresh.py fails
while the committed stubs are stale.
"""
