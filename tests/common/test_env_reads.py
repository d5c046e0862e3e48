"""The environment is read in one module, ``common/env.py`` (STYLE: "Environment variables are read in one
module"): no other file of ours touches ``os.environ`` / ``os.getenv`` except the few listed below, each with
why (parsed with ast; nothing is imported)."""
import ast
import os

from common import env
from test_boundaries import ROOT, our_files

ALLOWED = {
    "common/env.py": "the one place",
    "engine/moe/mx_triton.py": "$TRITON_INTERPRET, Triton's own switch (engine/: not yet moved to common.env)",
    "bench/bench_decode_step.py": "$PYTHONPATH for its sys.path set-up, before any package of ours is importable",
    "scripts/train_default_model.py": "sets OMP_WAIT_POLICY before torch is imported (a write, not a read)",
}
"""File -> why it may touch the environment itself."""
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_uses(path: str) -> list[int]:
    """Lines of ``path`` that touch the process environment: ``os.environ``/``os.getenv``/..., or those
    names imported from os."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    def touches(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in ENV_NAMES and isinstance(node.value, ast.Name) and node.value.id == "os"
        if isinstance(node, ast.ImportFrom):
            return node.module == "os" and any(a.name in ENV_NAMES for a in node.names)
        return False
    return [node.lineno for node in ast.walk(tree) if touches(node)]


def test_only_common_env_reads_the_environment():
    found = {}
    for path in our_files(ROOT).values():
        rel = os.path.relpath(path, ROOT)
        lines = env_uses(path)
        if lines and rel not in ALLOWED:
            found[rel] = lines
    assert not found, f"read the environment through common.env instead: {found}"
    stale = [rel for rel in ALLOWED if not env_uses(os.path.join(ROOT, rel))]
    assert not stale, f"no longer touch the environment: drop them from ALLOWED: {stale}"


def test_child_environ_drops_and_sets(monkeypatch):
    monkeypatch.setenv(env.API_KEY, "k-secret")
    monkeypatch.setenv("PDSERVE_TEST_KEEP", "1")
    child = env.child_environ(drop=(env.API_KEY,), PYTHONUNBUFFERED="1")
    assert env.API_KEY not in child and child["PDSERVE_TEST_KEEP"] == "1" and child["PYTHONUNBUFFERED"] == "1"
    assert env.peers_dir({env.PEERS_DIR: "/p"}) == "/p" and env.peers_dir({env.PEERS_DIR: ""}) is None
