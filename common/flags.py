"""CLI flags generated from frozen config dataclasses: the field docstrings are the help text.

Stdlib only, so the router, the load generator and the CLI can all use it without importing each other.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect

DEFAULT_HTTP_PORT = 8000
"""``--http-port`` of ``python -m router``, ``pdserve serve`` and ``pdserve launch`` (vLLM's port). The
config dataclasses of the router and the local cluster default to off, so a router built in a test or a
library binds nothing it was not asked to."""


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` and of the dataclasses it derives from (the single
    source of the flag help)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for prev, node in zip(body, body[1:]):
            if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


def add_config_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                    choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """One ``--flag`` per field: tuples take comma lists, bools are switches, ``str | None`` default to None."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _kind(f)
        if kind is bool:
            p.add_argument(flag, action="store_true", help=docs.get(f.name))
        elif kind is tuple:
            p.add_argument(flag, type=comma_list, default=f.default, help=docs.get(f.name))
        else:
            p.add_argument(flag, type=kind, default=f.default, choices=(choices or {}).get(f.name),
                           help=docs.get(f.name))


def config_from_args(args: argparse.Namespace, cls, **overrides):
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    return cls(**{**kw, **overrides})


def _kind(f: dataclasses.Field) -> type:
    t = str(f.type)
    if t.startswith("tuple"):
        return tuple
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str


def comma_list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def add_api_key_file_arg(p: argparse.ArgumentParser) -> None:
    """``--api-key-file`` next to a parser's ``--api-key`` (``protos.rpc.api_key_from_args`` resolves both,
    falling back to $PDSERVE_API_KEY)."""
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (default: $PDSERVE_API_KEY; --api-key shows it in ps)")
