"""The gRPC contract of the controller; stubs are generated from the .proto files at build time."""

try:
    from protos import controller_pb2, controller_pb2_grpc
except ImportError as exc:  # pragma: no cover - only on a checkout that was never installed
    raise ImportError(
        "The gRPC stubs in protos/ have not been generated. Install the project "
        "(`pip install -e .` or `make install`), which runs protoc on protos/*.proto."
    ) from exc

__all__ = ["controller_pb2", "controller_pb2_grpc"]
