"""pagegate.proto, its committed stubs (pagegate_pb2, pagegate_pb2_grpc) and the message <-> dict
conversion. Needs protobuf and grpcio only, so clients import it without the server's dependencies."""
