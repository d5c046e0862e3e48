"""``requirements.lock`` pins every package the locked install resolves, and ``make install`` uses it."""
import importlib.metadata
import os
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "requirements.lock")


def lock_lines() -> list[str]:
    with open(LOCK) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def pins() -> dict[str, str]:
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lock_lines()}


def test_every_line_is_an_exact_pin_once():
    lines = lock_lines()
    bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", line)]
    assert not bad, f"not exact pins: {bad}"
    names = [canonicalize_name(line.split("==")[0]) for line in lines]
    assert len(names) == len(set(names)), "a package is pinned twice"


def test_lock_covers_pyproject_and_leaves_torch_to_torch_spec():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = list(project["dependencies"])
    for extra in ("test", "mooncake"):
        wanted += project["optional-dependencies"][extra]
    locked = pins()
    missing, outside = [], []
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in ("torch", "triton") or (req.marker is not None and not req.marker.evaluate()):
            continue
        if name not in locked:
            missing.append(req.name)
        elif not req.specifier.contains(locked[name], prereleases=True):
            outside.append(f"{req} locked at {locked[name]}")
    assert not missing, f"pyproject requirements not in the lock (run `make lock`): {missing}"
    assert not outside, f"locked versions pyproject does not allow (run `make lock`): {outside}"
    assert "torch" not in locked and "triton" not in locked, \
        "torch is pinned by the Makefile's TORCH_SPEC (CPU wheel) or is the user's GPU build, with its own triton"


def test_makefile_installs_with_the_lock():
    with open(os.path.join(REPO, "Makefile")) as f:
        make = f.read()
    install = make.split("$(STAMP):", 1)[1].split("\ninstall:", 1)[0]
    pip_lines = [line for line in install.splitlines() if "pip install" in line]
    assert pip_lines and all("-c $(LOCK)" in line for line in pip_lines), pip_lines
    assert "\nlock:" in make


def test_this_environment_matches_the_lock_where_it_was_installed_from_it():
    """The packages that decide generated code and numerics are at their locked versions here."""
    locked = pins()
    for name in ("grpcio", "grpcio-tools", "protobuf", "transformers", "torchao", "numpy"):
        assert importlib.metadata.version(name) == locked[name], \
            f"{name} {importlib.metadata.version(name)} installed, lock pins {locked[name]}: run `make install`"
