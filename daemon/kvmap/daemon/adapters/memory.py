"""Memory import: a worker's shared-memory handle -> an address in the daemon.

A CPU worker shares its KV cache as a shared-memory object: either a file
descriptor passed over the fd hand-off socket (``fd_handoff``; preferred, it
leaves nothing behind when the worker crashes) or a path (for example under
``/dev/shm``). The daemon maps it ``MAP_SHARED`` read/write so that NIXL reads
and writes land in the worker's own pages, and registers the mapping.

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
import mmap
import os
import stat
import threading
from collections.abc import Callable
from types import TracebackType

from kvmap.core.errors import InvalidArgument

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
) -> MappedMemory:
    """Map ``size`` bytes at ``offset`` of the shared-memory object behind ``fd``.

    Always consumes ``fd``: the returned mapping owns it (``close()`` closes
    it), and on failure it is closed here, so a caller that got it from
    ``FdHandoffServer.claim`` never has to. ``field`` prefixes error
    messages, e.g. ``allocations[0].shm_fd``; ``on_close`` runs when the
    mapping is closed.
    """
    try:
        _check_range(offset, size, field)
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise InvalidArgument(field, f"not an open file descriptor ({e.strerror})") from e
        _check_object(st, offset, size, field)
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
) -> MappedMemory:
    """Open ``path`` read/write and map ``size`` bytes at ``offset`` of it."""
    _check_range(offset, size, field)
    if not os.path.isabs(path):
        raise InvalidArgument(field, f"path {path[:256]!r} is not absolute")
    try:
        # O_NOFOLLOW: a worker must name the object itself, not a link to
        # some other file the daemon can write.
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise InvalidArgument(field, f"cannot open {path[:256]!r}: {e.strerror}") from e
    except ValueError as e:  # an embedded NUL byte
        raise InvalidArgument(field, f"path {path[:256]!r} is not a valid path: {e}") from e
    try:
        _check_object(os.fstat(fd), offset, size, field)
        return _map(fd, offset, size, path, field, on_close=on_close)
    except BaseException:
        os.close(fd)
        raise


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

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0

    def import_fd(self, fd: int, offset: int, size: int, *, field: str = "") -> MappedMemory:
        """``import_shm_fd``, counted."""
        self._opened()
        try:
            return import_shm_fd(fd, offset, size, field=field, on_close=self._closed)
        except BaseException:
            self._closed()
            raise

    def import_path(self, path: str, offset: int, size: int, *, field: str = "") -> MappedMemory:
        """``import_shm_path``, counted."""
        self._opened()
        try:
            return import_shm_path(path, offset, size, field=field, on_close=self._closed)
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
