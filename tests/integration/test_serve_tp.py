"""Tensor-parallel workers through ``pdserve serve`` (real processes, real gRPC, gloo on CPU): a worker of
``--prefill-tp`` / ``--decode-tp`` 2 is two rank processes.

The shipped default model (MTP layer, so decode speculates: ``move_kv``, ``forward_mtp`` and ``logits``
go through the ranks too) in fp32, with ``PDSERVE_RANK_CHECK=1``: after every model call the ranks of a
worker compare their logits, so a KV write that was not mirrored to a follower (received pages, moved
draft KV) fails the worker instead of passing unnoticed.

- prefill TP2 -> decode TP1 and prefill TP1 -> decode TP2 give the greedy tokens of TP1 (``pdserve run``'s
  in-process engine), a session's next turn too, with the decode worker's resident prefix reused (at decode TP2
  every rank kept its pages: replicated MLA KV, and GQA's split heads);
- a follower rank SIGKILLed mid-stream: the stream fails over and completes, the broken worker exits and
  is restarted with new ranks, every page is back, no rank process of the old group survives.
"""
import os
import signal

import pytest

from engine.defaults import SHIPPED_DEFAULT
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams
from router.client import GenerationClient
from serve_helpers import ServeProcess, pages_all_free, pid_alive
from shared_helpers import wait_until

PROMPTS = [[3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71], [100, 200, 300, 400]]
MAX_TOKENS = 24

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")),
                                reason="no default model")


