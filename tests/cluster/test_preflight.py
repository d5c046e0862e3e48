"""cluster.preflight: each check's one line, made before anything is spawned; the MX fallback for expert
dims that are not multiples of 32; a clean stop removes a temporary run directory."""
import json
import logging
import os
import shutil
import socket

import pytest

from cluster import preflight
from cluster.weights import mx_unfit, resolve_decode_weights
from cluster.preflight import PreflightError
from engine.checkpoint import TINY_GLM5, init_random_model
from engine.config import ModelConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_model(TINY_GLM5, str(tmp_path_factory.mktemp("pf") / "model"))


def copy_model(model, tmp_path) -> str:
    d = str(tmp_path / "copy")
    shutil.copytree(model, d)
    return d


def error(fn, *args, **kw) -> str:
    with pytest.raises(PreflightError) as e:
        fn(*args, **kw)
    return str(e.value)


def test_model_directory_config_architecture_and_checkpoint(model, tmp_path):
    assert error(preflight.check_model, "/nonexistent") == "--model /nonexistent: no such directory"
    assert error(preflight.check_model, "zai-org/GLM-4.5-Air") == (
        "--model zai-org/GLM-4.5-Air: no such directory (a Hugging Face Hub id? pdserve serves local checkpoints: "
        "`huggingface-cli download zai-org/GLM-4.5-Air --local-dir DIR`, then --model DIR)")
    assert error(preflight.check_model, str(tmp_path)) == \
        f"--model {tmp_path}: no config.json (not a Hugging Face checkpoint directory)"
    d = copy_model(model, tmp_path)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**raw, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}, f)
    assert error(preflight.check_model, d) == (
        f"{cfg_path}: unsupported model_type 'llama'; supported: ('glm_moe_dsa', 'glm4_moe') "
        "(architectures: LlamaForCausalLM)")
    with open(cfg_path, "w") as f:
        f.write("{not json")
    assert error(preflight.check_model, d).startswith(f"{cfg_path}: not valid JSON (")
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    st = os.path.join(d, "model.safetensors")
    size = os.path.getsize(st)
    with open(st, "r+b") as f:
        f.truncate(size - 100)
    assert error(preflight.check_model, d) == \
        f"{st}: truncated: its header describes {size} bytes, the file has {size - 100}"
    ok = preflight.check_model(model)
    assert ok.cfg.model_type == "glm_moe_dsa" and ok.tensors
    assert error(preflight.check_model, model, need_text=True) == \
        f"--model {model}: no tokenizer.json, so text prompts cannot be encoded (give token ids)"


def test_flags_ports_and_memory(model):
    assert error(preflight.check_speculative, "banana") == (
        "--speculative banana: speculative config must look like 'steps/topk/draft_tokens' (e.g. '3/1/4'), got "
        "'banana'")
    preflight.check_speculative("off")
    preflight.check_speculative("3/1/4")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert error(preflight.check_port_free, "127.0.0.1", port, "--port") == \
            f"--port {port}: cannot listen on 127.0.0.1:{port}: in use by another process"
    preflight.check_port_free("127.0.0.1", port, "--port")  # free again
    roles = [("prefill", model), ("decode", model)]
    msg = error(preflight.check_memory, roles, "auto", None, 16, 100_000_000, None, None)
    assert msg.startswith("KV pool of 100000000 pages (") and "does not fit:" in msg
    needs = preflight.check_memory(roles, "auto", None, 16, 64, None, None)
    assert [n.plan.pool.num_pages for n in needs] == [64, 64]
    assert error(preflight.check_memory, roles, "auto", None, 16, 64, "1GiB", None) == \
        "give at most one of --num-pages, --kv-cache-memory"


def test_expert_dims_off_the_mx_block_fall_back_to_the_model_weights_with_one_warning(tmp_path, caplog):
    d = init_random_model({**TINY_GLM5, "moe_intermediate_size": 40}, str(tmp_path / "m40"))
    assert mx_unfit(ModelConfig.from_model_dir(d)) == "moe_intermediate_size 40 not a multiple of the MX block size 32"
    with caplog.at_level(logging.WARNING):
        assert resolve_decode_weights(d, "mxfp4") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expect = (f"decode weights: {d} cannot be quantized to mxfp4 (moe_intermediate_size 40 not a multiple of the "
              "MX block size 32): decode workers run the model's own weights (--decode-weights model)")
    assert warnings == [expect]
    assert mx_unfit(ModelConfig.from_dict(TINY_GLM5)) == ""
