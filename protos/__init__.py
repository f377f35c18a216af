"""Generated protobuf and gRPC modules of both planes; regenerate with scripts/gen_protos.py."""
