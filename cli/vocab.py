"""One flag vocabulary for ``pdserve run``, ``serve`` and ``launch``, and the rules every subcommand follows.

- sglang / vLLM names are accepted where they exist: ``--tp``, ``--kv-cache-dtype`` (= ``--kv-dtype``),
  ``--speculative-num-steps`` / ``--speculative-eagle-topk`` / ``--speculative-num-draft-tokens`` (the
  three parts of ``--speculative S/K/D``).
- ``--dp K`` (serve, launch) is ``--prefill K --decode K``: K identical workers per role.
- ``serve`` and ``launch`` take one flag set (``cluster.spec.ClusterSpec``), with shorter or older names
  for some: ``--compile`` (``--compile-decode``), ``--stall-after`` (``--stall-after-s``), ``--threads``
  (``--threads-per-worker``), ``--startup-timeout`` (``--startup-timeout-s``), ``--decode-stall-timeout``
  (``--decode-stall-timeout-s``), ``--no-speculative`` (``--speculative off``); serve's ``--run-dir`` is
  launch's ``--log-dir``, and each takes the other's name.
- Every subcommand: no abbreviations (``allow_abbrev=False``), defaults in ``--help``, ``-v`` after the
  subcommand too, ``--config FILE.yaml`` whose keys are the long flag names (flags on the command line
  override the file).
"""
from __future__ import annotations

import argparse
import sys

import yaml


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line, ``pdserve: error: ...`` (exit 2), like every other refusal of the
    command; ``--help`` still shows the usage."""

    def error(self, message: str):
        sys.stderr.write(f"pdserve: error: {message}\n")
        sys.exit(2)


SPEC_PARTS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
DEFAULT_SPECULATIVE = "5/1/6"
CLUSTER_ALIASES = (("--compile", "compile_decode", True), ("--stall-after", "stall_after_s", float),
                   ("--threads", "threads_per_worker", int), ("--startup-timeout", "startup_timeout_s", float),
                   ("--decode-stall-timeout", "decode_stall_timeout_s", float))
"""serve and launch (one ``ClusterSpec``): (an older or shorter name, the dest, its type or True for a switch)."""
ALIASES = {
    "serve": (*CLUSTER_ALIASES, ("--log-dir", "run_dir", str)),
    "launch": (*CLUSTER_ALIASES, ("--run-dir", "log_dir", str)),
}
"""Per subcommand: (another name of a flag, this command's dest, its type or True for a switch)."""


def add_vocabulary(p: argparse.ArgumentParser, cmd: str) -> None:
    """The shared names on subcommand ``cmd`` (run, serve or launch)."""
    p.add_argument("--kv-cache-dtype", dest="kv_dtype", default=argparse.SUPPRESS,
                   choices=["float32", "bfloat16", "float16", "fp8_e4m3"], help="alias of --kv-dtype (sglang, vLLM)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (sglang / vLLM name): run: the ranks of the one in-process model; "
                        "serve / launch: --prefill-tp and --decode-tp at once")
    for part, what in zip(SPEC_PARTS, ("draft steps", "draft branches per step", "draft tokens verified")):
        p.add_argument("--" + part.replace("_", "-"), dest=part, type=int, default=None,
                       help=f"{what}: one part of --speculative S/K/D (sglang name)")
    for flag, dest, kind in ALIASES.get(cmd, ()):
        what = f"alias of --{dest.replace('_', '-')}"
        if kind is True:
            p.add_argument(flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=what)
        else:
            p.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=what)
    if cmd in ("serve", "launch"):
        p.add_argument("--no-speculative", dest="speculative", action="store_const", const="off",
                       default=argparse.SUPPRESS, help="same as --speculative off")
        p.add_argument("--dp", type=int, default=None,
                       help="data-parallel size: identical workers per role (--prefill K --decode K at once; TP4 x "
                            "DP2 is --decode-tp 4 --decode 2)")


def resolve_vocabulary(args: argparse.Namespace, cmd: str) -> None:
    """Fold the aliases into the names the command reads; ValueError for a combination that cannot hold."""
    parts = [getattr(args, p, None) for p in SPEC_PARTS]
    if any(v is not None for v in parts):
        base = getattr(args, "speculative", None)
        if base in (None, "", "off") or getattr(args, "no_speculative", False):
            base = DEFAULT_SPECULATIVE
        given = base.split("/")
        if len(given) != 3:
            raise ValueError(f"--speculative {base}: expected STEPS/TOPK/DRAFT_TOKENS")
        args.speculative = "/".join(str(v) if v is not None else g for v, g in zip(parts, given))
        if hasattr(args, "no_speculative"):
            args.no_speculative = False
    dp = getattr(args, "dp", None)
    if dp is not None:  # data parallelism = identical workers per role
        if dp < 1:
            raise ValueError(f"--dp must be >= 1, got {dp}")
        args.prefill = args.decode = dp
    tp = getattr(args, "tp", None)
    if tp is not None:
        if tp < 1:
            raise ValueError(f"--tp must be >= 1, got {tp}")
        if cmd in ("launch", "serve"):
            args.prefill_tp = args.decode_tp = tp


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML mapping of long flag names (without --) to values; flags on the command line override it")


def config_argv(argv: list[str], sub: argparse._SubParsersAction) -> list[str]:
    """``argv`` with the flags of its ``--config FILE`` inserted right after the subcommand (so the command
    line, parsed after them, overrides them); ValueError for an unreadable file or an unknown key."""
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    cmd_at = next((i for i, a in enumerate(argv) if a in sub.choices), None)
    if path is None or cmd_at is None:
        return argv
    cmd, sp = argv[cmd_at], sub.choices[argv[cmd_at]]
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        # bad input, not a bug: ValueError is what the CLI turns into its one-line error
        raise ValueError(f"--config {path}: expected a mapping of flags to values")  # noqa: TRY004
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        action = sp._option_string_actions.get(flag)  # argparse keeps no public map of its flags
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}: unknown key {key!r} (not a flag of pdserve {cmd})")
        if action.nargs == 0:  # a switch
            if value is True:
                flags.append(flag)
            elif value not in (False, None):
                raise ValueError(f"--config {path}: {key} is a switch: true or false, got {value!r}")
        elif value is not None:
            items = value if isinstance(value, list) else [value]
            text = ",".join("true" if v is True else "false" if v is False else str(v) for v in items)
            if isinstance(action, argparse._AppendAction):  # a repeatable flag: once per item
                for v in items:
                    flags += [flag, str(v)]
            else:
                flags += [flag, text]
    return argv[:cmd_at + 1] + flags + argv[cmd_at + 1:]


def apply_rules(root: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """Every subcommand: no abbreviations, defaults shown in --help, -v/--verbose after it too."""
    root.allow_abbrev = False
    for sp in sub.choices.values():
        sp.allow_abbrev = False
        sp.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        if "--verbose" not in sp._option_string_actions:
            sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                            help="debug logging (also accepted before the subcommand)")


def parse_ids(s: str | None) -> list[int] | None:
    if not s:
        return None
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--token-ids must be comma-separated integers, got {s!r}") from None
