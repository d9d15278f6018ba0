"""kvmapd: the kvmap sidecar daemon."""
