"""Checks made once, in the command, before any process is spawned: each failure is one line (the CLI
prints ``pdserve: error: <line>`` and exits 2) instead of a worker's traceback seconds later.

model directory -> config.json -> architecture -> checkpoint headers (file names) -> tokenizer (when text
is needed) -> flags (speculative syntax, pool sizing, TLS files) -> ports free -> memory (every worker's
weights, activations and KV pool together against what this host or GPU has).
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
from typing import NamedTuple

import torch

from common.reasons import Role
from engine.config import ModelConfig
from engine.defaults import default_model_dir
from engine.headers import TensorInfo, checkpoint_tensors
from engine.load import resolve_device
from engine.loader import CheckpointError
from engine.memory import ACTIVATION_RESERVE_BYTES, device_memory, gib
from engine.quant.mx import MX_FORMATS
from engine.sizing import StartPlan, plan_start, pool_sizing
from engine.speculative.config import SpecConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PreflightError(ValueError):
    """A check failed; the message is the one line the command prints."""


class ModelCheck(NamedTuple):
    model_dir: str
    cfg: ModelConfig
    tensors: list[TensorInfo]


def check_model(model: str, flag: str = "--model", need_text: bool = False) -> ModelCheck:
    """The model directory, its config.json and architecture, its checkpoint headers and (``need_text``)
    its tokenizer."""
    if not os.path.isdir(model):
        hint = ""
        if HUB_ID.match(model) and not os.path.exists(model):
            hint = (f" (a Hugging Face Hub id? pdserve serves local checkpoints: `huggingface-cli download {model} "
                    f"--local-dir DIR`, then {flag} DIR)")
        what = "not a directory" if os.path.exists(model) else "no such directory"
        raise PreflightError(f"{flag} {model}: {what}{hint}")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise PreflightError(f"{flag} {model}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        with open(path) as f:
            raw = json.load(f)
        cfg = ModelConfig.from_dict(raw)
    except json.JSONDecodeError as e:
        raise PreflightError(f"{path}: not valid JSON ({e})") from None
    except KeyError as e:
        raise PreflightError(f"{path}: missing {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        arch = ",".join(raw.get("architectures") or []) if isinstance(raw, dict) else ""
        raise PreflightError(f"{path}: {e}" + (f" (architectures: {arch})" if arch else "")) from None
    try:
        tensors = checkpoint_tensors(model)
    except CheckpointError as e:
        raise PreflightError(str(e)) from None
    if not tensors:
        raise PreflightError(f"{flag} {model}: the checkpoint holds no tensors")
    if need_text and not os.path.isfile(os.path.join(model, "tokenizer.json")):
        raise PreflightError(f"{flag} {model}: no tokenizer.json, so text prompts cannot be encoded (give token ids)")
    return ModelCheck(model, cfg, tensors)


def check_speculative(text: str | None, flag: str = "--speculative") -> None:
    if text is None or text in ("", "off"):
        return
    try:
        SpecConfig.parse(text)
    except ValueError as e:
        raise PreflightError(f"{flag} {text}: {e}") from None


def check_port_free(host: str, port: int, flag: str) -> None:
    """Bind it the way the servers do (SO_REUSEADDR) and let go; 0 / -1 (any free port) pass."""
    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            why = "in use by another process" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise PreflightError(f"{flag} {port}: cannot listen on {host}:{port}: {why}") from None


class WorkerNeed(NamedTuple):
    role: str
    plan: StartPlan


def check_memory(roles: list[tuple[str, str]], dtype: str, kv_dtype: str | None, page_size: int,
                 num_pages: int | None, kv_cache_memory: str | None, mem_fraction: float | None,
                 device: str = "auto") -> list[WorkerNeed]:
    """Every co-located worker's plan (``roles``: (role, weights dir) each; a ``mem_fraction`` is shared
    equally), then their sum against the memory available now."""
    dev = resolve_device(device)
    share = mem_fraction / len(roles) if mem_fraction else None
    try:
        sizing = pool_sizing(num_pages, kv_cache_memory, share)
        needs = [WorkerNeed(role, plan_start(weights, dtype, kv_dtype, dev, page_size, sizing))
                 for role, weights in roles]
    except ValueError as e:  # PoolSizeError, CheckpointError, a bad size or more than one sizing flag
        raise PreflightError(str(e)) from None
    total = sum(n.plan.pool.pool_bytes + n.plan.weights_bytes + ACTIVATION_RESERVE_BYTES for n in needs)
    mem = device_memory(dev if dev.type == "cuda" else torch.device("cpu"))
    if total > mem.available_bytes:
        each = ", ".join(f"{n.role} {gib(n.plan.weights_bytes)} weights + {gib(n.plan.pool.pool_bytes)} KV"
                         for n in needs)
        raise PreflightError(f"{len(needs)} workers need {gib(total)} ({each}, {gib(ACTIVATION_RESERVE_BYTES)} "
                             f"activations each) but {gib(mem.available_bytes)} is available on {mem.device}: "
                             f"lower --num-pages / --kv-cache-memory / --mem-fraction or run fewer workers")
    return needs


def check_serve(cfg) -> None:
    """Everything ``pdserve serve`` can check before it spawns a process (``cfg``: a ``LocalClusterConfig``,
    whose own ``__post_init__`` already checked the flag values and TLS files)."""
    model = cfg.model or default_model_dir()
    check_model(model)
    decode_weights = model
    if cfg.decode_weights not in ("model", *MX_FORMATS):
        decode_weights = check_model(cfg.decode_weights, "--decode-weights").model_dir
    check_speculative(cfg.speculative)
    check_port_free(cfg.router.host, cfg.router.port, "--port")
    check_port_free(cfg.router.host, cfg.router.http_port, "--http-port")
    roles = [(Role.PREFILL, model)] * cfg.prefill + [(Role.DECODE, decode_weights)] * cfg.decode
    check_memory(roles, cfg.dtype, cfg.kv_dtype, cfg.page_size, cfg.num_pages, cfg.kv_cache_memory,
                 cfg.mem_fraction)


def check_launch(cfg) -> None:
    """What ``pdserve launch`` can check before Ray is contacted (``cfg``: a ``RayLaunchConfig``): the model (read
    here for its hash) and the flags' syntax."""
    check_model(cfg.model or default_model_dir())
    check_speculative(cfg.speculative)
    pool_sizing(cfg.num_pages, cfg.kv_cache_memory, cfg.mem_fraction)
