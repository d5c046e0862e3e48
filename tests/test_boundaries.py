"""Package boundaries from STYLE.md, checked by walking every module's imports."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ["common", "protos", "engine", "worker", "kvtransfer", "prefill", "decode", "router", "cluster", "bench", "cli"]
FORBIDDEN = {
    "engine": {"prefill", "decode", "router", "kvtransfer", "protos", "grpc", "cluster", "bench"},
    "prefill": {"decode", "router"},
    "decode": {"prefill", "router"},
    "router": {"torch", "engine", "prefill", "decode"},
    "kvtransfer": {"prefill", "decode", "router", "grpc"},
}


def imports_of(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_no_forbidden_imports(pkg):
    bad = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
        for f in files:
            if f.endswith(".py") and not f.endswith("_pb2.py") and not f.endswith("_pb2_grpc.py"):
                path = os.path.join(dirpath, f)
                bad += [f"{os.path.relpath(path, ROOT)} imports {m}" for m in imports_of(path) if m in FORBIDDEN[pkg]]
    assert not bad, bad


def test_top_level_packages_are_ours():
    import importlib
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        assert os.path.dirname(os.path.abspath(mod.__file__)) == os.path.join(ROOT, pkg), pkg
