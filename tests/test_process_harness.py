"""Every process the tests and benchmarks start goes through one harness, harness/process.py
(harness/ is the home both import; benchmarks never import tests/). Read from the source of
every module under tests/ and benchmarks/:

- no call that starts a process outside harness/: subprocess's `Popen`, `run`, `call`,
  `check_call`, `check_output`, `getoutput`, `getstatusoutput`; `os.system`, `os.popen`,
  `os.fork`, `os.spawn*`, `os.exec*`, `os.posix_spawn*`; `pty.fork`, `pty.spawn`;
  `asyncio.create_subprocess_exec`/`_shell`; a multiprocessing `Process` (also one of a
  context, `get_context("spawn").Process`) or `ProcessPoolExecutor`. Use harness.process's
  `run` (a short-lived child, bounded), `Child` (a server or a child driven over its pipes, its
  output in a log), `popen` (a caller that drives the pipes itself) or `spawn` (a Python
  function in a spawned process);
- no `import tests...`/`from tests... import` under benchmarks/: what the benchmarks share with
  the tests lives in harness/.

examples/ is not scanned: its scripts are what a user runs, and start processes as a user
would (they may not import harness/, which is not shipped).
"""

from __future__ import annotations

import ast
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from harness import process
from harness.polling import wait_until

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks")
HARNESS = "harness"
SKIPPED = ("benchmarks/results/",)

STARTS = {
    *(f"subprocess.{name}" for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                                        "getstatusoutput")),
    "os.system", "os.popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp",
    "pty.fork", "pty.spawn",
    "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell",
    "multiprocessing.Process", "torch.multiprocessing.Process",
    "concurrent.futures.ProcessPoolExecutor", "concurrent.futures.process.ProcessPoolExecutor",
}
STARTS_LIKE = re.compile(r"^os\.(spawn|exec)\w*$")
MULTIPROCESSING = ("multiprocessing", "torch.multiprocessing")


def modules() -> list[tuple[str, Path]]:
    """Returns (repo-relative path, path) of every module scanned."""
    out = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(SKIPPED):
                out.append((rel, path))
    return out


def aliases(tree: ast.Module) -> dict[str, str]:
    """Returns each name the module binds by an import, as the dotted name it stands for
    (`sp` -> `subprocess` for `import subprocess as sp`, `Popen` -> `subprocess.Popen`)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    out[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def dotted(node: ast.AST, names: dict[str, str]) -> str:
    """Returns the dotted name `node` refers to, its first part resolved through `names`; ""
    for anything but a name or an attribute chain of one."""
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value, names)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def process_starts(path: Path) -> list[tuple[int, str]]:
    """Returns (line, what) of every call in `path` that starts a process."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = aliases(tree)
    uses_multiprocessing = any(v == m or v.startswith(m + ".") for v in names.values() for m in MULTIPROCESSING)
    other_modules = {v.split(".")[0] for v in names.values()} - {m.split(".")[0] for m in MULTIPROCESSING}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func, names)
        if name in STARTS or STARTS_LIKE.match(name):
            out.append((node.lineno, name))
        elif (uses_multiprocessing and isinstance(node.func, ast.Attribute) and node.func.attr == "Process"
              and dotted(node.func.value, names).split(".")[0] not in other_modules):
            # a context's (`ctx.Process`, `get_context("spawn").Process`), not psutil's
            out.append((node.lineno, f"a multiprocessing {ast.unparse(node.func)}"))
    return out


def test_processes_start_only_in_the_harness() -> None:
    broken = [f"{rel}:{line} calls {what}" for rel, path in modules() for line, what in process_starts(path)]
    assert not broken, (f"start processes through {HARNESS}/process.py (run, Child, popen, spawn), not in place:\n"
                        + "\n".join(broken))


def test_benchmarks_do_not_import_tests() -> None:
    broken = []
    for rel, path in modules():
        if not rel.startswith("benchmarks/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names if alias.name.split(".")[0] == "tests"]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = [node.module] if node.module.split(".")[0] == "tests" else []
            else:
                continue
            broken += [f"{rel}:{node.lineno} imports {name}" for name in found]
    assert not broken, f"benchmarks import what they share with the tests from {HARNESS}/:\n" + "\n".join(broken)


def test_the_scan_sees_each_kind_of_start(tmp_path: Path) -> None:
    """The scan itself: each way of starting a process is found, aliases resolved, and
    neither a type annotation nor psutil's Process (which starts nothing) counts."""
    source = tmp_path / "m.py"
    source.write_text(
        "import subprocess as sp\n"
        "import os, asyncio, psutil\n"
        "import torch.multiprocessing as mp\n"
        "from subprocess import check_output as co\n"
        "p: sp.Popen[str]\n"
        "sp.Popen(['x'])\n"
        "co(['x'])\n"
        "os.system('x')\n"
        "os.execv('x', [])\n"
        "asyncio.create_subprocess_exec('x')\n"
        "mp.get_context('spawn').Process(target=print)\n"
        "psutil.Process(1)\n")
    assert [line for line, _ in process_starts(source)] == [6, 7, 8, 9, 10, 11]


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it exited and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_left_running_is_killed_when_the_process_that_started_it_exits() -> None:
    code = ("import subprocess, sys; from harness import process; "
            "p = process.popen([sys.executable, '-c', 'import time; time.sleep(120)'], stdout=subprocess.DEVNULL); "
            "print(p.pid, flush=True)")
    out = process.run([sys.executable, "-c", code], cwd=REPO, env=process.repo_env(), capture_output=True, text=True,
                      timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    if not wait_until(lambda: not _running(pid), 10):
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the child {pid} outlived the process that started it")


def test_a_short_lived_child_names_its_bound() -> None:
    with pytest.raises(TypeError, match="timeout"):
        process.run([sys.executable, "-c", "pass"])  # type: ignore[call-arg]
    done = process.run([sys.executable, "-c", "print('hi')"], capture_output=True, text=True, timeout=60)
    assert done.stdout == "hi\n"
