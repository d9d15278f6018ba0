"""Adapters: one module per kind of I/O (NIXL, CUDA IPC, shared memory, fd
hand-off, the state store, peer daemons, metrics, logging, configuration files).

They turn outside failures into the core error tree and import nothing above
them."""
