"""Pure core: frozen dataclasses, validation, planners and transfer planning.

Imports only the standard library, numpy, protobuf messages (``kvmap.v1.*_pb2``)
and itself: no grpc, nixl, torch or I/O, so everything here is tested in-process
and exhaustively."""
