"""One workload against several server configurations, in one run (issue 45: prefix cache tiers off / L2 / L2 + L3,
decode-side reuse on / off, or any other flags): for each ``--config NAME=FLAGS`` it starts ``pdserve serve`` with
the common ``--serve`` flags and those (``{dir}`` in them: a fresh scratch directory of that configuration, e.g. for
``--disk-cache-dir``), runs ``pdserve bench`` with the arguments after ``--`` against it (their ``--target`` is the
server's), writes OUT/NAME/bench.json, stops the server, and prints every run's table, then one table of all of them
step by step with each metric's ratio to the first configuration's (``report.format_configs``).

    python -m bench.serve_compare --serve "--num-pages 512" --config off="--host-cache-bytes 0" --config l2= \\
        --config "l2+l3=--host-cache-bytes 8M --disk-cache-dir {dir}/disk" --out /tmp/tiers -- \\
        --workload reference --rps 1 --warmup 5 --duration 45 --drain-timeout 60

The servers run one after the other on the same machine, so the ratios are same-run figures; each server starts
cold (its caches empty). Any ``pdserve bench`` flag goes after ``--`` except ``--target`` and ``--out``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from typing import Callable, ContextManager

from bench.loadgen.config import add_config_args, config_from_args
from bench.loadgen.report import Result, format_configs
from bench.loadgen.sweep import run_bench
from bench.serve_proc import serve

ServeFn = Callable[[list[str]], ContextManager[str]]
"""``pdserve serve`` FLAGS -> a context yielding the router's address (``bench.serve_proc.serve``)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def parse_configs(items: list[str]) -> list[tuple[str, list[str]]]:
    """``NAME=FLAGS`` items -> [(name, flags)], in order; names unique and usable as a directory name."""
    out: list[tuple[str, list[str]]] = []
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise ValueError(f"--config {item!r}: expected NAME=FLAGS with NAME of letters, digits and _ . + -")
        if name in (n for n, _ in out):
            raise ValueError(f"--config {name!r} given twice")
        out.append((name, shlex.split(flags)))
    if not out:
        raise ValueError("give at least one --config NAME=FLAGS")
    return out


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", add_help=False)
    add_config_args(p)
    return p


def run(configs: list[tuple[str, list[str]]], common: list[str], bench_argv: list[str], out: str,
        serve_fn: ServeFn = serve, echo: Callable[[str], None] = print) -> dict[str, Result]:
    """Each configuration in turn: start its server, bench it, stop it -> {name: the bench's result}."""
    if {"--target", "--out"} & {a.split("=", 1)[0] for a in bench_argv}:
        raise ValueError("--target and --out are set per configuration: leave them out of the bench arguments")
    parser = bench_parser()
    results: dict[str, Result] = {}
    for name, flags in configs:
        with tempfile.TemporaryDirectory(prefix=f"serve-compare-{name}-") as scratch:
            server_flags = common + [f.replace("{dir}", scratch) for f in flags]
            with serve_fn(server_flags) as target:
                args = parser.parse_args([*bench_argv, "--target", target, "--out", os.path.join(out, name)])
                cfg = config_from_args(args)
                result, text = run_bench(cfg, progress=False)
        results[name] = result
        echo(f"== {name}: pdserve serve {shlex.join(server_flags)}\n{text}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, bench_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.serve_compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", default="", help="pdserve serve flags every configuration gets (one string)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="a server configuration: its name and its own pdserve serve flags (repeat; the first is "
                        "the baseline of the ratios; {dir} is a scratch directory of its own)")
    p.add_argument("--out", default="serve-compare", help="OUT/NAME/bench.json per configuration")
    args = p.parse_args(own)
    try:
        configs = parse_configs(args.config)
        results = run(configs, shlex.split(args.serve), bench_argv, args.out)
    except (ValueError, RuntimeError) as e:
        print(f"serve_compare: error: {e}", file=sys.stderr)
        return 2
    print(format_configs(results))
    return 0 if all(any(s["num_ok"] for s in r["steps"]) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
