"""The shared peer secret (``peer_secret_file``): read once at start, by the
TCP listener's authorization (callers must present it) and by the peer
client (this daemon presents it to its peers).

The file is checked as the secret it is: a regular file (a Kubernetes
Secret mount is a symlink into ``..data``, so links are followed), not
readable by "other" (a neighbour who can read it could call as a peer), and
long enough not to be guessed. Anything else is one ``ConfigError`` naming
the key and the path, so the daemon exits 2 with one line.
"""

from __future__ import annotations

import os
import stat

from kvmap.core.config import DaemonConfig
from kvmap.core.errors import ConfigError
from kvmap.core.peer_policy import MIN_PEER_SECRET_BYTES

KEY = "peer_secret_file"


def read_peer_secret(path: str) -> bytes:
    """The secret in ``path``, surrounding whitespace removed (a trailing
    newline from ``echo`` or ``kubectl create secret --from-file``)."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            raw = f.read(64 * 1024 + 1)
    except OSError as err:
        raise ConfigError(KEY, path, f"cannot read it: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(KEY, path, "not a regular file")
    if info.st_mode & 0o007:
        raise ConfigError(
            KEY,
            path,
            f"readable by others (mode {stat.S_IMODE(info.st_mode):04o}): "
            "allow the owner and group only (chmod o-rwx, or defaultMode 0440)",
        )
    secret = raw.strip()
    if len(raw) > 64 * 1024:
        raise ConfigError(KEY, path, "larger than 64 KiB: not a secret file")
    if len(secret) < MIN_PEER_SECRET_BYTES:
        raise ConfigError(
            KEY, path, f"holds {len(secret)} bytes; at least {MIN_PEER_SECRET_BYTES} are needed"
        )
    if not all(0x21 <= b <= 0x7E for b in secret):
        # It travels as gRPC metadata, which carries printable ASCII only.
        raise ConfigError(KEY, path, "must be printable ASCII without spaces (e.g. base64)")
    return secret


def peer_secret(config: DaemonConfig) -> bytes | None:
    """The configured secret, or None when there is none."""
    return read_peer_secret(config.peer_secret_file) if config.peer_secret_file else None
