"""A served run on the fused MX path: ``pdserve serve`` (router + 1 prefill + 1 decode worker processes, decode
weights MXFP4, the default) on the shipped default model; after real requests the decode worker's status (over
gRPC, through the router) shows the fused strategies ran and that its routed experts hold exactly their MX bytes:
no dequantized copy of any layer."""
import os

import pytest
from serve_helpers import ServeProcess, pages_all_free
from shared_helpers import wait_until

from engine.defaults import SHIPPED_DEFAULT
from engine.moe import mx_cpu_kernel
from router.client import GenerationClient

pytestmark = [pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")),
                                 reason="no default model"),
              pytest.mark.skipif(not mx_cpu_kernel.available(), reason="no C++ compiler: the torch path runs")]


def test_served_fused_decode_holds_only_mx_expert_bytes(tmp_path):
    sp = ServeProcess(["--port", "0", "--prefill", "1", "--decode", "1", "--decode-weights", "mxfp4",
                       "--no-speculative", "--num-pages", "64", "--run-dir", str(tmp_path / "run")],
                      str(tmp_path / "serve.out"))
    try:
        sp.wait_listening()
        with GenerationClient(sp.address, timeout_s=120) as c:
            for prompt in ("def add(a, b):\n", "import os\n\nclass Config:\n    def __init__(self, name):\n"):
                out = c.generate(prompt=prompt, max_tokens=16, ignore_eos=True)
                assert out.finish_reason == "length" and len(out.token_ids) == 16
            dec = next(w for w in c.cluster_status().workers if w.role == "decode")
            assert dec.info["routed_experts"] == "mxfp4"
            assert set(dec.info["moe_impls"].split(",")) <= {"fused_gemv", "fused_gather", "fused_sorted"} and dec.info["moe_impls"]
            mx_bytes = int(dec.info["routed_expert_mx_bytes"])
            assert mx_bytes > 0 and int(dec.info["routed_expert_bytes"]) == mx_bytes
            wait_until(lambda: pages_all_free(c), 30, "every page back")
    finally:
        assert sp.stop() == 0
