"""The default model's training corpus: a pinned set of CPython 3.11.7 standard-library sources.

The corpus exists identically on every machine with that interpreter and needs no network. The
manifest (``corpus/manifest.json``) lists every file with its sha256 and split; ``load_corpus``
re-hashes each file and raises ``CorpusError`` naming the mismatches, so a different Python (or a
distribution's patched stdlib) fails loudly instead of silently training on other text. A CPython
3.11.7 source tree works too: pass its ``Lib/`` directory as ``stdlib_dir``.

Selection rule (``build_manifest``): every ``*.py`` under the stdlib except test suites, generated
tables, vendored or distribution-patched modules and machine-specific files (``EXCLUDED_*``).
Held-out split: whole files, those whose ``sha256(relative path)`` is 0 mod ``HELDOUT_MODULUS``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass

PINNED_PYTHON = "3.11.7"
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "lib-dynload", "__pycache__", "__phello__",
    "encodings",    # generated charmap tables
    "pydoc_data",   # one huge string literal
    "idlelib", "lib2to3", "turtledemo",
    "distutils", "ensurepip", "venv",  # patched by Linux distributions
})
EXCLUDED_FILES = frozenset({"site.py", "sysconfig.py", "this.py", "antigravity.py", "__hello__.py"})
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")  # machine-specific build configuration
HELDOUT_MODULUS = 20
"""About 1 file in 20 is held out."""


class CorpusError(RuntimeError):
    """The local files do not match the manifest (or the stdlib is not the pinned version)."""


@dataclass(frozen=True, slots=True)
class CorpusFile:
    path: str
    """Relative to the stdlib directory, '/'-separated."""
    sha256: str
    num_bytes: int
    split: str
    """``train`` or ``heldout``."""


def default_stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def python_version() -> str:
    return ".".join(str(v) for v in sys.version_info[:3])


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _split_of(rel: str) -> str:
    return "heldout" if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0 else "train"


def _selected(stdlib_dir: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(stdlib_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_PREFIXES))
        for f in sorted(filenames):
            if f.endswith(".py") and f not in EXCLUDED_FILES and not f.startswith(EXCLUDED_PREFIXES):
                out.append(os.path.relpath(os.path.join(dirpath, f), stdlib_dir).replace(os.sep, "/"))
    return sorted(out)


def build_manifest(stdlib_dir: str | None = None) -> dict:
    """Scan ``stdlib_dir`` with the selection rule (run once, on the pinned interpreter)."""
    stdlib_dir = stdlib_dir or default_stdlib_dir()
    files = []
    for rel in _selected(stdlib_dir):
        path = os.path.join(stdlib_dir, rel)
        files.append({"path": rel, "sha256": _sha256(path), "num_bytes": os.path.getsize(path),
                      "split": _split_of(rel)})
    totals = {s: sum(f["num_bytes"] for f in files if f["split"] == s) for s in ("train", "heldout")}
    return {
        "description": "Training corpus of the pdserve default model (models/glm5-tiny): CPython standard-library "
                       "sources, verified by sha256 before training.",
        "python_version": PINNED_PYTHON,
        "source": "sysconfig.get_paths()['stdlib'] of CPython 3.11.7, or Lib/ of the CPython 3.11.7 source tree",
        "selection": f"every *.py except directories {sorted(EXCLUDED_DIRS)}, files {sorted(EXCLUDED_FILES)} "
                     f"and names starting with {list(EXCLUDED_PREFIXES)}",
        "heldout_rule": f"whole files with int(sha256(path), 16) % {HELDOUT_MODULUS} == 0",
        "num_files": {s: sum(f["split"] == s for f in files) for s in ("train", "heldout")},
        "num_bytes": totals,
        "files": files,
    }


def read_manifest(path: str) -> list[CorpusFile]:
    with open(path) as f:
        data = json.load(f)
    return [CorpusFile(**f) for f in data["files"]]


def verify(files: list[CorpusFile], stdlib_dir: str) -> None:
    """Raise ``CorpusError`` listing every missing or changed file."""
    bad = []
    for cf in files:
        path = os.path.join(stdlib_dir, cf.path)
        if not os.path.exists(path):
            bad.append(f"{cf.path}: missing")
        elif (h := _sha256(path)) != cf.sha256:
            bad.append(f"{cf.path}: sha256 {h[:12]}... != manifest {cf.sha256[:12]}...")
    if bad:
        raise CorpusError(
            f"{len(bad)} of {len(files)} corpus files under {stdlib_dir} do not match the manifest "
            f"(this is Python {python_version()}; the corpus is pinned to CPython {PINNED_PYTHON}; pass "
            f"--stdlib <CPython-{PINNED_PYTHON}-source>/Lib to use a source tree): " + "; ".join(bad[:10])
            + (" ..." if len(bad) > 10 else ""))


def load_corpus(manifest_path: str, stdlib_dir: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """Verify and read the corpus: ``{"train": [(path, text)], "heldout": [...]}`` in manifest order."""
    stdlib_dir = stdlib_dir or default_stdlib_dir()
    files = read_manifest(manifest_path)
    verify(files, stdlib_dir)
    out: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for cf in files:
        with open(os.path.join(stdlib_dir, cf.path), encoding="utf-8") as f:
            out[cf.split].append((cf.path, f.read()))
    return out


def main() -> None:
    """``python -m scripts.default_model.corpus [OUT]``: (re)write the manifest from this interpreter's stdlib."""
    if python_version() != PINNED_PYTHON:
        raise SystemExit(f"the manifest is pinned to CPython {PINNED_PYTHON}; this is {python_version()}")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join("corpus", "manifest.json")
    manifest = build_manifest()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {manifest['num_files']} files, {manifest['num_bytes']} bytes")


if __name__ == "__main__":
    main()
