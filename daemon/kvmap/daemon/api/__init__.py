"""The gRPC surface: servicers, the RPC scope (the one place errors become
statuses) and the server that binds the listeners."""
