"""``pdserve serve`` start-up failure, conditional disaggregation on real workers (GLM-4.5 tiny, speculation
left on: the worker finds no MTP layer and runs without it), and Ctrl-C reaching the whole process group."""
import os
import signal

import pytest
import torch

from router.client import GenerationClient
from serve_helpers import ServeProcess, pid_alive, wait_until


def test_startup_failure_names_the_worker_and_leaves_nothing_behind(tmp_path):
    sp = ServeProcess(["--model", str(tmp_path / "no-such-model"), "--port", "0", "--run-dir", str(tmp_path / "run"),
                       "--startup-timeout", "120"], str(tmp_path / "serve.out"))
    assert sp.proc.wait(150) == 1
    out = sp.output()
    assert "pdserve: error:" in out and "exited with code" in out
    assert any(f"{name} (pid" in out for name in ("prefill-0", "decode-0"))
    assert "no-such-model" in out.split("pdserve: error:")[1]  # the log tail says why
    with pytest.raises(ProcessLookupError):
        os.killpg(sp.proc.pid, 0)  # no process left in its group
    sp.stop()


@pytest.fixture(scope="module")
def gqa_cluster(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_gqa")
    sp = ServeProcess(["--model", tiny_dirs["gqa"], "--port", "0", "--local-prefill-below", "16",
                       "--routing", "round_robin", "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        yield sp
    finally:
        sp.stop()


def test_short_prompts_are_prefilled_on_the_decode_worker(gqa_cluster):
    from tiny import make_hf_model
    hf = make_hf_model("gqa")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with GenerationClient(gqa_cluster.address, timeout_s=120) as c:
        for n, where in ((10, "decode-0"), (40, "prefill-0")):
            prompt = list(range(3, 3 + n))
            out = c.generate(token_ids=prompt, max_tokens=16, ignore_eos=True)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, n:].tolist()
            assert out.token_ids == ref and out.metrics.prefill_worker == where, (n, out.metrics)
        st = c.cluster_status()
        dec = next(w for w in st.workers if w.role == "decode")
        assert dec.info["speculative"] == "off"  # no MTP layer in this checkpoint
        wait_until(lambda: all(w.pages_free == w.pages_total for w in c.cluster_status().workers
                               if w.role == "decode"), what="decode pages freed")


def test_ctrl_c_reaches_every_process_and_serve_exits(gqa_cluster):
    pids = dict(gqa_cluster.children)
    assert set(pids) == {"prefill-0", "decode-0", "router"}
    os.killpg(gqa_cluster.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert gqa_cluster.proc.wait(40) == 0
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout_s=20, what="children gone")