@pytest.fixture(scope="module")
def reference():
    model, cfg = load_model(SHIPPED_DEFAULT, "float32", "cpu")
    eng = Engine(model, cfg, kv_dtype="float32", num_pages=64)
    out = [eng.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids for p in PROMPTS]
    turn2 = PROMPTS[0] + out[0] + [2, 4, 6, 8, 10]  # the session's next turn (decode-side reuse)
    out.append(eng.generate([turn2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids)
    del eng, model
    return out


def serve(tmp_path, name: str, *flags: str) -> ServeProcess:
    d = tmp_path / name
    d.mkdir()
    sp = ServeProcess(["--model", SHIPPED_DEFAULT, "--port", "0", "--dtype", "float32", "--decode-weights", "model",
                       "--speculative", "3/1/4", "--no-spec-fallback", "--num-pages", "128",
                       "--local-prefill-below", "0", "--threads-per-worker", "1", "--decode-stall-timeout", "20",
                       "--run-dir", str(d / "run"), *flags], str(d / "serve.out"), env={"PDSERVE_RANK_CHECK": "1"})
    sp.wait_listening()
    return sp


def rank_pids(client, role: str) -> dict[str, list[int]]:
    """worker id -> [rank 0 pid, follower pids...] of every worker of ``role``."""
    return {w.worker_id: [int(w.info["pid"])] + [int(p) for p in w.info["rank_pids"].split(",") if p]
            for w in client.cluster_status().workers if w.role == role}


def test_prefill_tp2_to_decode_tp1_gives_the_tp1_tokens(reference, tmp_path):
    sp = serve(tmp_path, "p2d1", "--prefill-tp", "2")
    try:
        with GenerationClient(sp.address, timeout_s=120) as client:
            [pre] = rank_pids(client, "prefill").values()
            assert len(pre) == 2 and all(pid_alive(p) for p in pre)
            for prompt, want in zip(PROMPTS, reference):
                assert client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == want
            # the next turn: the decode worker (TP1) still holds turn 1's final pages, the TP2 prefill ships the tail
            turn2 = PROMPTS[0] + reference[0] + [2, 4, 6, 8, 10]
            got = client.generate(token_ids=turn2, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert got.token_ids == reference[2]
            assert got.metrics.decode_resident_tokens == (len(PROMPTS[0]) + MAX_TOKENS - 1) // 16 * 16
            assert all(w.healthy for w in client.cluster_status().workers)
            wait_until(lambda: pages_all_free(client), what="every page back")
    finally:
        assert sp.stop() == 0
    assert not any(pid_alive(p) for p in pre), "every rank exits with its worker"


def test_prefill_tp1_to_decode_tp2_and_a_killed_rank_fails_over(reference, tmp_path):
    sp = serve(tmp_path, "p1d2", "--decode", "2", "--decode-tp", "2")
    seen: set[int] = set()
    try:
        with GenerationClient(sp.address, timeout_s=120) as client:
            old = rank_pids(client, "decode")
            assert sorted(len(v) for v in old.values()) == [2, 2]
            seen.update(p for v in old.values() for p in v)
            served = []
            for prompt, want in zip(PROMPTS, reference):  # KV received on rank 0, mirrored to rank 1
                got = client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                assert got.token_ids == want
                served.append(got.metrics.decode_worker)
            # the next turn: the decode worker that served turn 1 keeps its final pages on both ranks, only the tail
            # is shipped (and mirrored); PDSERVE_RANK_CHECK compares the ranks' logits at every step. Its cache events
            # reach the router asynchronously: the turn is sent once the router knows where the session is
            wait_until(lambda: int(next(w for w in client.cluster_status().workers if w.worker_id == served[0])
                                    .info["router_cached_blocks"]) >= 2, what="the router learning turn 1's pages")
            turn2 = PROMPTS[0] + reference[0] + [2, 4, 6, 8, 10]
            got = client.generate(token_ids=turn2, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert got.token_ids == reference[2] and got.metrics.decode_worker == served[0]
            assert got.metrics.decode_resident_tokens == (len(PROMPTS[0]) + MAX_TOKENS - 1) // 16 * 16
            assert all(w.healthy for w in client.cluster_status().workers)

            # a follower rank dies mid-stream: its worker fails, the stream resumes on the other decode worker
            stream = client.stream(token_ids=PROMPTS[0], max_tokens=160, ignore_eos=True)
            tokens = list(next(stream).token_ids)
            busy = wait_until(lambda: [w for w in client.cluster_status().workers
                                       if w.role == "decode" and w.running], what="the stream's decode worker")
            victim = old[busy[0].worker_id]
            os.kill(victim[1], signal.SIGKILL)
            last = None
            for chunk in stream:
                tokens += chunk.token_ids
                last = chunk
            assert last.finish_reason == "length" and len(tokens) == 160
            wait_until(lambda: not pid_alive(victim[0]), timeout_s=30, what="rank 0 of the broken worker exits")
            out = wait_until(lambda: f"{busy[0].worker_id} is back" in (o := sp.output()) and o, timeout_s=60,
                             what="the broken worker restarted")
            assert f"{busy[0].worker_id} (pid {victim[0]}) exited" in out
            new = wait_until(lambda: (n := rank_pids(client, "decode"))[busy[0].worker_id][0] != victim[0] and n,
                             what="the new ranks in the status")
            assert len(new[busy[0].worker_id]) == 2 and not set(new[busy[0].worker_id]) & set(victim)
            seen.update(p for v in new.values() for p in v)
            assert not any(pid_alive(p) for p in victim), "no rank of the broken group survives"
            wait_until(lambda: all(w.healthy for w in client.cluster_status().workers), timeout_s=30,
                       what="every worker healthy")
            for prompt, want in zip(PROMPTS, reference):  # the restarted group serves the same tokens
                assert client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == want
            wait_until(lambda: pages_all_free(client), what="every page back")
    finally:
        assert sp.stop() == 0
    assert not any(pid_alive(p) for p in seen), "every rank exits with its worker"


def test_gqa_kv_heads_are_gathered_at_prefill_tp2_and_scattered_at_decode_tp2(tiny_dirs, tmp_path):
    """GQA (glm4_moe) splits KV heads across ranks: the prefill TP2 worker gathers every rank's heads into a
    full-layout staging pool and ships them whole; the decode TP2 worker's KV lands whole in its landing pool,
    then each rank takes its heads. The greedy tokens are TP1's; every page of every pool is back."""
    model, cfg = load_model(tiny_dirs["gqa"], "float32", "cpu")
    eng = Engine(model, cfg, kv_dtype="float32", num_pages=64)
    prompts = [[t % cfg.vocab_size for t in p] for p in PROMPTS]
    want = [eng.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
            for p in prompts]
    turn2 = prompts[0] + want[0] + [2, 4, 6, 8, 10]  # the session's next turn: decode-side reuse under split heads
    want2 = eng.generate([turn2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    d = tmp_path / "gqa"
    d.mkdir()
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0", "--dtype", "float32", "--decode-weights", "model",
                       "--no-speculative", "--num-pages", "128", "--local-prefill-below", "0",
                       "--threads-per-worker", "1", "--prefill-tp", "2", "--decode-tp", "2", "--run-dir", str(d / "run")],
                      str(d / "serve.out"), env={"PDSERVE_RANK_CHECK": "1"})
    try:
        sp.wait_listening()
        with GenerationClient(sp.address, timeout_s=120) as client:
            for prompt, expect in zip(prompts, want):
                assert client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == expect
            got = client.generate(token_ids=turn2, max_tokens=MAX_TOKENS, ignore_eos=True)  # each rank kept its heads
            assert got.token_ids == want2
            assert got.metrics.decode_resident_tokens == (len(prompts[0]) + MAX_TOKENS - 1) // 16 * 16
            assert all(w.healthy for w in client.cluster_status().workers)
            wait_until(lambda: pages_all_free(client), what="every page back")
            [dec] = [w for w in client.cluster_status().workers if w.role == "decode"]
            [pre] = [w for w in client.cluster_status().workers if w.role == "prefill"]
            assert dec.info["kv_landing_pages_used"] == "0" and pre.info["kv_staging_pages_used"] == "0"
    finally:
        assert sp.stop() == 0
