"""The agentic workload (``pdserve bench --workload agentic``) against the in-process fake of the public API
(tests/bench/fake_server.py): each turn's prompt is the previous one + the tokens the server returned + a new
user chunk, sessions are deterministic by seed, the report carries the session and per-tier figures, and a
failed or stuck turn ends its session without holding up the run."""
import asyncio
import json
import socket

import numpy as np
import pytest

from bench.loadgen.config import BenchConfig
from bench.loadgen.sweep import run_bench
from bench.loadgen.tiers import metrics_urls, parse_counts, scrape, tier_delta
from bench.loadgen.workload import make_workload
from cli.main import main as cli_main
from fake_server import FakeBehaviour, FakeServer, fake_token

pytestmark = pytest.mark.timeout(120)
VOCAB = 512
SYSTEM, USER, OUT, TURNS = 64, 16, 5, 3


def make_cfg(address="127.0.0.1:1", tmp_path=None, **kw) -> BenchConfig:
    base = dict(target=address, workload="agentic", sessions=4, turns=TURNS, system_len=SYSTEM, user_len=USER,
                output_len=OUT, concurrency=(2,), think_time_s=0.01, out=str(tmp_path / "out") if tmp_path else "x",
                quiet=True, drain_timeout_s=10.0, request_timeout_s=30.0)
    return BenchConfig(**{**base, **kw})


