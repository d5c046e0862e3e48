"""Why a worker keeps one OpenMP team (``worker/omp.py``): a compiled decode step timed on the thread that loaded
the model, on a second thread while the loading thread lives (two teams: libgomp's throttled spin), and on a
second thread once the loading thread has ended.

    PYTHONPATH=$PWD flock /tmp/pdserve-bench.lock .venv/bin/python -m bench.omp_threads [--model DIR]
        [--dtype bfloat16] [--threads 2] [--prompt-len 256] [--steps 100]

Each case runs in a fresh process (a process's OpenMP teams outlive the case otherwise). The throttle needs the
teams' threads to outnumber the CPUs: with ``--threads`` below the core count the three cases match.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading

import torch

from bench.profile_decode_step import make_step, time_steps
from engine.defaults import default_model_dir, tune_malloc

CASES = {"loader": "on the thread that loaded the model",
         "second-while-loader-lives": "on a second thread while the loading thread lives",
         "second-after-loader-ended": "on a second thread once the loading thread has ended"}


def run_case(case: str, model: str, dtype: str, threads: int, prompt_len: int, steps: int) -> float:
    """us per step for ``case`` (in this process)."""
    tune_malloc()
    torch.set_num_threads(threads)
    loaded, release = threading.Event(), threading.Event()
    box: dict = {}

    def timed() -> float:
        return statistics.median(time_steps(box["step"], steps) for _ in range(3)) * 1e6

    def loader() -> None:
        box["step"] = make_step(model, dtype, "compiled", prompt_len)
        time_steps(box["step"], 30)
        if case == "loader":
            box["us"] = timed()
        loaded.set()
        release.wait()

    t = threading.Thread(target=loader)
    t.start()
    loaded.wait()
    if case == "second-after-loader-ended":
        release.set()
        t.join()
    if case != "loader":
        second = threading.Thread(target=lambda: box.setdefault("us", timed()))
        second.start()
        second.join()
    release.set()
    t.join()
    return box["us"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in this process
    args = ap.parse_args()
    model = args.model or default_model_dir()
    if args.case:
        print(json.dumps(run_case(args.case, model, args.dtype, args.threads, args.prompt_len, args.steps)))
        return
    print(f"model {model}, {args.dtype}, compiled decode step, batch 1, {args.threads} threads, "
          f"{args.prompt_len}-token prompt")
    for case, label in CASES.items():
        out = subprocess.run([sys.executable, "-m", "bench.omp_threads", "--case", case, "--model", model,
                              "--dtype", args.dtype, "--threads", str(args.threads), "--prompt-len",
                              str(args.prompt_len), "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        print(f"  {label:>55}: {float(out.stdout.strip().splitlines()[-1]):7.0f} us/step")


if __name__ == "__main__":
    main()
