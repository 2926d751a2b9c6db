"""Protobuf package `pdserve.*`, kept under `protos/` so it never shadows the real `pdserve`.

Import the stubs as `from protos.pdserve.v1 import kv_transfer_pb2`. The .proto files are
compiled with the repository root as the include path (`-I.`), so a file's proto path is
`protos/pdserve/v1/<name>.proto` while its proto *package* (what gRPC method names use) is
`pdserve.v1`.
"""
