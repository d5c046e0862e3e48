"""Engine-level peer table (issue 28): pdserve's engine against transformers, vLLM's CPU backend and llama.cpp,
one run, one checkpoint (the peers' tiny glm4_moe, ``bench/peers/checkpoint.py``).

    bench/peers/setup.sh                                  # once: the peers' venvs under $PDSERVE_PEERS_DIR
    PYTHONPATH=$PWD flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.peers.engine_table \\
        [--columns pdserve-bf16,vllm] [--merge previous.json] [--json out.json]

Decode: B random 64-token prompts, 128 greedy tokens (``ignore_eos``); a round's rate is B * 127 / (t(128) -
t(1)) (prefill and first token taken out); llama.cpp's is ``llama-batched-bench``'s generation rate (S_TG) at
B parallel sequences with 64-token prompts. Prefill: one prompt of 2k / 8k tokens, one output token; llama.cpp's
is ``llama-bench -p N -n 0``. Median of ``--rounds`` rounds, every peer on ``--threads`` threads (vLLM's OpenMP
threads bound to cores 0..threads-1 unless ``--vllm-cores`` says otherwise). Ratios are pdserve's best column / the
peer (>= 1.0x: pdserve as fast).
``--merge`` fills the columns not measured in this run from a previous run's JSON (to iterate on pdserve
alone).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch
import transformers

from bench.peers.checkpoint import write_gguf, write_hf
from bench.peers.paths import REPO, default_cores, peer_paths, vllm_env
from bench.peers.results import PeerTable, parse_batched_bench, parse_llama_bench, tokens_label
from engine.defaults import tune_malloc
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams

COLUMNS = {"pdserve-fp32": "pdserve fp32", "pdserve-bf16": "pdserve bf16", "transformers": "transformers bf16",
           "vllm": "vLLM CPU 0.32", "llama": "llama.cpp (bf16 GGUF)"}
NUM_OURS = 2
PROMPT_VOCAB = 2048
"""Prompt ids are drawn from [2, 2048): the tokenizer's ids, so every server can also detokenize them."""


