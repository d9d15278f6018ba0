"""``kvmapd``: the daemon and its subcommands."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn, cast

# Before anything imports structlog: it imports rich wherever rich is
# installed (vLLM brings it; the daemon's image has none), for pretty
# tracebacks the daemon never draws, and that import was a sixth of a
# start (structlog's import took 125-170 ms with rich, 64-79 ms without;
# ready 0.55 -> 0.45 s at the median of nine starts). A None entry makes
# `import rich` fail as if it were absent; a process that already has rich
# keeps it.
sys.modules.setdefault("rich", None)  # type: ignore[arg-type]

from kvmap.core.config import DaemonConfig, effective, exposure_warning
from kvmap.daemon.adapters.config_files import explain, load_config, show_value
from kvmap.daemon.adapters.logs import configure_logging, enable_crash_dumps, log
from kvmap.daemon.adapters.nixl_loader import nixl_module
from kvmap.daemon.adapters.preflight import (
    check_files,
    check_ports,
    check_socket_paths,
    check_state_dir,
)
from kvmap.daemon.adapters.socket_lock import StartRefused
from kvmap.daemon.cli import plan_cmd
from kvmap.daemon.cli.config_flags import add_config_flags
from kvmap.daemon.version import VERSION
from kvmap.tracing import check_available


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon", allow_abbrev=False)
    _add_config_source(p)
    p.add_argument("--ready-file", dest="ready_file", help="write a JSON line here once serving")


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="validate the configuration (file and flags as serve takes them), print the "
        "effective one and exit: 0 when serve would take it, 2 naming the mistake",
        allow_abbrev=False,
    )
    _add_config_source(p)


def _add_config_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="TOML file; its keys are the long flag names with underscores, a flag "
        "overrides its key (default: none)",
    )
    add_config_flags(p)


def _load(args: argparse.Namespace) -> DaemonConfig | None:
    """The configuration, or None after printing the one line that says
    what is wrong with it (key, source, value)."""
    notes: list[str] = []
    try:
        config = load_config(args.config, vars(args), notes)
    except ValueError as err:
        print(f"kvmapd: {err}", file=sys.stderr)
        return None
    try:
        check_files(config)
    except ValueError as err:
        print(f"kvmapd: {explain(err, config.config_file, config.flag_keys)}", file=sys.stderr)
        return None
    for note in notes:
        print(f"kvmapd: {note}", file=sys.stderr)
    return config


def _check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return 2
    print(f"# kvmapd {VERSION}: configuration OK (secrets hidden)")
    for key, value in effective(config).items():
        print(f"{key} = {show_value(value)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    # Lazy: the daemon imports nixl, which `kvmapd plan` must not need.
    from kvmap.daemon import bootstrap  # noqa: PLC0415
    from kvmap.daemon.adapters.state_store import StateStoreError  # noqa: PLC0415

    config = _load(args)
    if config is None:
        return 2
    try:
        # Before anything is created: a busy port leaves no socket file behind.
        check_socket_paths(config)
        check_state_dir(config)
        check_ports(config)
        check_available(config.otlp_traces_endpoint)  # the traces extra, if tracing
    except ValueError as err:
        configure_logging(config.log_format, config.log_level)  # not capturing yet
        return _refuse(config, explain(err, config.config_file, config.flag_keys))
    with contextlib.suppress(ImportError):  # no NIXL: the agent's creation says so
        # Imported first so that its logger's own plain-text handler, made
        # at import, is replaced by the daemon's (JSON under --log-format json).
        nixl_module("_api")
    configure_logging(config.log_format, config.log_level, capture_native=True)

    def started() -> None:
        # Once serving (NIXL's agent, and UCX's signal handlers, made).
        enable_crash_dumps()
        # A start refused below stays one line.
        log.info("kvmapd_config", version=VERSION, **effective(config))
        if exposure_warning(config):
            log.warning("peers_refused_by_config", problem=exposure_warning(config))

    try:
        return asyncio.run(bootstrap.serve(config, ready_file=args.ready_file, on_started=started))
    except (StateStoreError, StartRefused) as err:
        # An unusable state dir, another daemon on this socket or state dir
        # (left alone), an unsafe runtime path (docs/security.md): the
        # operator's to fix, one line naming it,
        # not a traceback repeated by every restart of a crash loop.
        return _refuse(config, str(err))


def _refuse(config: DaemonConfig, problem: str) -> int:
    """A start refused once the configuration is read: its one line, as the
    configured log format writes lines (a JSON error record under json),
    and exit status 2."""
    line = f"kvmapd: {problem}"
    if config.log_format == "json":
        log.error("kvmapd_start_refused", problem=line)
    else:
        print(line, file=sys.stderr)
    return 2


class OneLineParser(argparse.ArgumentParser):
    """A usage mistake is one line and exit 2, like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# Harness commands live in kvmap.tools, which the daemon never imports: they
# are loaded by name only when asked for, and parse their own arguments.
HARNESS = {
    "demo": ("kvmap.tools.demo", "P/D pull demo between two local daemons"),
    "bench": ("kvmap.tools.bench", "benchmark every planner against the per-layer baseline"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] in HARNESS:
        module = importlib.import_module(HARNESS[args_in[0]][0])
        status: int = module.main(args_in[1:])
        return status
    parser = OneLineParser(prog="kvmapd", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    # Subcommands parse as their parent does (one-line errors); typed as the
    # plain parsers plan_cmd and the harness commands are made with.
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    _add_serve(sub)
    _add_check_config(sub)
    plan_cmd.add_parser(sub)
    for name, (_, help_text) in HARNESS.items():
        sub.add_parser(
            name, help=f"{help_text} (kvmapd {name} --help)", add_help=False, allow_abbrev=False
        )
    args = parser.parse_args(args_in)
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args)
    return plan_cmd.run(args)


if __name__ == "__main__":
    sys.exit(main())
