"""``pdserve`` refuses what it can check before spawning anything: one line ``pdserve: error: ...``, exit
code 2, no process and no run directory. And the flag rules every subcommand follows (issue 32)."""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from cli import vocab
from cli.main import build_parser
from engine.checkpoint import TINY_GLM5, init_random_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_model(TINY_GLM5, str(tmp_path_factory.mktemp("cli") / "model"))


def pdserve(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path)} if tmp_path is not None else None
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False, env=env)


def refused(out: subprocess.CompletedProcess, line: str) -> None:
    """Exit code 2, exactly ``line`` on stderr and nothing else there, nothing started."""
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert "starting" not in out.stdout and "listening" not in out.stdout


def serve_refused(tmp_path, line: str, *args: str) -> None:
    run = tmp_path / "run"
    refused(pdserve("serve", "--port", "0", "--http-port", "0", "--run-dir", str(run), *args, tmp_path=tmp_path), line)
    assert not run.exists(), "nothing was started, so no run directory"
    assert not [n for n in os.listdir(tmp_path) if n.startswith("pdserve-run-")]


def test_model_directory_config_and_hub_id(tmp_path):
    serve_refused(tmp_path, "pdserve: error: --model /nonexistent: no such directory", "--model", "/nonexistent")
    serve_refused(tmp_path, "pdserve: error: --model zai-org/GLM-4.5-Air: no such directory (a Hugging Face Hub id? "
                  "pdserve serves local checkpoints: `huggingface-cli download zai-org/GLM-4.5-Air --local-dir DIR`, "
                  "then --model DIR)", "--model", "zai-org/GLM-4.5-Air")
    empty = tmp_path / "empty"
    empty.mkdir()
    serve_refused(tmp_path, f"pdserve: error: --model {empty}: no config.json (not a Hugging Face checkpoint "
                  "directory)", "--model", str(empty))


