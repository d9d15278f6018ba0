"""Command lines: ``kvmapd`` (serve, plan, and the harness commands demo and
bench, loaded lazily from ``kvmap.tools``) and ``kvmapctl``."""
