"""Memory import: a worker's shared-memory handle -> an address in the daemon.

A CPU worker shares its KV cache as a shared-memory object: either a file
descriptor passed over the fd hand-off socket (``fd_handoff``; preferred, it
leaves nothing behind when the worker crashes), which must be a memfd sealed
against shrinking, or a path (for example under ``/dev/shm``). The daemon maps
it ``MAP_SHARED`` read/write so that NIXL reads and writes land in the
worker's own pages, and registers the mapping.

``MappedMemory.address`` is the virtual address of byte 0 of the allocation
(``offset`` bytes into the object); ``mmap`` needs a page-aligned file offset,
so the mapping starts at the page boundary below ``offset``.

The daemon maps through its ``ShmImporter``, which counts the mappings it made
until they are closed, so tests (and the daemon's own stats) can assert that
nothing leaks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from kvmap.core.config import DEFAULT_SHM_PATH_PREFIXES
from kvmap.core.errors import InvalidArgument, PermissionDenied

_PAGE = mmap.ALLOCATIONGRANULARITY


class MappedMemory:
    """One allocation mapped into the daemon. Owns the fd and the mapping."""

    def __init__(
        self,
        fd: int,
        offset: int,
        size: int,
        source: str,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        map_offset = offset - offset % _PAGE
        self._head = offset - map_offset  # bytes between the mapping start and byte 0
        self._mmap: mmap.mmap | None = mmap.mmap(
            fd,
            self._head + size,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=map_offset,
        )
        self._fd = fd
        self.size = size
        self.offset = offset
        self.source = source
        self.map_address = _buffer_address(self._mmap)
        self.address = self.map_address + self._head
        self.map_length = self._head + size
        self._on_close = on_close

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap and close the fd. Safe to call more than once."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        if self._on_close is not None:
            self._on_close()
        try:
            mm.close()
        finally:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> MappedMemory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self.address:x}"
        return f"MappedMemory({self.source}, offset={self.offset}, size={self.size}, {state})"


def _buffer_address(mm: mmap.mmap) -> int:
    # from_buffer exports the mmap's buffer; drop the export at once, otherwise
    # mmap.close() refuses with BufferError ("exported pointers exist").
    probe = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def import_shm_fd(
    fd: int,
    offset: int,
    size: int,
    *,
    field: str = "",
    on_close: Callable[[], None] | None = None,
    require_seal: bool = True,
) -> MappedMemory:
    """Map ``size`` bytes at ``offset`` of the shared-memory object behind ``fd``.

    Always consumes ``fd``: the returned mapping owns it (``close()`` closes
    it), and on failure it is closed here, so a caller that got it from
    ``FdHandoffServer.claim`` never has to. ``field`` prefixes error
    messages, e.g. ``allocations[0].shm_fd``; ``on_close`` runs when the
    mapping is closed. ``require_seal=False`` only for a path's file the
    daemon re-opened itself (a restore), which no seal can protect.
    """
    try:
        _check_range(offset, size, field)
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise InvalidArgument(field, f"not an open file descriptor ({e.strerror})") from e
        _check_object(st, offset, size, field)
        if require_seal:
            _check_sealed(fd, field)
        return _map(fd, offset, size, f"fd {fd}", field, on_close=on_close)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def import_shm_path(
    path: str,
    offset: int,
    size: int,
    *,
    field: str = "",
    on_close: Callable[[], None] | None = None,
    prefixes: Sequence[str] = DEFAULT_SHM_PATH_PREFIXES,
    owner: Owner | None = None,
) -> MappedMemory:
    """Open ``path`` read/write and map ``size`` bytes at ``offset`` of it.
    ``path`` must lie under one of ``prefixes`` and is opened one component
    at a time without following any link below the prefix; with ``owner``,
    the file must be the caller's (PERMISSION_DENIED otherwise)."""
    _check_range(offset, size, field)
    fd = _open_under(path, prefixes, field)
    try:
        st = os.fstat(fd)
        if owner is not None:
            owner.check(st.st_uid, f"{field}: {path[:256]!r}")
        _check_object(st, offset, size, field)
        return _map(fd, offset, size, path, field, on_close=on_close)
    except BaseException:
        os.close(fd)
        raise


class Owner:
    """Whose file a path registration may name: the calling uid's (None: the
    caller sent no credentials, so no file is its)."""

    def __init__(self, caller_uid: int | None) -> None:
        self.caller_uid = caller_uid

    def check(self, file_uid: int, what: str) -> None:
        if self.caller_uid is None:
            raise PermissionDenied(
                f"{what}: a path registration needs the caller's credentials"
                " (metadata kvmap-peer-token, from the fd hand-off socket)"
            )
        if file_uid != self.caller_uid:
            raise PermissionDenied(
                f"{what} is owned by uid {file_uid}, not by the caller's uid {self.caller_uid}"
            )