def prompts_by_turn(log, cfg):
    """{session: [prompt of turn 0, 1, ...]} of what the fake received."""
    out = {}
    for req_id, ids in log.prompts.items():
        i = int(req_id.rsplit("-", 1)[1])
        out.setdefault(i // cfg.turns, {})[i % cfg.turns] = ids
    return {s: [turns[t] for t in sorted(turns)] for s, turns in out.items()}


def test_turns_grow_by_returned_tokens_and_user_chunk_and_report_tiers(tmp_path):
    with FakeServer(FakeBehaviour(metrics=True, itl_s=0.001)) as srv:
        cfg = make_cfg(srv.address, tmp_path)
        result, text = run_bench(cfg, progress=False)
    wl = make_workload(cfg.with_defaults(), VOCAB)
    system = list(wl.first_prompt(0)[:SYSTEM])
    sessions = prompts_by_turn(srv.log, cfg)
    assert sorted(sessions) == [0, 1, 2, 3]
    for s, prompts in sessions.items():
        assert len(prompts) == TURNS
        assert prompts[0] == system + wl.user_chunk(s, 0).tolist()
        for t in range(1, TURNS):
            returned = [fake_token(s * TURNS + t - 1, j) for j in range(OUT)]
            assert prompts[t] == prompts[t - 1] + returned + wl.user_chunk(s, t).tolist()
    assert len({p[0][SYSTEM] for p in sessions.values()}) == 4  # sessions diverge right after the prefix
    step = result["steps"][0]
    a = step["agentic"]
    assert a["sessions_completed"] == 4 and a["sessions_failed"] == 0 and a["turns_ok"] == a["turns_sent"] == 12
    assert a["session_state_tokens"] == 4 * (SYSTEM + TURNS * USER + TURNS * OUT)
    assert [t["prompt_tokens_mean"] for t in a["per_turn"]] == [SYSTEM + USER + t * (USER + OUT) for t in range(3)]
    assert a["kv_bytes_per_turn"] > 0 and a["requests_per_s"] > 0 and a["tokens_per_s"] > a["requests_per_s"]
    assert step["num_measured"] == 12 and step["success_rate"] == 1.0 and step["ttft"]["p95"] > 0
    tiers = step["cache_tiers"]
    assert tiers["source"] == "metrics" and tiers["num_workers"] == 1 and "errors" not in tiers
    prompt = sum(len(p) for ps in sessions.values() for p in ps)
    assert tiers["query_tokens"] == prompt and tiers["hit_rate"]["host"] == 0.0
    assert tiers["hit_rate"]["device"] == pytest.approx(step["cache_hit"]) and step["cache_hit"] > 0.5
    assert "Sessions done" in text and "Hit by tier" in text and "4 sessions x 3 turns" in text
    assert "device " in text and "4/4 (0 failed)" in text
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["steps"][0]["agentic"] == json.loads(json.dumps(a)) and saved["config"]["workload"] == "agentic"


def test_sessions_are_deterministic_by_seed(tmp_path):
    cfg = make_cfg(concurrency=(1,)).with_defaults()
    a, b = make_workload(cfg, VOCAB), make_workload(cfg, VOCAB)
    other = make_workload(make_cfg(concurrency=(1,), seed=1).with_defaults(), VOCAB)
    assert a.session_order(0, 8) == b.session_order(0, 8) and sorted(a.session_order(8, 8)) == list(range(8, 16))
    assert a.session_order(0, 8) != other.session_order(0, 8)
    assert a.first_prompt(3) == b.first_prompt(3) != other.first_prompt(3)
    assert np.array_equal(a.user_chunk(2, 1), b.user_chunk(2, 1))
    seen = []
    for k in range(2):
        with FakeServer(FakeBehaviour(itl_s=0.0)) as srv:
            run_bench(make_cfg(srv.address, tmp_path / str(k), concurrency=(1,), think_time_s=0.0), progress=False)
        seen.append((list(srv.log.seen), dict(srv.log.prompts)))
    assert seen[0] == seen[1]
    order = a.session_order(0, 4)
    assert seen[0][0] == [f"bench-{s * TURNS + t}" for s in order for t in range(TURNS)]  # one session at a time


def test_a_failed_turn_ends_its_session(tmp_path):
    # request index = session x 3 + turn: 4 (session 1, turn 1) and 9 (session 3, turn 0) are refused, 6
    # (session 2, turn 0) ends with finish_reason error; session 0 completes
    with FakeServer(FakeBehaviour(fail_every=5, error_every=7, itl_s=0.001)) as srv:
        result, text = run_bench(make_cfg(srv.address, tmp_path), progress=False)
    assert sorted(srv.log.seen, key=lambda r: int(r.split("-")[1])) == [f"bench-{i}" for i in (0, 1, 2, 3, 4, 6, 9)]
    step = result["steps"][0]
    a = step["agentic"]
    assert (a["sessions_completed"], a["sessions_failed"], a["turns_sent"], a["turns_ok"]) == (1, 3, 7, 4)
    assert step["failures"] == {"RESOURCE_EXHAUSTED": 2, "finish:error": 1}
    assert "1/4 (3 failed)" in text and "RESOURCE_EXHAUSTED x2" in text
    assert step["cache_tiers"] == {"source": None, "note": "no prefill worker lists a metrics_port"}


def test_a_stuck_turn_is_cut_at_max_duration(tmp_path):
    with FakeServer(FakeBehaviour(itl_s=5.0)) as srv:
        result, _ = run_bench(make_cfg(srv.address, tmp_path, max_duration_s=1.5, output_len=3), progress=False)
    step = result["steps"][0]
    assert step["failures"] == {"DRAIN_TIMEOUT": 2} and step["agentic"]["sessions_failed"] == 2
    assert step["agentic"]["turns_sent"] == 2 and result["elapsed_s"] < 5.0


def test_config_and_flags():
    cfg = make_cfg().with_defaults()
    assert cfg.input_len == SYSTEM + TURNS * USER + (TURNS - 1) * OUT and cfg.warmup_s == 0.0
    assert make_cfg(concurrency=()).with_defaults().concurrency == (4,)  # every session in flight
    d = BenchConfig(workload="agentic").with_defaults()
    assert (d.system_len, d.user_len, d.output_len, d.sessions, d.turns) == (4096, 256, 64, 16, 4)
    for bad in (dict(rps=(1.0,), concurrency=()), dict(backend="openai", base_url="http://127.0.0.1:1/v1"),
                dict(text_prompts=True), dict(turns=0), dict(think_time_s=-1.0), dict(user_len=0)):
        with pytest.raises(ValueError):
            make_cfg(**bad)
    with pytest.raises(SystemExit):
        cli_main(["bench", "--workload", "agentic", "--sessions", "x"])


def test_parse_counts_without_a_host_tier():
    text = ('pdserve:prefix_cache_queries_total{worker="p"} 100\n'
            'pdserve:prefix_cache_hits_total{worker="p"} 40\n')
    assert parse_counts(text) == (100.0, {"device": 40.0})


def test_a_worker_that_does_not_answer_is_named_not_counted():
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = {"workers": [{"role": "prefill", "address": "127.0.0.1:1", "info": {"metrics_port": str(port)}},
                          {"role": "decode", "address": "127.0.0.1:2", "info": {"metrics_port": "9"}}]}
    urls = metrics_urls(server)
    assert urls == [f"http://127.0.0.1:{port}/metrics"]
    counts = asyncio.run(scrape(urls))
    assert counts.num_workers == 0 and counts.query_tokens == 0 and len(counts.errors) == 1
    delta = tier_delta(counts, counts)
    assert delta["hit_rate"] == {} and delta["errors"] == counts.errors * 2


def test_decode_reuse_figures_per_turn_and_on_vs_off(tmp_path, capsys):
    """The report's decode-side reuse figures: the prompt share its decode worker held, and what was shipped past
    a later turn's tail (the new user chunk + the last returned token): at most a page with reuse, the whole
    previous state without; ``--compare`` puts the two runs side by side (KV per request, decode resident)."""
    results = {}
    for reuse in (False, True):
        with FakeServer(FakeBehaviour(decode_reuse=reuse, itl_s=0.001)) as srv:
            results[reuse], text = run_bench(make_cfg(srv.address, tmp_path / str(reuse)), progress=False)
        assert "Decode resident" in text and "Shipped past tail" in text
    on, off = (results[r]["steps"][0]["agentic"] for r in (True, False))
    assert 0 < on["decode_resident"] < 1 and 0 <= on["beyond_tail_tokens_max"] < 16  # the fake's page
    assert on["per_turn"][0]["decode_resident_mean"] <= SYSTEM  # another session's system prompt, at most
    assert on["per_turn"][2]["decode_resident_mean"] > SYSTEM
    assert on["shipped_tokens_per_turn"] < SYSTEM + USER < off["shipped_tokens_per_turn"]
    assert off["decode_resident"] == 0 and off["beyond_tail_tokens_max"] == SYSTEM + 2 * USER + 2 * OUT - 1
    rc = cli_main(["bench", "--from-json", str(tmp_path / "True" / "out" / "bench.json"), "--compare",
                   str(tmp_path / "False" / "out" / "bench.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "KV MB/req" in text and "Decode resident" in text and "better" in text
