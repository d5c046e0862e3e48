"""Package boundaries from docs/architecture.md, checked by parsing every module's imports (ast; nothing is imported).

Floors run one way (docs/architecture.md, whose floor line and FORBIDDEN table are checked against these): common -> protos -> engine -> worker / kvtransfer -> prefill / decode / router -> cluster
-> bench -> cli. A module may import its own floor or lower ones; siblings on one floor that must not know each
other (prefill, decode and router; engine and grpc) are listed in ``FORBIDDEN``. Every import counts, wherever
it stands: at the top, inside a function, under ``if TYPE_CHECKING``. No two files may import each other,
directly or round a longer circle. An import inside a function carries a comment saying why (a heavy optional
dependency such as torch or ray that a light entry point must not load).

``python tests/test_boundaries.py [ROOT]`` prints the figures (circles, upward imports, in-function imports of
our own modules, largest files) for the tree at ROOT (default: this checkout).
"""
from __future__ import annotations

import ast
import importlib
import os
import sys
from collections import defaultdict
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"common": 0, "protos": 1, "engine": 2, "worker": 3, "kvtransfer": 3, "prefill": 4, "decode": 4,
          "router": 4, "cluster": 5, "bench": 6, "cli": 7, "scripts": 7}
"""Top-level package -> floor; a module may import packages whose floor is <= its own."""
PACKAGES = [p for p in FLOORS if p != "scripts"]
FORBIDDEN = {
    "common": {"grpc", "torch", "google", "numpy", "ray"},
    "protos": {"torch"},
    "engine": {"grpc", "ray"},
    "prefill": {"decode", "router"},
    "decode": {"prefill", "router"},
    "router": {"torch", "prefill", "decode", "kvtransfer", "engine"},
    "kvtransfer": {"grpc", "worker"},
    "worker": {"kvtransfer"},
}
"""Imports a package must not make even where the floors allow them (same floor, or a third-party module)."""
MAX_LINES = 400
"""A file longer than this says at its top (in its first 5 lines) why."""


class Import(NamedTuple):
    src: str
    """Importing module, dotted."""
    dst: str
    """Imported module, dotted (the longest prefix that is one of our files, else the name as written)."""
    line: int
    in_function: bool
    commented: bool
    """A comment on the import's line or the line above it."""


def module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def our_files(root: str) -> dict[str, str]:
    """Dotted module name -> path, for every .py of our packages (generated protobuf code included)."""
    out = {}
    for pkg in FLOORS:
        for dirpath, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    out[module_name(path, root)] = path
    return out


