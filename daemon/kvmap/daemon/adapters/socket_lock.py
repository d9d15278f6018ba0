"""One daemon per socket path and per state directory: an flock'ed lock file
that holds the owner's PID, in a runtime directory checked to be safe.

The kernel releases an flock when its holder dies however it dies, so a
daemon that was killed (even with SIGKILL) leaves a free lock and a stale
socket file the next daemon may take over; a live one keeps the lock, and a
second daemon is refused before it touches the live socket or state store.

The socket's directory and the lock files live where other local users may
have been first (``/tmp/kvmap-<uid>`` without ``XDG_RUNTIME_DIR``): a
directory someone else owns or anyone may write, a symbolic link, or a lock
file that is not the daemon's own makes the daemon refuse to start, naming
the path, rather than follow it (a root daemon once truncated a root-owned
file through a planted ``<socket>.lock`` link).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

LOCK_NAME = "kvmapd.lock"  # in the state directory


class StartRefused(Exception):
    """The daemon must not start; the message is the one line saying why."""


class SocketInUse(StartRefused):
    """Another live process holds the socket path."""

    def __init__(self, socket: str, pid: str) -> None:
        super().__init__(
            f"socket {socket} is in use by another kvmapd (pid {pid or 'unknown'}); "
            "stop it or choose another --socket"
        )
        self.socket = socket
        self.pid = pid


class StateDirInUse(StartRefused):
    """Another live process holds the state directory."""

    def __init__(self, state_dir: str, pid: str) -> None:
        super().__init__(
            f"state directory {state_dir} is in use by another kvmapd (pid {pid or 'unknown'});"
            " stop it or choose another --state-dir"
        )
        self.state_dir = state_dir
        self.pid = pid


class UnsafePath(StartRefused):
    """A runtime path another user could have planted or may change."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}; refusing to use it")
        self.path = path


def secure_runtime_dir(path: str) -> None:
    """Create ``path`` (mode 0770) or check the existing one: a real
    directory (not a link), owned by this user (then no one outside its
    owner and group may write it) or by root."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o770)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafePath(path, _open_problem(e, "directory")) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafePath(path, f"directory owned by uid {st.st_uid}, not by this user")
    # A directory of root's other than the daemon's own is root's choice: a
    # kubelet emptyDir shared by the pod's containers is root's and 2777. A
    # squatter cannot make one; the lock file's checks still apply in it.
    if st.st_mode & stat.S_IWOTH and st.st_uid == os.geteuid():
        raise UnsafePath(
            path,
            f"directory is writable by anyone (mode {stat.S_IMODE(st.st_mode):04o});"
            " it must be 0770 or stricter",
        )


def _open_problem(err: OSError, what: str) -> str:
    if err.errno in (errno.ELOOP, errno.ENOTDIR) and what == "directory":
        return "not a directory (a symbolic link or another file)"
    if err.errno == errno.ELOOP:
        return "is a symbolic link"
    return f"cannot open the {what}: {err.strerror}"


def _open_lock_file(path: str) -> int:
    """The lock file, created with mode 0660 or opened without following a
    link; it must be a regular file of this user with one name, so that
    writing the PID into it can never clobber somebody else's file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
    except OSError as e:
        raise UnsafePath(path, _open_problem(e, "lock file")) from None
    st = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = "lock file is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"lock file owned by uid {st.st_uid}, not by this user"
    elif st.st_nlink != 1:
        problem = f"lock file has {st.st_nlink} hard links"
    if problem:
        os.close(fd)
        raise UnsafePath(path, problem)
    return fd


class PathLock:
    """An flock on ``path``, held from ``acquire`` until ``release`` (or the
    process's end). ``in_use(pid)`` builds the error when it is held."""

    def __init__(self, path: str, in_use: type[SocketInUse | StateDirInUse], subject: str):
        self.path = path
        self._in_use = in_use
        self._subject = subject
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = _open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise self._in_use(self._subject, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the lock go. The file stays: unlinking it could let two
        successors lock two different files under one name."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SocketLock(PathLock):
    """``<socket>.lock``, after the socket's directory is made or checked safe."""

    def __init__(self, socket: str) -> None:
        super().__init__(f"{socket}.lock", SocketInUse, socket)
        self.socket = socket

    def acquire(self) -> None:
        secure_runtime_dir(os.path.dirname(os.path.abspath(self.socket)))
        super().acquire()


class StateDirLock(PathLock):
    """``<state dir>/kvmapd.lock``: two daemons writing one store would each
    restore and serve the other's workers."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(os.path.join(state_dir, LOCK_NAME), StateDirInUse, state_dir)

    def acquire(self) -> None:
        try:
            os.makedirs(self._subject, mode=0o700, exist_ok=True)
        except OSError:
            return  # the state store says in one line why the directory is unusable
        if not os.access(self._subject, os.W_OK | os.X_OK):
            return  # likewise ("not writable")
        super().acquire()