class Workload:
    """The shapes every column measures (from the command line)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.batches = [int(x) for x in args.batches.split(",") if x]
        self.prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x]
        self.prompt_len, self.new, self.rounds, self.threads = args.prompt_len, args.new, args.rounds, args.threads
        self.vllm_cores = args.vllm_cores or default_cores(args.threads)
        self.rng = random.Random(0)

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(2, PROMPT_VOCAB) for _ in range(length)] for _ in range(n)]

    def decode_rounds(self, run) -> dict[int, list[float]]:
        """{batch: per-round tok/s} for ``run(prompts, max_tokens)`` (a warm-up per batch size first)."""
        out = {}
        for b in self.batches:
            run(self.prompts(b, self.prompt_len), 4)
            rates = []
            for _ in range(self.rounds):
                ps = self.prompts(b, self.prompt_len)
                rates.append(b * (self.new - 1) / (timed(run, ps, self.new) - timed(run, ps, 1)))
            out[b] = rates
        return out

    def prefill_rounds(self, run) -> dict[int, list[float]]:
        out = {}
        for n in self.prefill_lens:
            run(self.prompts(1, n), 1)
            out[n] = [n / timed(run, self.prompts(1, n), 1) for _ in range(self.rounds)]
        return out


def timed(run, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    run(prompts, max_tokens)
    return time.perf_counter() - t0


def measure_pdserve(model_dir: str, dtype: str, w: Workload, compile_decode: bool) -> tuple[dict, dict]:
    model, cfg = load_model(model_dir, dtype, "cpu")
    model.compile_decode(compile_decode)

    def engine(num_seqs: int, max_len: int) -> Engine:
        return Engine(model, cfg, kv_dtype=dtype, page_size=16, num_pages=num_seqs * (max_len // 16 + 2) + 8,
                      chunk_size=max(w.prefill_lens + [w.prompt_len]))

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        shape = (len(prompts), max(map(len, prompts)) + max(max_tokens, w.new))
        if shape not in engines:
            engines[shape] = engine(*shape)
        engines[shape].generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    engines: dict[tuple[int, int], Engine] = {}  # one KV pool per (requests, longest sequence)
    return w.decode_rounds(run), w.prefill_rounds(run)


def measure_transformers(model_dir: str, w: Workload) -> tuple[dict, dict]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    def prefill(prompts: list[list[int]], max_tokens: int) -> None:
        with torch.no_grad():
            hf(torch.tensor(prompts), logits_to_keep=1, use_cache=False)

    return w.decode_rounds(generate), w.prefill_rounds(prefill)


def measure_vllm(model_dir: str, w: Workload) -> tuple[dict, dict]:
    peers = peer_paths()
    if not peers.has_vllm():
        raise RuntimeError(f"vLLM peer not set up in {peers.root} (bench/peers/setup.sh vllm)")
    cmd = [peers.vllm_python, os.path.join(REPO, "bench", "peers", "vllm_engine.py"), "--model", model_dir,
           "--batches", ",".join(map(str, w.batches)), "--prompt-len", str(w.prompt_len), "--new", str(w.new),
           "--prefill-lens", ",".join(map(str, w.prefill_lens)), "--rounds", str(w.rounds),
           "--vocab", str(PROMPT_VOCAB)]
    out = run_peer(cmd, vllm_env(w.threads, w.vllm_cores))
    decode: dict[int, list[float]] = {}
    prefill: dict[int, list[float]] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            (decode if r["kind"] == "decode" else prefill).setdefault(r.get("batch") or r.get("tokens"),
                                                                      []).append(r["tok_s"])
    return decode, prefill


def measure_llama(gguf: str, w: Workload) -> tuple[dict, dict]:
    peers = peer_paths()
    if not peers.has_llama():
        raise RuntimeError(f"llama.cpp peer not set up in {peers.root} (bench/peers/setup.sh llama)")
    ctx = max(w.batches) * (w.prompt_len + w.new) + 64
    decode: dict[int, list[float]] = {}
    for _ in range(w.rounds):
        out = run_peer([peers.llama_batched_bench, "-m", gguf, "-t", str(w.threads), "-c", str(ctx),
                        "-b", "2048", "-npp", str(w.prompt_len), "-ntg", str(w.new),
                        "-npl", ",".join(map(str, w.batches)), "--output-format", "jsonl"], None, with_stderr=True)
        for b, rate in parse_batched_bench(out).items():
            decode.setdefault(b, []).append(rate)
    longest = max(w.prefill_lens)
    out = run_peer([peers.llama_bench, "-m", gguf, "-t", str(w.threads), "-p", ",".join(map(str, w.prefill_lens)),
                    "-n", "0", "-b", str(longest), "-r", str(w.rounds), "-o", "json"], None)
    return decode, parse_llama_bench(out)


def run_peer(cmd: list[str], env: dict[str, str] | None, with_stderr: bool = False) -> str:
    """A peer's measuring command; its stdout (and stderr after it, ``with_stderr``: llama.cpp's tools log
    their results), or its error output in the error raised when it fails."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}:\n{p.stderr[-4000:]}")
    return p.stdout + ("\n" + p.stderr if with_stderr else "")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    return f"{name} ({', '.join(f for f in ('avx512f', 'avx512_bf16', 'amx_bf16') if f in flags) or 'no AVX512'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="default: $PDSERVE_PEERS_DIR/glm4moe (created if missing)")
    ap.add_argument("--columns", default=",".join(COLUMNS), help=f"any of {','.join(COLUMNS)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill-lens", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>; "
                    "'nobind' leaves the threads to the OS scheduler)")
    ap.add_argument("--no-compile", action="store_true", help="pdserve's decode steps eager")
    ap.add_argument("--merge", default=None, help="a previous run's JSON: fills the columns not measured now")
    ap.add_argument("--json", default=None, help="write the table (every round) here")
    args = ap.parse_args()
    wanted = [c for c in args.columns.split(",") if c]
    if unknown := [c for c in wanted if c not in COLUMNS]:
        raise SystemExit(f"unknown columns {unknown}; known: {list(COLUMNS)}")
    tune_malloc()  # pdserve's workers run with it
    torch.set_num_threads(args.threads)
    root = args.model_dir or os.path.join(peer_paths().root, "glm4moe")
    hf_dir, w = write_hf(root), Workload(args)
    table = PeerTable(list(COLUMNS.values()), NUM_OURS)
    failed = {}
    for key in wanted:
        t0 = time.perf_counter()
        try:
            if key.startswith("pdserve-"):
                dtype = "float32" if key == "pdserve-fp32" else "bfloat16"
                decode, prefill = measure_pdserve(hf_dir, dtype, w, not args.no_compile)
            elif key == "transformers":
                decode, prefill = measure_transformers(hf_dir, w)
            elif key == "vllm":
                decode, prefill = measure_vllm(hf_dir, w)
            else:
                decode, prefill = measure_llama(write_gguf(root), w)
        except (RuntimeError, SystemExit, subprocess.SubprocessError) as e:
            failed[COLUMNS[key]] = str(e)
            print(f"{COLUMNS[key]}: FAILED: {e}", file=sys.stderr, flush=True)
            continue
        for b, rates in decode.items():
            table.add(f"decode bs{b}", COLUMNS[key], rates)
        for n, rates in prefill.items():
            table.add(f"prefill {tokens_label(n)}", COLUMNS[key], rates)
        print(f"{COLUMNS[key]}: measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.merge:
        with open(args.merge) as f:
            taken = table.merge_missing(PeerTable.from_json(json.load(f)["table"]))
        print(f"from {args.merge}: {', '.join(taken) or 'nothing'}")
    rows = [f"decode bs{b}" for b in w.batches] + [f"prefill {tokens_label(n)}" for n in w.prefill_lens]
    cpu = cpu_model()
    print(f"\nCPU: {cpu}; {args.threads} threads; glm4_moe hidden 256, 4 layers, 16 experts top-4 (bf16 weights); "
          f"decode {args.prompt_len}-token prompts, {args.new} greedy tokens; tok/s, median of {args.rounds}\n")
    print(table.render(rows))
    for col, err in failed.items():
        print(f"\n{col}: not measured: {err.splitlines()[0] if err else '?'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "threads": args.threads, "argv": sys.argv, "table": table.to_json(),
                       "failed": failed}, f, indent=1)


if __name__ == "__main__":
    main()
