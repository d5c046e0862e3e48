"""Run ``pdserve serve`` as a subprocess for end-to-end tests, and build the model it serves."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under", "name", "very", "through", "just", "form"]


def model_with_tokenizer(src_dir: str, dst_dir: str, vocab_size: int) -> str:
    """Copy a checkpoint and add a word-level ``tokenizer.json`` whose ids fit the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    shutil.copytree(src_dir, dst_dir)
    vocab = {"[UNK]": 0}
    for w in WORDS:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(dst_dir, "tokenizer.json"))
    return dst_dir


class ServeProcess:
    """``pdserve serve ...`` in its own session (it is the process group leader), output to a file."""

    def __init__(self, args: list[str], out_path: str, env: dict | None = None) -> None:
        self.out_path = out_path
        self._out = open(out_path, "wb")
        if "--http-port" not in args:  # the default (8000) would clash between concurrent test runs
            args = [*args, "--http-port", "0"]
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", *args], cwd=REPO,
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self.address = ""
        self.http_url = ""
        """``http://HOST:PORT/v1`` of the OpenAI-compatible front door ("" when off)."""
        self.children: dict[str, int] = {}

    def output(self) -> str:
        with open(self.out_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_listening(self, timeout_s: float = 240) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.output()
            m = re.search(r"pdserve: listening on (\S+)", out)
            if m and "router" in out.split(m.group(0))[1]:
                self.address = m.group(1)
                h = re.search(r"pdserve: OpenAI-compatible HTTP on (\S+)", out)
                self.http_url = h.group(1) if h else ""
                self.children = {name: int(pid) for name, pid in
                                 re.findall(r"pdserve:\s+(\S+)\s+pid (\d+)", out)}
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}:\n{out[-4000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"pdserve serve not listening within {timeout_s}s:\n{self.output()[-4000:]}")

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._out.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def rpc_code(fn) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def pages_all_free(client, skip: str = "") -> bool:
    """Every decode worker's pool full again and no prefill page owned by a request (worker ``skip``,
    a dead one, excepted)."""
    st = client.cluster_status()
    workers = [w for w in st.workers if w.worker_id != skip]
    dec = [w for w in workers if w.role == "decode"]
    pre = [w for w in workers if w.role == "prefill"]
    return all(w.pages_free == w.pages_total for w in dec) and \
        all(w.info.get("pages_owned_by_requests") == "0" for w in pre)


def tiny_dsa_reference():
    """transformers' tiny GLM-5 with the weights ``tiny_dirs['dsa']`` saved (tests/engine/tiny.py's seed), set up
    for greedy runs past EOS: the reference the served greedy tokens must equal (``hf_greedy``)."""
    from tiny import make_hf_model  # tests/engine/tiny.py: transformers, only for the tests that compare with it
    hf = make_hf_model("dsa")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """``hf``'s ``n`` greedy tokens after ``prompt``."""
    import torch  # only for the tests that compare with transformers
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
