"""The state store's faults (``state_store``), and only these, mapped into
the error tree: SQLite's result codes, and for a bare I/O error the store's
files and file system, read to say why (docs/security.md, "State store
faults"). Each error is one line naming the database."""

from __future__ import annotations

import os
import resource
import sqlite3

from kvmap.core.errors import KvmapError, ResourceExhausted, Unavailable

# SQLite's primary result codes (the low byte of an extended code).
_SQLITE_PERM = 3
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26
# The most one write appends to a file of the store: a WAL frame of the
# largest page (64 KiB) with its 24-byte header.
_MAX_WRITE = 65536 + 24
# The database and the files SQLite keeps beside it (same name + suffix).
STORE_SUFFIXES = ("", "-wal", "-shm")


class StateStoreError(KvmapError):
    """The state store failed; the subclasses say how (and so the status)."""


class StoreFull(StateStoreError, ResourceExhausted):
    """No room for a write: the disk, or the process's file-size limit."""


class StoreUnavailable(StateStoreError, Unavailable):
    """The store cannot be opened or written: read-only, locked, failing."""


class StoreCorrupt(StoreUnavailable):
    """The database is damaged (on open it is moved aside)."""


# What each primary code says about the store (I/O errors need a closer look).
_MEANINGS: dict[int, tuple[type[StateStoreError], str]] = {
    _SQLITE_FULL: (StoreFull, "is full"),
    _SQLITE_CORRUPT: (StoreCorrupt, "is corrupt"),
    _SQLITE_NOTADB: (StoreCorrupt, "is corrupt"),
    _SQLITE_READONLY: (StoreUnavailable, "is read-only"),
    _SQLITE_PERM: (StoreUnavailable, "is read-only"),
    _SQLITE_CANTOPEN: (StoreUnavailable, "cannot be opened"),
    _SQLITE_BUSY: (StoreUnavailable, "is locked by another process"),
    _SQLITE_LOCKED: (StoreUnavailable, "is locked by another process"),
}


def store_error(path: str, err: sqlite3.DatabaseError) -> StateStoreError | None:
    """What a SQLite error means, in one line naming the database; None for
    anything else (a constraint or bad SQL is a bug, not a fault)."""
    primary = getattr(err, "sqlite_errorcode", 0) & 0xFF
    if primary == _SQLITE_IOERR:
        return _io_error(path, err)
    meaning = _MEANINGS.get(primary)
    if meaning is None:
        return None
    error, what = meaning
    return error(f"state store {path} {what}: {err}")


def _io_error(path: str, err: sqlite3.DatabaseError) -> StateStoreError:
    """SQLite reports a failed write as SQLITE_FULL only for ENOSPC; any other
    errno (EFBIG past the file-size limit, EROFS, EPERM on an immutable file)
    is a bare I/O error, so the cause is read off the store's files."""
    where = f"state store {path}"
    full = _why_full(path)
    if full:
        return StoreFull(f"{where} is full: {full}")
    read_only = _why_read_only(path)
    if read_only:
        return StoreUnavailable(f"{where} is read-only: {read_only}")
    return StoreUnavailable(f"{where} failed: {err} ({getattr(err, 'sqlite_errorname', '')})")


def _store_files(path: str) -> list[str]:
    return [path + s for s in STORE_SUFFIXES if os.path.exists(path + s)]


def _why_full(path: str) -> str:
    if path == ":memory:":
        return ""
    directory = os.path.dirname(path)
    try:
        fs = os.statvfs(directory)
    except OSError:
        return ""
    # Blocks reserved for root are usable by root.
    free = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail
    if free * fs.f_frsize < _MAX_WRITE:
        return f"no space left on the file system of {directory}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        for name in _store_files(path):
            if os.path.getsize(name) + _MAX_WRITE > limit:
                return f"{name} reached the file-size limit (RLIMIT_FSIZE {limit} bytes)"
    return ""


def _why_read_only(path: str) -> str:
    if path == ":memory:":
        return ""
    directory = os.path.dirname(path)
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"the file system of {directory} is mounted read-only"
    except OSError:
        return ""
    for name in _store_files(path):
        if not os.access(name, os.W_OK):
            return f"{name} is not writable"
    return ""