def test_architecture_and_checkpoint_headers(model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    serve_refused(tmp_path, f"pdserve: error: {d}/config.json: unsupported model_type 'llama'; supported: "
                  "('glm_moe_dsa', 'glm4_moe') (architectures: LlamaForCausalLM)", "--model", str(d))
    (d / "config.json").write_text(json.dumps(cfg))
    st = d / "model.safetensors"
    size = st.stat().st_size
    with open(st, "r+b") as f:
        f.truncate(size - 1000)
    serve_refused(tmp_path, f"pdserve: error: {st}: truncated: its header describes {size} bytes, the file has "
                  f"{size - 1000}", "--model", str(d))


def test_flags_ports_and_memory(model, tmp_path):
    serve_refused(tmp_path, "pdserve: error: --speculative banana: speculative config must look like "
                  "'steps/topk/draft_tokens' (e.g. '3/1/4'), got 'banana'", "--model", model, "--speculative", "banana")
    serve_refused(tmp_path, "pdserve: error: unrecognized arguments: --dec 2", "--model", model, "--dec", "2")
    serve_refused(tmp_path, "pdserve: error: give at most one of --num-pages, --mem-fraction", "--model", model,
                  "--num-pages", "64", "--mem-fraction", "0.5")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = tmp_path / "run"
        out = pdserve("serve", "--model", model, "--port", str(port), "--http-port", "0", "--run-dir", str(run))
        refused(out, f"pdserve: error: --port {port}: cannot listen on 127.0.0.1:{port}: in use by another process")
        assert not run.exists()
    run = tmp_path / "run"
    out = pdserve("serve", "--model", model, "--port", "0", "--http-port", "0", "--run-dir", str(run),
                  "--num-pages", "100000000")
    assert out.returncode == 2 and not run.exists()
    line, = out.stderr.strip().splitlines()
    assert line.startswith("pdserve: error: KV pool of 100000000 pages (") and "does not fit:" in line


def test_run_needs_a_tokenizer_for_text_and_takes_v_after_the_subcommand(model, tmp_path):
    refused(pdserve("run", "-v", "--model", model, "--prompt", "hello", tmp_path=tmp_path),
            f"pdserve: error: --model {model}: no tokenizer.json, so text prompts cannot be encoded (give token ids)")
    refused(pdserve("run", "--model", model, "--token-ids", "1,2", "--tp", "0", tmp_path=tmp_path),
            "pdserve: error: --tp must be >= 1, got 0")


def test_launch_checks_before_contacting_ray(model, tmp_path):
    refused(pdserve("launch", "--address", "127.0.0.1:1", "--model", "/nonexistent", tmp_path=tmp_path),
            "pdserve: error: --model /nonexistent: no such directory")
    refused(pdserve("launch", "--address", "127.0.0.1:1", "--model", model, "--speculative", "5/1", tmp_path=tmp_path),
            "pdserve: error: --speculative 5/1: speculative config must look like 'steps/topk/draft_tokens' "
            "(e.g. '3/1/4'), got '5/1'")


def test_version_help_defaults_and_no_abbreviations():
    out = pdserve("--version")
    assert out.returncode == 0 and out.stdout.startswith("pdserve ")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        assert sp.allow_abbrev is False and sp.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
        for action in sp._actions:
            if action.option_strings:
                assert action.help, f"pdserve {name} {action.option_strings[-1]} has no help"
        text = sp.format_help()  # '%' in a help string would raise here
        assert "(default:" in text, name
    assert "--grace-s GRACE_S" in sub.choices["serve"].format_help()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    args = parser.parse_args(vocab.config_argv(argv, sub))
    vocab.resolve_vocabulary(args, args.cmd)
    return args


def test_one_vocabulary_and_the_config_file(tmp_path):
    a = parse(["serve", "--kv-cache-dtype", "bfloat16", "--speculative-num-steps", "3",
               "--speculative-num-draft-tokens", "4", "--compile-decode", "--stall-after-s", "9", "--threads", "2",
               "--log-dir", "/x", "--max-inflight", "7", "--request-timeout-s", "30"])
    assert (a.kv_dtype, a.speculative, a.compile_decode, a.stall_after_s, a.threads_per_worker, a.run_dir) == \
        ("bfloat16", "3/1/4", True, 9.0, 2, "/x")
    assert (a.max_inflight, a.request_timeout_s) == (7, 30.0)
    b = parse(["launch", "--tp", "2", "--compile", "--stall-after", "9", "--threads-per-worker", "3",
               "--run-dir", "/y", "--no-speculative", "--speculative-eagle-topk", "1"])
    assert (b.prefill_tp, b.decode_tp, b.compile_decode, b.stall_after_s, b.threads_per_worker, b.log_dir) == \
        (2, 2, True, 9.0, 3, "/y")
    assert b.speculative == "5/1/6"  # a speculative part turns it back on over the default
    assert parse(["launch", "--no-speculative"]).speculative == "off"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("prefill: 2\ndecode-weights: model\nno_shm: true\ncompile: false\nport: 6000\n")
    c = parse(["serve", "--config", str(cfg), "--port", "7000"])
    assert (c.prefill, c.decode_weights, c.no_shm, c.compile_decode, c.port) == (2, "model", True, False, 7000)
    cfg.write_text("prefil: 2\n")
    with pytest.raises(ValueError, match=r"unknown key 'prefil' \(not a flag of pdserve serve\)"):
        parse(["serve", "--config", str(cfg)])
    out = pdserve("serve", "--config", str(cfg))
    refused(out, f"pdserve: error: --config {cfg}: unknown key 'prefil' (not a flag of pdserve serve)")


def test_serve_tp_and_dp_flags_reach_the_worker_command_lines(tmp_path):
    """TP4 x DP2 is ``--decode-tp 4 --decode 2``, and ``--dp K`` sets both roles' worker counts; a worker's
    ranks get the cores' share of one rank each."""
    from cli.serve import serve_config
    from cluster.local import LocalCluster

    args = parse(["serve", "--dp", "2", "--decode-tp", "4", "--moe-parallel", "ep", "--run-dir", str(tmp_path)])
    cfg = serve_config(args)
    assert (cfg.prefill, cfg.decode, cfg.prefill_tp, cfg.decode_tp, cfg.moe_parallel) == (2, 2, 1, 4, "ep")
    cluster = LocalCluster(cfg)
    dec, pre = cluster._worker_cmd("decode", 0), cluster._worker_cmd("prefill", 0)
    assert dec[dec.index("--tp") + 1] == "4" and dec[dec.index("--moe-parallel") + 1] == "ep"
    assert "--tp" not in pre
    t = parse(["serve", "--tp", "2"])
    assert (t.prefill_tp, t.decode_tp) == (2, 2)
    la = parse(["launch", "--dp", "2", "--decode-tp", "4", "--moe-parallel", "ep"])
    assert (la.prefill, la.decode, la.prefill_tp, la.decode_tp, la.moe_parallel) == (2, 2, 1, 4, "ep")