def _resolve(name: str, modules: dict[str, str]) -> str:
    while name and name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(mod: str, path: str, modules: dict[str, str]) -> list[Import]:
    text = open(path, encoding="utf-8").read()
    lines = text.split("\n")
    tree = ast.parse(text, path)
    out: list[Import] = []
    is_pkg = path.endswith("__init__.py")

    def commented(node: ast.stmt) -> bool:
        here = lines[node.lineno - 1]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        return "#" in here or above.startswith("#")

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append(Import(mod, _resolve(a.name, modules), child.lineno, in_function, commented(child)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = mod.split(".")
                    parts = parts[:len(parts) - child.level + (1 if is_pkg else 0)]
                    base = ".".join(parts + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    dst = full if full in modules else _resolve(base, modules)
                    out.append(Import(mod, dst, child.lineno, in_function, commented(child)))
            visit(child, inside)
    visit(tree, False)
    return out


def all_imports(root: str = ROOT) -> tuple[dict[str, str], list[Import]]:
    modules = our_files(root)
    return modules, [i for mod, path in sorted(modules.items()) for i in imports_of(mod, path, modules)]


def top(name: str) -> str:
    return name.split(".")[0]


def upward_imports(imps: list[Import]) -> list[str]:
    """One entry per (importing file, imported file) pair."""
    return sorted({f"{i.src} imports {i.dst} (floor {FLOORS[top(i.dst)]} > {FLOORS[top(i.src)]})"
                   for i in imps if top(i.dst) in FLOORS and FLOORS[top(i.dst)] > FLOORS[top(i.src)]})


def forbidden_imports(imps: list[Import]) -> list[str]:
    return sorted({f"{i.src} imports {i.dst}" for i in imps
                   if top(i.dst) in FORBIDDEN.get(top(i.src), ()) and top(i.dst) != top(i.src)})


def third_party_in_common(imps: list[Import]) -> list[str]:
    return sorted({f"{i.src} imports {i.dst}" for i in imps if top(i.src) == "common"
                   and top(i.dst) not in sys.stdlib_module_names and top(i.dst) not in ("common", "__future__")})


def circles(modules: dict[str, str], imps: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imps:
        if i.dst in modules and i.dst != i.src:
            graph[i.src].add(i.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(modules):
        if v not in index:
            strong(v)
    return sorted(out)


def function_imports(imps: list[Import], modules: dict[str, str], own_only: bool = True) -> list[Import]:
    """Import statements inside functions (one per statement), of our own modules only by default."""
    seen: dict[tuple[str, int], Import] = {}
    for i in imps:
        if i.in_function and (not own_only or top(i.dst) in FLOORS):
            seen.setdefault((i.src, i.line), i)
    return list(seen.values())


def long_files(modules: dict[str, str], limit: int = MAX_LINES) -> list[tuple[int, str, bool]]:
    """(lines, path, says why at its top) for every file over ``limit`` lines, generated code aside."""
    out = []
    for path in modules.values():
        if "_pb2" in path:
            continue
        lines = open(path, encoding="utf-8").read().splitlines()
        if len(lines) > limit:
            head = "\n".join(lines[:5]).lower()
            out.append((len(lines), os.path.relpath(path, ROOT), f"over {limit} lines" in head))
    return sorted(out, reverse=True)


@pytest.fixture(scope="module")
def graph():
    return all_imports()


def test_every_package_has_a_floor():
    dirs = {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
    assert dirs <= set(FLOORS), f"packages without a floor in FLOORS: {sorted(dirs - set(FLOORS))}"


def test_no_upward_imports(graph):
    assert not upward_imports(graph[1])


def test_no_forbidden_imports(graph):
    assert not forbidden_imports(graph[1]) + third_party_in_common(graph[1])


def test_no_import_circles(graph):
    assert not circles(*graph)


def test_function_imports_say_why(graph):
    """An import inside a function is for a heavy optional dependency, with a comment saying which."""
    bad = [f"{i.src}:{i.line} imports {i.dst}" for i in function_imports(graph[1], graph[0], own_only=False)
           if not i.commented and top(i.dst) != "__future__"]
    assert not bad


MAX_FUNCTION_IMPORTS_OWN = 20
"""In-function imports of our own modules, the whole tree (issue 46: 129, then 59, brought to 16). Each one keeps a
light entry point light (torch out of ``pdserve --help`` and ``pdserve bench``, ray out of the launcher's parser)
and says so; a new one means a module to split or a dependency to inject, not a higher bound."""


def test_function_imports_of_our_modules_are_few(graph):
    own = function_imports(graph[1], graph[0])
    assert len(own) <= MAX_FUNCTION_IMPORTS_OWN, sorted(f"{i.src}:{i.line} imports {i.dst}" for i in own)
    assert all(i.commented for i in own)


def test_long_files_say_why(graph):
    bad = [f"{path} ({n} lines)" for n, path, why in long_files(graph[0]) if not why]
    assert not bad, f"files over {MAX_LINES} lines need '# over {MAX_LINES} lines: WHY' in their first 5 lines"


def test_top_level_packages_are_ours():
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        assert os.path.dirname(os.path.abspath(mod.__file__)) == os.path.join(ROOT, pkg), pkg


def report(root: str) -> dict:
    modules, imps = all_imports(root)
    fn = function_imports(imps, modules)
    return {"files": len(modules), "circles": circles(modules, imps), "upward": upward_imports(imps),
            "forbidden": forbidden_imports(imps) + third_party_in_common(imps),
            "function_imports_own": len(fn), "function_imports_own_uncommented": sum(not i.commented for i in fn),
            "function_imports_all_uncommented": sum(not i.commented for i in function_imports(imps, modules, False)),
            "largest": [f"{p} {n}" for n, p, _ in long_files(modules, 0)[:8]],
            "over_400": [f"{p} {n}{' (says why)' if why else ''}" for n, p, why in long_files(modules)]}


if __name__ == "__main__":
    import json
    ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    r = report(ROOT)
    print(json.dumps({k: (len(v) if isinstance(v, list) and k in ("circles", "upward", "forbidden") else v)
                      for k, v in r.items()}, indent=1))
    for c in r["circles"]:
        print("circle:", " <-> ".join(c))
    for u in r["upward"] + r["forbidden"]:
        print("edge:", u)


def test_architecture_doc_states_these_floors_and_forbidden_edges():
    """docs/architecture.md is the rule book these tests enforce: its floor line and its table say the same."""
    doc = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    line = next(ln.strip() for ln in doc.splitlines() if ln.strip().startswith("common -> protos"))
    floors = [[p.strip() for p in step.split("/")] for step in line.split("->")]
    assert [FLOORS[p] for step in floors for p in step] == sorted(FLOORS[p] for step in floors for p in step)
    assert {p for step in floors for p in step} == set(PACKAGES)
    assert all(len({FLOORS[p] for p in step}) == 1 for step in floors), "one floor per step of the line"
    table = {}
    for ln in doc.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in FORBIDDEN:
            table[cells[0]] = {c.strip() for c in cells[1].split(",")}
    assert table == FORBIDDEN
