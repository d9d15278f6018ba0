"""The engine: the daemon's state (workers, leases, registrations) and the
work it does (registration, transfers, progress), over the adapters."""
