"""Harness around the daemon: the demo, the benchmark, stand-in workers, process
launchers and the load generator. The daemon never imports this package; its
``kvmapd demo`` and ``kvmapd bench`` commands load it lazily."""
