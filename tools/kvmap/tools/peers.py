"""The shared peer secret of the daemons this harness starts, and gRPC
channels that present it, as a peer daemon does (docs/security.md).

A daemon without mutual TLS answers ``Peer`` and ``RegionMaps`` on TCP only
to callers that present the secret of its ``peer_secret_file``: the demo,
the benchmarks and the tests start their daemons with one file per process
(``session_peer_secret``), or one of their own (``new_peer_secret``).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvmap.core.peer_policy import PEER_SECRET_METADATA

# Where a child process started by this harness (a bench worker) finds the
# secret its parent's daemons hold (``launch.local_env`` sets it).
SESSION_ENV = "KVMAP_HARNESS_PEER_SECRET_FILE"
_session: Path | None = None
_session_lock = threading.Lock()


def new_peer_secret(folder: Path, name: str = "peer-secret") -> Path:
    """A fresh secret (256 random bits, URL-safe) in ``folder/name``, readable
    by its owner only: what ``--peer-secret-file`` takes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def session_peer_secret() -> Path:
    """The secret every daemon this process starts shares by default (made
    once, in a private temporary folder removed at exit; a child of this
    harness uses its parent's)."""
    global _session  # noqa: PLW0603 -- one file per process, made on first use
    inherited = os.environ.get(SESSION_ENV)
    if inherited and Path(inherited).exists():
        return Path(inherited)
    # Daemons are started from several threads at once (the bench, the load
    # tool): one of them makes the file, the others wait for it, or they
    # would each make a secret of their own and refuse each other.
    with _session_lock:
        if _session is None or not _session.exists():
            folder = Path(tempfile.mkdtemp(prefix="kvmap-peers-"))
            atexit.register(shutil.rmtree, folder, True)
            _session = new_peer_secret(folder)
        return _session


def read_secret(path: str | Path) -> str:
    """The secret a daemon reads from ``path`` (surrounding whitespace removed)."""
    return Path(path).read_text().strip()


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class _PresentSecret(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]  # grpc's stubs are generic here
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds the peer secret to every call's metadata."""

    def __init__(self, secret: str) -> None:
        self._pair = (PEER_SECRET_METADATA, secret)

    def _with_secret(self, details: Any) -> _Details:
        return _Details(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._pair],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._with_secret(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._with_secret(client_call_details), request)

    def intercept_stream_stream(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, requests: Any
    ) -> Any:
        return continuation(self._with_secret(client_call_details), requests)


def peer_channel(target: str, secret: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """An insecure channel to ``target`` whose calls present ``secret`` (none
    when it is empty), as a peer daemon's do."""
    channel = grpc.insecure_channel(target, options=list(options))
    if not secret:
        return channel
    return grpc.intercept_channel(channel, _PresentSecret(secret))
