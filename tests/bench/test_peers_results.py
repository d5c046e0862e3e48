"""bench.peers.results: parsing the peers' outputs, medians, ratios and the rendered table (no peer needed)."""
from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from bench.peers.checkpoint import write_hf
from bench.peers.paths import default_cores, peer_paths
from bench.peers.results import (PeerTable, advantage, parse_batched_bench, parse_llama_bench, render_served,
                                 served_figures, tokens_label)


def test_llama_bench_json_keeps_prompt_rows_and_every_sample():
    rows = [{"n_prompt": 2048, "n_gen": 0, "avg_ts": 7000.0, "samples_ts": [6900.0, 7000.0, 7100.0]},
            {"n_prompt": 8192, "n_gen": 0, "avg_ts": 3000.0, "samples_ts": [3000.0, 2900.0, 3100.0]},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 3500.0, "samples_ts": [3500.0]}]
    assert parse_llama_bench(json.dumps(rows)) == {2048: [6900.0, 7000.0, 7100.0], 8192: [3000.0, 2900.0, 3100.0]}


def test_batched_bench_jsonl_among_log_lines():
    text = "\n".join([
        "llama_model_loader: loaded meta data",
        '{"n_kv_max": 6208, "pp": 64, "tg": 128, "pl": 1, "speed_pp": 900.0, "t_tg": 0.1, "speed_tg": 3507.5}',
        "main: n_kv_max = 6208",
        '{"n_kv_max": 6208, "pp": 64, "tg": 128, "pl": 32, "speed_pp": 900.0, "t_tg": 0.8, "speed_tg": 5042.0}',
        "llama_perf_context_print: load time = 10 ms"])
    assert parse_batched_bench(text) == {1: 3507.5, 32: 5042.0}


def make_table() -> PeerTable:
    t = PeerTable(["pdserve fp32", "pdserve bf16", "vLLM", "llama.cpp"], num_ours=2)
    t.add("decode bs1", "pdserve fp32", [180.0, 189.0, 200.0])
    t.add("decode bs1", "pdserve bf16", [208.0, 300.0, 100.0])
    t.add("decode bs1", "vLLM", [453.0, 450.0, 460.0])
    t.add("prefill 2k", "pdserve fp32", [12600.0])
    t.add("prefill 2k", "llama.cpp", [6300.0])
    return t


def test_median_best_ours_and_ratio():
    t = make_table()
    assert t.value("decode bs1", "pdserve bf16") == 208.0  # the median, not the best round
    assert t.best_ours("decode bs1") == ("pdserve bf16", 208.0)
    assert t.ratio("decode bs1", "vLLM") == 208.0 / 453.0
    assert t.ratio("prefill 2k", "llama.cpp") == 2.0
    assert t.ratio("decode bs1", "llama.cpp") is None  # the peer did not measure it
    assert t.value("decode bs8", "vLLM") is None


def test_render_has_values_ratios_and_dashes():
    lines = make_table().render(["decode bs1", "prefill 2k"]).splitlines()
    assert lines[0] == ("|  | pdserve fp32 | pdserve bf16 | vLLM | llama.cpp | best pdserve / vLLM | "
                        "best pdserve / llama.cpp |")
    assert lines[2] == "| decode bs1 | 189 | 208 | 453 | - | 0.46x | - |"
    assert lines[3] == "| prefill 2k | 12,600 | - | - | 6,300 | - | 2.00x |"


def test_json_round_trip_and_merge_fills_only_missing_cells():
    t = make_table()
    again = PeerTable.from_json(json.loads(json.dumps(t.to_json())))
    assert again.cells == t.cells and again.columns == t.columns
    fresh = PeerTable(t.columns, 2)
    fresh.add("decode bs1", "pdserve bf16", [500.0])
    assert fresh.merge_missing(again) == ["llama.cpp", "pdserve fp32", "vLLM"]
    assert fresh.value("decode bs1", "pdserve bf16") == 500.0  # this run's cell is kept
    assert fresh.value("decode bs1", "vLLM") == 453.0


def test_tokens_label_and_peers_dir(tmp_path):
    assert [tokens_label(n) for n in (2048, 8192, 500)] == ["2k", "8k", "500"]
    p = peer_paths({"PDSERVE_PEERS_DIR": str(tmp_path)})
    assert p.root == str(tmp_path) and not p.has_vllm() and not p.has_llama()
    assert p.vllm_python == str(tmp_path / "vllm" / "bin" / "python")
    assert peer_paths({}).root.endswith("/.peers")
    assert [default_cores(t) for t in (1, 2, 4)] == ["0", "0-1", "0-3"]


def test_peer_checkpoint_is_bf16_with_the_default_tokenizer(tmp_path):
    hf = write_hf(str(tmp_path))
    with safe_open(os.path.join(hf, "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "F32"  # the router stays fp32, as save_checkpoint keeps it
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["model_type"], cfg["hidden_size"], cfg["n_routed_experts"], cfg["torch_dtype"]) == \
        ("glm4_moe", 256, 16, "bfloat16")
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_served_figures_from_either_client_and_advantage_orientation():
    keys = {"request_throughput": 2.0, "output_throughput": 256.0, "median_ttft_ms": 40.0, "p99_ttft_ms": 90.0,
            "mean_tpot_ms": 7.5}
    assert served_figures({**keys, "completed": 10}) == keys  # vllm bench serve's result
    assert served_figures({"config": {}, "steps": [{**keys, "label": "c=8"}]}) == keys  # pdserve bench.json
    with pytest.raises(ValueError, match="one-step"):
        served_figures({"steps": [keys, keys]})
    assert advantage("output_throughput", 300.0, 150.0) == 2.0  # pdserve twice the throughput
    assert advantage("median_ttft_ms", 20.0, 40.0) == 2.0  # pdserve half the latency
    assert advantage("mean_tpot_ms", 10.0, 5.0) == 0.5


def test_render_served_puts_advantages_on_peer_lines_only():
    ours = {"request_throughput": 2.0, "output_throughput": 256.0, "median_ttft_ms": 40.0, "p99_ttft_ms": 90.0,
            "mean_tpot_ms": 8.0}
    vllm = {**ours, "output_throughput": 512.0, "median_ttft_ms": 20.0, "mean_tpot_ms": 4.0}
    lines = render_served({("pdserve bench", "concurrency 8"): {"pdserve": ours, "vLLM": vllm}}, "pdserve")
    lines = lines.splitlines()
    assert lines[2] == "| pdserve bench | concurrency 8 | pdserve | 2.00 | 256.0 | 40.0 | 90.0 | 8.0 | - | - | - |"
    assert lines[3] == ("| pdserve bench | concurrency 8 | vLLM | 2.00 | 512.0 | 20.0 | 90.0 | 4.0 | 0.50x | 0.50x "
                        "| 0.50x |")
