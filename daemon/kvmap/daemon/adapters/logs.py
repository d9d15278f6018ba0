"""structlog set-up: JSON lines in containers, console output for people.

Under ``json`` every line the daemon's process writes is one JSON object:
the daemon's own events, Python's ``logging`` (NIXL's Python logger, asyncio,
grpc's Python side, warnings) rendered by the same processors, uncaught
exceptions with their traceback as a field, and whatever native libraries
write to fd 1 or 2 (gRPC core's ``E1201 ...`` lines, NIXL's and UCX's C++
logs): both descriptors become a pipe whose lines are wrapped into JSON
objects, their level read from the line (glog's ``E``/``W``/``I`` prefix, a
``WARN``/``ERROR`` word), with ``logger`` ``native``, by a child process
that outlives a crash of the daemon long enough to write its last lines."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any, NoReturn, TextIO, cast

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# gRPC core logs every failed connection at ERROR unless told otherwise, and
# UCX's default "warn" stays; an operator's own setting wins.
_NATIVE_DEFAULTS = {"GRPC_VERBOSITY": "ERROR", "UCX_LOG_LEVEL": "warn"}
_GLOG = re.compile(r"^([DIWEF])\d{4} ")
# What a native library writes as it kills the process: UCX's failed
# assertion (``stubs.c:107  Assertion `0' failed``) and its signal report, a
# C++ std::terminate; they carry no level word of their own.
_FATAL = re.compile(r"Assertion .* failed|Caught signal \d+|terminate called")
_WORD = re.compile(r"\b(TRACE|DEBUG|DIAG|INFO|WARN|WARNING|ERROR|FATAL|CRITICAL)\b")
_WORD_LEVEL = {
    "TRACE": "debug",
    "DEBUG": "debug",
    "DIAG": "debug",
    "INFO": "info",
    "WARN": "warning",
    "WARNING": "warning",
    "ERROR": "error",
    "FATAL": "critical",
    "CRITICAL": "critical",
}
_GLOG_LEVEL = {"D": "debug", "I": "info", "W": "warning", "E": "error", "F": "critical"}


def configure_logging(
    fmt: str, level: int | str = logging.INFO, *, capture_native: bool = False
) -> None:
    """Render structlog and stdlib logging alike at ``level`` (a number or
    one of debug, info, warning, error). With ``capture_native`` (the
    daemon's process) under ``json``, also capture native output and
    uncaught exceptions (see the module's docstring)."""
    number = _LEVELS[level] if isinstance(level, str) else level
    stream: TextIO = sys.stderr
    capture = capture_native and fmt == "json"
    if capture:
        for name, value in _NATIVE_DEFAULTS.items():
            os.environ.setdefault(name, value)
        stream = _capture_native_output()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(stream, number, shared, renderer)
    if capture:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _route_stdlib_logging(
    stream: TextIO,
    level: int,
    shared: list[structlog.typing.Processor],
    renderer: structlog.typing.Processor,
) -> None:
    """Every stdlib logger (NIXL's ``nixl``, asyncio, ...) through structlog's
    processors; a library logger with a handler of its own gives it up."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    adopt_library_loggers()


def adopt_library_loggers() -> None:
    """Library loggers that installed handlers of their own (NIXL's writes
    plain text with local time) propagate to the root's instead. Called at
    set-up and again once NIXL is imported."""
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.handlers:
            logger.handlers.clear()
            logger.propagate = True


def _log_uncaught(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    structlog.get_logger("kvmapd").critical("uncaught_exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None:
        return
    structlog.get_logger("kvmapd").critical(
        "uncaught_exception",
        thread=getattr(args.thread, "name", ""),
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


# Where a native crash's dump goes once fds 1 and 2 are the pipe: straight
# to the real stderr (``enable_crash_dumps``), not through the wrapper.
_REAL_STDERR: list[IO[str]] = []


def enable_crash_dumps() -> None:
    """On a fatal signal (a native library's segfault, an abort) write every
    thread's Python stack to the real stderr before the process dies (under
    ``json``, beside the lines the wrapping child drains from the pipe).
    Call it once NIXL is loaded: UCX installs its own handler for the same
    signals when it starts, and this one, installed after, runs first and
    then hands the signal to UCX's."""
    faulthandler.enable(file=_REAL_STDERR[-1] if _REAL_STDERR else sys.stderr, all_threads=True)


def _capture_native_output() -> TextIO:
    """Point fds 1 and 2 at a pipe whose lines a child process wraps into
    JSON on the real stderr; return a stream on the real stderr for the
    daemon's own (already JSON) lines. Python's sys.stdout/sys.stderr follow
    the fds.

    A process, not a thread: a native library that aborts (or any death of
    the daemon) writes its last lines into the pipe and takes a reading
    thread down with it, unread. The child reads until every writer is gone,
    so those lines reach the log after the daemon has died (where it is not
    its PID namespace's init: the shipped pod shares one, under the pause
    container)."""
    sys.stdout.flush()
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        _wrapper_main(read_end, write_end, real)  # never returns
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    out = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="replace")
    _REAL_STDERR.append(out)
    atexit.register(_drain, child)
    return cast(TextIO, _LockedStream(out, threading.Lock()))


def _wrapper_main(read_end: int, write_end: int, real: int) -> NoReturn:
    """The forked child: wrap every line of the pipe onto the real stderr
    until its end, then exit without the parent's exit handlers. It keeps
    only its two descriptors (no socket, lock or memory of the daemon's) and
    ignores the signals meant for the daemon, so that it drains what the
    daemon wrote before it stopped."""
    status = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        os.close(write_end)
        low, high = sorted((read_end, real))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
        _wrap_lines(read_end, real)
        status = 0
    finally:
        os._exit(status)


def _drain(child: int) -> None:
    """At exit: close both ends the process writes to, so that the child
    reads what is left and the end of the pipe; wait for it (bounded)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        os.close(fd)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(child, os.WNOHANG)[0]:
                return
        time.sleep(0.01)


def _wrap_lines(read_end: int, real: int) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.strip():
                _write_line(real, (wrap_native_line(line) + "\n").encode())


def _write_line(fd: int, data: bytes) -> None:
    """``data`` with as few writes as the descriptor takes (one, for a line
    a pipe takes whole): the daemon's own lines go to the same place."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def wrap_native_line(line: str) -> str:
    """One foreign line as a JSON object (a JSON object stays as it is)."""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    return json.dumps(
        {
            "event": line,
            "level": native_level(line),
            "logger": "native",
            "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
    )


def native_level(line: str) -> str:
    """The level a native library gave a line: glog's first letter, else
    critical for the last words of a dying process (a failed assertion, a
    caught fatal signal, std::terminate), else the first level word in it;
    unmarked lines are info (tracebacks: error)."""
    glog = _GLOG.match(line)
    if glog:
        return _GLOG_LEVEL[glog.group(1)]
    if _FATAL.search(line):
        return "critical"
    word = _WORD.search(line)
    if word:
        return _WORD_LEVEL[word.group(1)]
    if line.startswith(("Traceback", "Exception", "  File ")):
        return "error"
    return "info"


class _LockedStream:
    """The daemon's own lines and the wrapped ones never interleave mid-line:
    each thread's text is held until it ends a line (``print`` writes a
    message and its newline in two calls), then written whole under the lock
    in one write, as the wrapping child writes each of its lines."""

    def __init__(self, out: IO[str], lock: threading.Lock) -> None:
        self._out = out
        self._lock = lock
        self._pending = threading.local()

    def write(self, text: str) -> int:
        held = getattr(self._pending, "text", "") + text
        head, newline, rest = held.rpartition("\n")
        self._pending.text = rest
        if newline:
            data = (head + newline).encode("utf-8", "replace")
            with self._lock:
                _write_line(self._out.fileno(), data)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._out.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


log = structlog.get_logger("kvmapd")
