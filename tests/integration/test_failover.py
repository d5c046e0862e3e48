"""Mid-stream failover with real processes: ``pdserve serve`` with 1 prefill + 2 decode workers serving the
shipped default model (trained GLM-5 architecture) in fp32; a decode worker is killed with SIGKILL while 8
streams are running. Every stream must finish with exactly the greedy tokens transformers' ``generate``
gives (no token duplicated or missing across the failover), and the survivors must hold no pages.

The trained model, not a random one: after a failover the streamed tokens are re-prefilled in one
forward instead of decoded one by one, which rounds differently (within 1e-4, see
tests/engine/test_paged.py); a random model's near-tied logits turn that into a different argmax
(seen at token 59 of 64), a trained model's margins do not.
"""
import asyncio
import os
import signal

import pytest
import torch

from engine.defaults import SHIPPED_DEFAULT
from router.client import AsyncGenerationClient, Completion, GenerationClient
from serve_helpers import ServeProcess, pid_alive, wait_until

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("failover")
    sp = ServeProcess(["--model", SHIPPED_DEFAULT, "--prefill", "1", "--decode", "2", "--port", "0",
                       "--dtype", "float32", "--num-pages", "400", "--local-prefill-below", "0",
                       "--no-speculative", "--run-dir", str(d / "run")], str(d / "serve.out"))
    try:
        sp.wait_listening()
        yield sp
    finally:
        sp.stop()


def hf_greedy(prompts, n):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_DEFAULT, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def test_decode_worker_killed_mid_stream_every_stream_completes(served):
    sp = served
    prompts = [[(11 * i + 3 * j) % 1500 + 2 for j in range(20 + 7 * i)] for i in range(8)]
    expected = hf_greedy(prompts, NUM_TOKENS)
    progress = [0] * len(prompts)

    async def one(c: AsyncGenerationClient, i: int) -> Completion:
        out = Completion()
        async for chunk in c.stream(token_ids=prompts[i], max_tokens=NUM_TOKENS, ignore_eos=True):
            out.add(chunk, 0.0)
            progress[i] = len(out.token_ids)
            await asyncio.sleep(0.01)  # a slow reader: the streams stay open long enough to be cut
        return out

    async def run() -> tuple[list[Completion], str]:
        async with AsyncGenerationClient(sp.address, timeout_s=120) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(len(prompts))]
            while min(progress) < 4:  # every stream is decoding
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.005)
            st = await c.cluster_status()
            busy = max((w for w in st.workers if w.role == "decode"), key=lambda w: w.running)
            assert busy.running > 0 and min(progress) < NUM_TOKENS, "streams ended before the kill"
            os.kill(sp.children[busy.worker_id], signal.SIGKILL)
            return list(await asyncio.gather(*tasks)), busy.worker_id

    outs, victim = asyncio.run(run())
    assert not pid_alive(sp.children[victim])
    failed_over = [o for o in outs if o.metrics.failovers]
    assert failed_over, "no stream was on the killed worker"
    for i, (o, ref) in enumerate(zip(outs, expected)):
        assert o.finish_reason == "length" and o.token_ids == ref, (i, o.metrics, o.token_ids, ref)
        assert o.usage.prompt_tokens == len(prompts[i]) and o.usage.completion_tokens == NUM_TOKENS
    for o in failed_over:
        assert o.metrics.decode_worker != victim and o.metrics.failovers == 1

    with GenerationClient(sp.address, timeout_s=60) as c:
        def survivors_clean() -> bool:
            st = c.cluster_status()
            alive = [w for w in st.workers if w.worker_id != victim]
            return all(w.pages_free == w.pages_total for w in alive if w.role == "decode") and \
                all(w.info.get("pages_owned_by_requests") == "0" for w in alive if w.role == "prefill")
        wait_until(survivors_clean, timeout_s=20, what="pages back on the surviving workers")
        # the cluster keeps serving on the survivors
        again = c.generate(token_ids=prompts[0], max_tokens=8, ignore_eos=True)
        assert again.token_ids == expected[0][:8]
