"""``zygote`` (tests/support/zygote.py): processes forked from a process that
imported their modules, started and waited for as ``subprocess.Popen``
would, and ``kvmap.tools.launch`` starting its processes through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zygote as zygotes
from zygote import FORKED_ENV, ForkedProcess, Zygote

pytestmark = pytest.mark.timeout(120)
# tests/support, where the zygote module is (a child process imports it).
SUPPORT = Path(zygotes.__file__).parent

# Answers each stdin line with what the process is: its pid, argv, working
# directory, environment and whether its module was imported before it ran
# (the zygote's preload); exits with the code of an "exit N" line.
ECHO = """
import atexit, json, os, sys
import zygote_probe_preloaded
print("to stderr", file=sys.stderr, flush=True)
atexit.register(print, "atexit ran", file=sys.stderr)
for line in sys.stdin:
    if line.startswith("exit"):
        sys.exit(int(line.split()[1]))
    print(json.dumps({
        "pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
        "preloaded_at": zygote_probe_preloaded.LOADED_IN, "line": line.strip(),
    }), flush=True)
"""


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[tuple[Zygote, Path]]:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "zygote_probe_preloaded.py").write_text("import os\nLOADED_IN = os.getpid()\n")
    (lib / "zygote_probe_echo.py").write_text(ECHO)
    z = Zygote(
        ["zygote_probe_preloaded"], {"PATH": os.environ["PATH"]}, tmp_path / "z.log", [str(lib)]
    )
    yield z, tmp_path
    z.close()
    assert z.proc.returncode == 0, (tmp_path / "z.log").read_text()


def ask(proc: ForkedProcess, line: str) -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    answer: dict[str, object] = json.loads(proc.stdout.readline())
    return answer


def test_a_forked_module_runs_as_main_with_its_own_env_dir_and_pipes(
    zygote: tuple[Zygote, Path],
) -> None:
    """The module runs as ``python -m`` would run it, in a new process with
    exactly the given environment (plus the forked flag) and directory, its
    stdout piped back and stderr in the file, its atexit hooks run at its
    exit; its preloaded import came from the zygote; its exit code is read by
    wait()."""
    z, tmp = zygote
    work = tmp / "work"
    work.mkdir()
    proc = z.spawn(["-m", "zygote_probe_echo", "--flag"], {"ONLY": "this"}, work, tmp / "err")
    got = ask(proc, "hello")
    assert got["pid"] == proc.pid != os.getpid()
    assert got["preloaded_at"] == z.proc.pid  # imported once, in the zygote
    assert got["argv"][1:] == ["--flag"] and str(got["argv"][0]).endswith("zygote_probe_echo.py")  # type: ignore[index]
    assert got["cwd"] == str(work)
    assert got["env"] == {"ONLY": "this", FORKED_ENV: "1"}
    assert got["line"] == "hello"
    assert proc.poll() is None
    assert proc.stdin is not None
    proc.stdin.write("exit 7\n")
    proc.stdin.flush()
    assert proc.wait(30) == 7 and proc.returncode == 7
    # As at an interpreter's exit: the module's atexit hooks ran.
    assert (tmp / "err").read_text() == "to stderr\natexit ran\n"


def test_kill_and_concurrent_spawns(zygote: tuple[Zygote, Path]) -> None:
    """Threads forking at once each get their own process (its pid answers
    on its own pipe); a killed one reports the signal as Popen does."""
    z, tmp = zygote
    procs: list[ForkedProcess] = []
    lock = threading.Lock()

    def start(n: int) -> None:
        p = z.spawn(["-m", "zygote_probe_echo"], {}, tmp, tmp / f"err{n}")
        with lock:
            procs.append(p)

    threads = [threading.Thread(target=start, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(procs) == 6
    assert [ask(p, "who")["pid"] for p in procs] == [p.pid for p in procs]
    assert len({p.pid for p in procs}) == 6
    for p in procs:
        p.send_signal(signal.SIGKILL)
    assert {p.wait(30) for p in procs} == {-signal.SIGKILL}


def test_a_launch_zygote_leaves_no_folder_after_its_process_exits(tmp_path: Path) -> None:
    """``zygote.install`` has ``launch`` fork from zygotes, and each is a
    folder (its log, its children's TMPDIR): the process's exit takes it
    away, so runs of the suite leave nothing behind in /tmp."""
    (tmp_path / "child.py").write_text("import os\nprint(os.environ['TMPDIR'], flush=True)\n")
    script = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import zygote\n"
        "from kvmap.tools import launch\n"
        "zygote.install()\n"
        "z = launch.forker_for(['json'])\n"
        "home = z.log.parent\n"
        "child = launch.start_python([sys.argv[1]], launch.local_env(home), home,"
        " home / 'child.log', z)\n"
        "assert child.stdout is not None\n"
        "print(child.stdout.readline().strip(), flush=True)\n"
        "assert child.wait(30) == 0\n"
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, KVMAP_LAUNCH_ZYGOTE="1", TMPDIR=str(tmp))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "child.py"), str(SUPPORT)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    home = Path(done.stdout.strip())
    assert home.parent == tmp and home.name.startswith("kvmap-zygote-")
    assert not home.exists()
    assert list(tmp.iterdir()) == []