def _open_under(path: str, prefixes: Sequence[str], field: str) -> int:
    """Open ``path`` read/write, refusing anything outside ``prefixes`` and any
    symbolic link or ``..`` below them: the daemon opens files its caller
    could not (with kvmapd as root, any file), so a worker may name only
    shared memory, never a link to some other file."""
    shown = repr(path[:256])
    if not os.path.isabs(path):
        raise InvalidArgument(field, f"path {shown} is not absolute")
    if "\0" in path:
        raise InvalidArgument(field, f"path {shown} is not a valid path: embedded NUL byte")
    if os.path.normpath(path) != path:
        raise InvalidArgument(field, f"path {shown} is not in normal form (no '..', '.' or '//')")
    prefix = next((p for p in prefixes if path.startswith(p.rstrip("/") + "/")), None)
    if prefix is None:
        allowed = ", ".join(prefixes) or "none: path registrations are disabled"
        raise InvalidArgument(
            field, f"path {shown} is not under an allowed shm_path_prefix ({allowed})"
        )
    *dirs, name = path[len(prefix.rstrip("/")) + 1 :].split("/")
    at = -1
    try:
        # The prefix itself is the operator's (it may be a link, /dev/shm -> /run/shm).
        at = os.open(prefix, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        for part in dirs:
            below = os.open(part, _DIR_NOFOLLOW, dir_fd=at)
            os.close(at)
            at = below
        return os.open(name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=at)
    except OSError as e:
        why = _LINK_ERRORS.get(e.errno or 0, e.strerror)
        raise InvalidArgument(field, f"cannot open {shown}: {why}") from e
    finally:
        if at >= 0:
            os.close(at)


_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LINK_ERRORS = {
    errno.ELOOP: "a symbolic link",
    errno.ENOTDIR: "a symbolic link or not a directory on the way",
}


def _check_range(offset: int, size: int, field: str) -> None:
    if offset < 0:
        raise InvalidArgument(field, f"offset {offset} is negative")
    if size <= 0:
        raise InvalidArgument(field, f"size {size} must be positive")


def _check_object(st: os.stat_result, offset: int, size: int, field: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        # memfd and POSIX shm objects are regular files; sockets, pipes and
        # devices cannot be mapped as KV memory.
        raise InvalidArgument(field, "not a shared-memory object (not a regular file)")
    if st.st_size < offset + size:
        raise InvalidArgument(
            field,
            f"shared-memory object is {st.st_size} bytes, smaller than offset {offset}"
            f" + size {size} = {offset + size}",
        )


def _check_sealed(fd: int, field: str) -> None:
    """A file that can shrink under the daemon's mapping would kill it with
    SIGBUS at the next NIXL read of the lost pages: only objects sealed
    against shrinking (a memfd with F_SEAL_SHRINK) are mapped from an fd."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a file system without seals
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidArgument(
            field,
            "the shared-memory object is not sealed against shrinking: create it with"
            " memfd_create(MFD_ALLOW_SEALING) and add F_SEAL_SHRINK"
            " (kvmap.client.fd_handoff.sealed_memfd)",
        )


def _map(
    fd: int,
    offset: int,
    size: int,
    source: str,
    field: str,
    *,
    on_close: Callable[[], None] | None,
) -> MappedMemory:
    try:
        return MappedMemory(fd, offset, size, source, on_close)
    except (OSError, ValueError) as e:
        # EACCES: the fd was opened read-only; ENODEV: the file system cannot mmap.
        problem = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidArgument(field, f"cannot map read/write: {problem}") from e


class ShmImporter:
    """Maps workers' shared-memory objects and counts the mappings it made
    that are still open. One per daemon (``DaemonApp``); thread-safe."""

    def __init__(self, path_prefixes: Sequence[str] = DEFAULT_SHM_PATH_PREFIXES) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self.path_prefixes = tuple(path_prefixes)

    def import_fd(
        self, fd: int, offset: int, size: int, *, field: str = "", require_seal: bool = True
    ) -> MappedMemory:
        """``import_shm_fd``, counted."""
        self._opened()
        try:
            return import_shm_fd(
                fd, offset, size, field=field, on_close=self._closed, require_seal=require_seal
            )
        except BaseException:
            self._closed()
            raise

    def import_path(
        self, path: str, offset: int, size: int, *, field: str = "", owner: Owner | None = None
    ) -> MappedMemory:
        """``import_shm_path``, counted."""
        self._opened()
        try:
            return import_shm_path(
                path,
                offset,
                size,
                field=field,
                on_close=self._closed,
                prefixes=self.path_prefixes,
                owner=owner,
            )
        except BaseException:
            self._closed()
            raise

    def live_mappings(self) -> int:
        """How many mappings made here are open."""
        with self._lock:
            return self._open

    def _opened(self) -> None:
        # Counted before mapping: close() may run (and count down) as soon
        # as the mapping exists.
        with self._lock:
            self._open += 1

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1


def is_mapped(address: int) -> bool:
    """Whether ``address`` lies in any mapping of this process (``/proc/self/maps``)."""
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            lo, _, hi = line.split(" ", 1)[0].partition("-")
            if int(lo, 16) <= address < int(hi, 16):
                return True
    return False
