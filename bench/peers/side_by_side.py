"""Served side by side (issue 27): the same client and workload against ``pdserve serve``, vLLM's CPU server and
llama.cpp's server, one after the other on 127.0.0.1, on the peers' tiny glm4_moe.

    bench/peers/setup.sh                                       # once: the peers' venvs under $PDSERVE_PEERS_DIR
    PYTHONPATH=$PWD flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.peers.side_by_side \\
        [--servers pdserve,vllm,llama] [--clients pdserve,vllm] [--concurrency 1,8] [--json out.json]

Each server is started, waited for (``/v1/models`` answers), loaded by every client at every concurrency, then
stopped (SIGTERM to its process group, SIGKILL after 30 s). Clients: ``pdserve bench --backend openai
--workload random`` (token-id prompts drawn below the tokenizer's 2048 ids, fixed input/output lengths,
``ignore_eos``, greedy) and, with ``vllm`` in ``--clients``, ``vllm bench serve --dataset-name random`` from the
vLLM venv as a second, independent client. Both report vLLM's keys; the table has pdserve's advantage over each
server (> 1.0x: pdserve better: output tok/s ours / theirs, latencies theirs / ours).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator

from bench.peers.checkpoint import write_gguf, write_hf
from bench.peers.paths import REPO, default_cores, peer_paths, vllm_env
from bench.peers.results import render_served, served_figures
from bench.serve_proc import serve_endpoints
from common.env import child_environ

MODEL_NAME = "glm4moe"
SERVERS = {"pdserve": "pdserve", "vllm": "vLLM CPU 0.32", "llama": "llama.cpp server"}
CLIENTS = {"pdserve": "pdserve bench", "vllm": "vllm bench serve"}
PROMPT_VOCAB = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    """Poll ``base_url/models`` until it answers 200; the server's log tail in the error otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(base_url + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"server at {base_url} not ready (exit code {proc.poll()}):\n{tail}")


@contextlib.contextmanager
def peer_server(cmd: list[str], env: dict[str, str] | None, port: int, log_path: str,
                timeout_s: float) -> Iterator[str]:
    """Start ``cmd`` in its own process group; yields its base URL once ready; stops the group on exit."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_ready(base_url, proc, log_path, timeout_s)
        yield base_url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def start(server: str, args: argparse.Namespace, hf_dir: str, root: str, scratch: str) -> Iterator[str]:
    """One server on 127.0.0.1 (see the module docstring); yields its OpenAI base URL."""
    peers, ctx = peer_paths(), args.input_len + args.output_len + 64
    if server == "pdserve":
        with serve_endpoints(["--model", hf_dir, "--served-model-name", MODEL_NAME, *args.pdserve_flags.split()],
                             args.start_timeout) as ends:
            yield ends.http
        return
    port, log_path = free_port(), os.path.join(scratch, f"{server}.log")
    if server == "vllm":
        cmd = [peers.vllm, "serve", hf_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--served-model-name", MODEL_NAME, "--max-model-len", str(ctx),
               "--max-num-seqs", str(max(args.concurrency))]
        env = vllm_env(args.threads, args.vllm_cores)
    else:
        slots = max(args.concurrency)
        cmd = [peers.llama_server, "-m", write_gguf(root), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-np", str(slots), "-c", str(slots * ctx), "--alias", MODEL_NAME]
        env = None
    with peer_server(cmd, env, port, log_path, args.start_timeout) as url:
        yield url


def run_client(client: str, base_url: str, concurrency: int, args: argparse.Namespace, hf_dir: str,
               out_dir: str) -> dict:
    """One client at one concurrency against ``base_url``; returns its result JSON."""
    os.makedirs(out_dir, exist_ok=True)
    if client == "pdserve":
        cmd = [sys.executable, "-m", "cli", "bench", "--backend", "openai", "--base-url", base_url,
               "--model", MODEL_NAME, "--workload", "random", "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--input-range", f"{args.input_len},{args.input_len}",
               "--output-range", f"{args.output_len},{args.output_len}", "--concurrency", str(concurrency),
               "--duration", str(args.duration), "--warmup", str(args.warmup), "--seed", "0",
               "--vocab-size", str(PROMPT_VOCAB), "--out", out_dir, "--quiet"]
        env, result_path = child_environ(PYTHONPATH=REPO), os.path.join(out_dir, "bench.json")
    else:
        num_prompts = max(args.vllm_prompts_per_slot * concurrency, 8)
        cmd = [peer_paths().vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url.removesuffix("/v1"),
               "--endpoint", "/v1/completions", "--model", hf_dir, "--served-model-name", MODEL_NAME,
               "--tokenizer", hf_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--save-result",
               "--result-dir", out_dir, "--result-filename", "result.json"]
        env, result_path = vllm_env(args.threads, args.vllm_cores), os.path.join(out_dir, "result.json")
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if p.returncode != 0 or not os.path.exists(result_path):
        raise RuntimeError(f"{CLIENTS[client]} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    with open(result_path) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="default: $PDSERVE_PEERS_DIR/glm4moe (created if missing)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--clients", default="pdserve,vllm")
    ap.add_argument("--concurrency", default="1,4", help="comma separated; one run per value")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0, help="pdserve bench: measured seconds per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="pdserve bench: warm-up seconds per run")
    ap.add_argument("--vllm-prompts-per-slot", type=int, default=2, help="vllm bench serve: prompts per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>; "
                    "'nobind' leaves the threads to the OS scheduler)")
    ap.add_argument("--pdserve-flags", default="--dtype bfloat16 --kv-dtype bfloat16 --decode-weights model",
                    help="extra flags of pdserve serve (default: bf16 like the peers, the checkpoint's own experts)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.vllm_cores = args.vllm_cores or default_cores(args.threads)
    servers, clients = args.servers.split(","), args.clients.split(",")
    if bad := [s for s in servers if s not in SERVERS] + [c for c in clients if c not in CLIENTS]:
        raise SystemExit(f"unknown servers/clients {bad}: servers {list(SERVERS)}, clients {list(CLIENTS)}")
    root = args.model_dir or os.path.join(peer_paths().root, "glm4moe")
    hf_dir = write_hf(root)
    runs: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    raw, failed = {}, {}
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as scratch:
        for server in servers:
            t0 = time.perf_counter()
            try:
                with start(server, args, hf_dir, root, scratch) as url:
                    print(f"{SERVERS[server]}: up at {url} in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                          flush=True)
                    for client in clients:
                        for c in args.concurrency:
                            result = run_client(client, url, c, args, hf_dir,
                                                os.path.join(scratch, server, client, str(c)))
                            runs.setdefault((CLIENTS[client], f"concurrency {c}"), {})[SERVERS[server]] = \
                                served_figures(result)
                            raw[f"{server}/{client}/{c}"] = served_figures(result)
            except (RuntimeError, SystemExit, subprocess.SubprocessError, OSError) as e:
                failed[SERVERS[server]] = str(e)
                print(f"{SERVERS[server]}: FAILED: {e}", file=sys.stderr, flush=True)
    print(f"\nglm4_moe (hidden 256, 4 layers, 16 experts top-4, bf16) served on 127.0.0.1, {args.threads} threads; "
          f"{args.input_len} prompt tokens -> {args.output_len} output tokens (ignore_eos, greedy)\n")
    print(render_served(runs, SERVERS["pdserve"]))
    for server, err in failed.items():
        print(f"\n{server}: not measured: {err.splitlines()[0] if err else '?'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "figures": raw, "failed": failed}, f, indent=1)


if __name__ == "__main__":
    main()
