"""Generated gRPC/protobuf code of package kvmap.v1 (see protos/)."""
