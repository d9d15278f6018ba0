"""kvmapd's fd hand-off socket (``<socket>.fds``) as a worker uses it: the
fds of a registration's shared memory, and this process's credential token,
which Registry calls over gRPC present so that the daemon honours them only
from the uid that registered the worker. The wire protocol is
``kvmap.client.fd_handoff``'s."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvmap.client import fd_handoff
from kvmap.core.errors import KvmapError

# A credential token is fetched again after this long (the daemon keeps one
# 120 s), and its fetch may take this long.
CREDENTIAL_REFRESH_S = 60.0
CREDENTIAL_TIMEOUT_S = 5.0


class HandoffTransport:
    """One daemon's fd hand-off socket at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        # This process's credential token and when it was fetched.
        self._token = ""
        self._token_at = 0.0

    def send_fds(self, fds: Sequence[int], timeout: float) -> str:
        """Send ``fds``; the token a registration names them by."""
        return fd_handoff.send_fds(self.path, fds, timeout)

    def credentials(self, fresh: bool = False) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that says which uid calls: a credential token,
        kept for CREDENTIAL_REFRESH_S, or a new one when ``fresh`` (a
        restarted daemon forgot the old one). Empty when the daemon cannot
        give one (not up yet, or older): the call goes without, and a
        daemon that needs it answers PERMISSION_DENIED."""
        now = time.monotonic()
        if fresh or not self._token or now - self._token_at > CREDENTIAL_REFRESH_S:
            try:
                self._token = fd_handoff.send_credentials(self.path, CREDENTIAL_TIMEOUT_S)
                self._token_at = now
            except KvmapError:
                self._token = ""
        return ((fd_handoff.PEER_TOKEN_METADATA, self._token),) if self._token else ()
