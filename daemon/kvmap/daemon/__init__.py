"""kvmapd, the kvmap sidecar daemon, in layers (each imports only those below it):

- ``core``: pure data and arithmetic (geometry, validation, planners, transfer
  planning, proto conversion, the error tree). No grpc, nixl, torch or I/O.
- ``adapters``: one module per kind of I/O (NIXL, CUDA IPC, shared memory, fd
  hand-off, the state store, peer daemons over gRPC, metrics, logging, files).
- ``engine``: the daemon's state and the work it does (registrations, leases,
  transfers), written against the adapters' interfaces.
- ``api``: the gRPC surface; the one place errors become statuses.
- ``cli``: ``kvmapd`` and ``kvmapctl``.

``docs/architecture.md`` describes the layers and their rules.
"""
