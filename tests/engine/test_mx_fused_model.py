"""The fused MX path on the default model: greedy output equals the dequantized path, and a served run holds no
dense expert copy (resident routed-expert bytes == MX bytes, read from the decode worker's status over gRPC)."""
import json
import os
import subprocess
import sys

import pytest

from engine.defaults import SHIPPED_DEFAULT
from engine.moe import mx_cpu_kernel
from engine.quant.prepare import expert_memory, quantized_experts
from engine.load import load_model
from engine.offline import Engine
from engine.sampling import SamplingParams

MXFP4_DEFAULT = SHIPPED_DEFAULT + "-mxfp4"
PDSERVE = os.path.join(os.path.dirname(sys.executable), "pdserve")
PROMPT = [5, 77, 301, 12, 9, 640, 33, 1024, 7, 88, 19, 250, 3, 41, 600, 18, 90]  # 17 tokens: prefill > 16 pairs

pytestmark = [pytest.mark.skipif(not os.path.exists(os.path.join(MXFP4_DEFAULT, "config.json")),
                                 reason="no quantized default model"),
              pytest.mark.skipif(not mx_cpu_kernel.available(), reason="no C++ compiler: the torch path runs")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_through_fused_equals_dequantized(dtype):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs, ran = {}, {}
    for impl in ("mx_gather", "auto"):  # dequantize per step vs the fused kernels auto picks
        model, cfg = load_model(MXFP4_DEFAULT, dtype, "cpu", impl)
        outs[impl] = Engine(model, cfg).generate([PROMPT], params)[0].token_ids
        ran[impl] = {m.last_impl for m in quantized_experts(model).values() if m.last_impl}
        mem = expert_memory(model)
        if impl == "auto":
            assert mem.cache_bytes == 0 and mem.dense_bytes == 0 and mem.resident_bytes == mem.mx_bytes
    assert ran["mx_gather"] == {"mx_gather"} and ran["auto"] <= {"fused_gemv", "fused_gather", "fused_sorted"} and ran["auto"]
    assert outs["auto"] == outs["mx_gather"] and len(outs["auto"]) == 24


def test_run_decode_weights_reports_fused_and_mx_bytes_only():
    base = [PDSERVE, "run", "--model", SHIPPED_DEFAULT, "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens",
            "8", "--ignore-eos", "--no-speculative", "--dtype", "float32", "--json"]
    got = {}
    for weights in ("model", "mxfp4"):
        out = subprocess.run(base + ["--decode-weights", weights], capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        got[weights] = json.loads(out.stdout)
    dense, mx = got["model"], got["mxfp4"]
    assert dense["moe_impls"] == "" and int(dense["routed_expert_mx_bytes"]) == 0
    assert set(mx["moe_impls"].split(",")) <= {"fused_gemv", "fused_gather", "fused_sorted"}
    assert mx["routed_expert_bytes"] == mx["routed_expert_mx_bytes"]  # no dense copy of any expert
    # MXFP4: 4.25 bits a weight against fp32's 32
    assert int(mx["routed_expert_bytes"]) * 32 == int(dense["routed_expert_bytes"]) * 4.25
