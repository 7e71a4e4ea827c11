"""Entry files have one implementation (kvstore/entry_files/, its docstring): read from the
source of the packages that keep files of entries, none of them creates, writes, renames or
opens a file itself; they go through the shared layer.

- kvstore/cache_server/ (the spill): no file is opened, written or renamed in the package at
  all; its reads and writes are entry_files' (the pins it keeps are kvstore/pin_file.py's,
  which writes through entry_files/atomic_write.py too);
- kvstore/backends/disk/ (the disk tier): the same, but for its directory's account
  (dir_account.py), a state file rewritten in place under its flock, which is not an entry;
- kvstore/entry_files/ imports only the standard library: the cache server never imports torch;
- neither package lists a directory itself (`os.scandir`/`listdir`/`walk`, `glob`, a path's
  `.iterdir`/`.glob`/`.rglob`/`.walk`): entry files are listed by entry_files/entry_scan.py
  (regular files only, no link followed), so the disk tier and the spill list theirs through one
  implementation. The spill's generation directories, which hold entry files and are not
  entries, are listed and removed by its own two functions (LISTING_EXEMPT).

What counts as doing it itself: the builtin `open`, `os.open`/`fdopen`/`write`/`pwrite`/
`replace`/`rename`/`link`/`symlink`/`truncate`/..., `io.open`/`io.FileIO`, anything of
`shutil` or `tempfile`, and a path's `.open`/`.write_bytes`/`.write_text`/`.touch`/
`.rename`/`.symlink_to`/`.hardlink_to`, `.touch` with no argument (an LRU's `touch(key)` has
one), or `.replace` with one argument (a string's takes two).
Reading through a descriptor the layer opened (`os.pread`) and removing files are allowed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RULED = {"kvstore/cache_server": set(), "kvstore/backends/disk": {"kvstore/backends/disk/dir_account.py"}}
LAYER = "kvstore/entry_files"

FORBIDDEN_IN = {
    "os": {"open", "fdopen", "write", "pwrite", "writev", "pwritev", "replace", "rename", "renames", "link",
           "symlink", "truncate", "ftruncate", "mkfifo", "mknod", "sendfile", "copy_file_range"},
    "io": {"open", "FileIO", "BufferedWriter", "BufferedRandom"},
    "shutil": None,  # every name: copies and moves write files
    "tempfile": None,
}
PATH_METHODS = {"open", "write_bytes", "write_text", "rename", "symlink_to", "hardlink_to"}
LISTING_IN = {"os": {"scandir", "listdir", "walk", "fwalk"}, "glob": None}
LISTING_METHODS = {"iterdir", "glob", "rglob", "walk"}
# (file, function): the spill's generation directories (directories of entry files, not entries)
LISTING_EXEMPT = {("kvstore/cache_server/spillfile.py", "generations"),
                  ("kvstore/cache_server/spillfile.py", "remove_tree")}


def _forbidden(module: str, name: str) -> bool:
    names = FORBIDDEN_IN.get(module, set())
    return names is None or name in names


def file_writes(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """Returns (line, what) of every place in `source` that opens, writes or renames a file
    itself (the module docstring's list)."""
    tree = ast.parse(source, filename=filename)
    modules: dict[str, str] = {}  # local name -> module it binds (import os as x)
    names: dict[str, str] = {}  # local name -> "module.name" (from os import replace)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                modules[(alias.asname or alias.name).split(".")[0]] = top
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN_IN:
            for alias in node.names:
                if _forbidden(node.module, alias.name):
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            if func.id == "open" and func.id not in names:
                found.append((node.lineno, "open()"))
        elif isinstance(func, ast.Attribute):
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id in modules:
                module = modules[owner.id]
                if module in FORBIDDEN_IN:
                    if _forbidden(module, func.attr):
                        found.append((node.lineno, f"{module}.{func.attr}()"))
                    continue
            if func.attr in PATH_METHODS:
                found.append((node.lineno, f".{func.attr}()"))
            elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
                found.append((node.lineno, ".replace(target)"))
            elif func.attr == "touch" and not node.args:  # a budget's touch(key) is an LRU's
                found.append((node.lineno, ".touch()"))
    return sorted(found)


def listings(source: str, filename: str = "<source>") -> list[tuple[int, str, str | None]]:
    """Returns (line, what, enclosing function) of every place in `source` that lists a
    directory itself (the module docstring's list)."""
    tree = ast.parse(source, filename=filename)
    modules: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[(alias.asname or alias.name).split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module in LISTING_IN:
            listed = LISTING_IN[node.module]
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if listed is None or alias.name in listed]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, owner = node.func, node.func.value
        if isinstance(owner, ast.Name) and owner.id in modules:  # a module's function (ast.walk is not a listing)
            listed = LISTING_IN.get(modules[owner.id], set())
            if listed is None or func.attr in listed:
                found.append((node.lineno, f"{modules[owner.id]}.{func.attr}()"))
        elif func.attr in LISTING_METHODS:
            found.append((node.lineno, f".{func.attr}()"))
    functions = [(f.lineno, f.end_lineno or f.lineno, f.name) for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def enclosing(line: int) -> str | None:
        spans = [(end - start, name) for start, end, name in functions if start <= line <= end]
        return min(spans)[1] if spans else None

    return [(line, what, enclosing(line)) for line, what in sorted(found)]


def test_the_packages_keeping_entry_files_list_them_only_through_the_shared_layer() -> None:
    broken = []
    for package in RULED:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            broken += [f"{rel}:{line} {what}" for line, what, function in listings(path.read_text(), rel)
                       if (rel, function) not in LISTING_EXEMPT]
    assert not broken, f"entry files are listed through {LAYER}/entry_scan.py only:\n" + "\n".join(broken)
    layer = [w for p in sorted((REPO / LAYER).rglob("*.py")) for w in listings(p.read_text())]
    assert [(what, function) for _, what, function in layer] == [("os.scandir()", "scan"),
                                                                 ("os.scandir()", "names")]


def test_the_listing_rule_sees_each_way_of_listing_a_directory() -> None:
    flagged = {"os.scandir(root)": "os.scandir()", "o.listdir(root)": "os.listdir()", "os.walk(p)": "os.walk()",
               "glob.glob('*.kvc')": "glob.glob()", "Path(p).iterdir()": ".iterdir()",
               "root.glob('*.kvc')": ".glob()", "root.rglob('*')": ".rglob()", "root.walk()": ".walk()"}
    for code, what in flagged.items():
        source = f"import glob\nimport os as o\nimport os\nfrom pathlib import Path\ndef f():\n    {code}\n"
        assert [(w, fn) for _, w, fn in listings(source)] == [(what, "f")], code
    assert [w for _, w, _ in listings("from os import scandir\nscandir(p)\n")] == ["from os import scandir"]
    allowed = "import ast, os\nast.walk(tree)\nos.stat(p)\nos.unlink(p)\nentry_scan.names(root, keep)\n"
    assert listings(allowed) == []


def test_the_packages_keeping_entry_files_write_them_only_through_the_shared_layer() -> None:
    broken = []
    for package, exempt in RULED.items():
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in exempt:
                continue
            broken += [f"{rel}:{line} {what}" for line, what in file_writes(path.read_text(), rel)]
    assert not broken, f"files are opened, written and renamed through {LAYER}/ only:\n" + "\n".join(broken)


def test_the_rule_sees_each_way_of_writing_a_file() -> None:
    """The check is not vacuous: each form it forbids, written as code would write it, is found;
    reads through a descriptor, removals, and a string's replace are not."""
    flagged = {
        'open(p, "wb")': "open()",
        "os.replace(a, b)": "os.replace()",
        "x.rename(b)": ".rename()",
        "Path(p).write_bytes(b'')": ".write_bytes()",
        "p.replace(q)": ".replace(target)",
        "p.touch(exist_ok=True)": ".touch()",
        "o.open(p, o.O_WRONLY)": "os.open()",
        "shutil.copyfile(a, b)": "shutil.copyfile()",
        "io.FileIO(fd, 'wb')": "io.FileIO()",
    }
    for code, what in flagged.items():
        source = f"import io, shutil\nimport os as o\nimport os\nfrom pathlib import Path\n{code}\n"
        assert [w for _, w in file_writes(source)] == [what], code
    assert [w for _, w in file_writes("from os import replace\nreplace(a, b)\n")] == ["from os import replace"]
    allowed = "import os\nos.pread(fd, 8, 0)\nos.unlink(p)\np.unlink()\ns.replace('a', 'b')\n" \
              "dataclasses.replace(x, a=1)\nos.close(fd)\nbudget.touch(key)\n"
    assert file_writes(allowed) == []


def test_the_entry_file_layer_imports_only_the_standard_library() -> None:
    """kvstore/entry_files/ is what the torch-free cache server and the disk tier share: it
    imports the standard library and itself, nothing else of kvtier's or anyone's."""
    broken = []
    for path in sorted((REPO / LAYER).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                dotted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                dotted = [node.module]
            else:
                continue
            for name in dotted:
                own = name == "kvstore.entry_files" or name.startswith("kvstore.entry_files.")
                if not own and name.split(".")[0] not in sys.stdlib_module_names:
                    broken.append(f"{rel}:{node.lineno} imports {name}")
    assert not broken, "\n".join(broken)
