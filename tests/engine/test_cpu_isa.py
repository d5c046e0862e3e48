"""The ISA level our CPU kernels build for and dispatch on (``engine.cpu_ext``): detected from the CPU's flags,
forced lower with ``$PDSERVE_CPU_ISA`` (a bad or too high value is a ValueError naming both), part of the build
name and flags; and the start-up line naming each hot op's path (``engine.kernels``), in this process and in one
forced to avx2 (which also checks the decode kernel's scalar build against torch there)."""
import logging
import os
import re
import subprocess
import sys

import pytest

from common import env
from engine import cpu_ext, kernels
from engine.layers import cpu_attention, cpu_gemv

AVX2 = frozenset({"avx2", "fma", "f16c", "bmi2", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"kernels: prefill_attention=(\w+), moe=(\w+), mx=(\w+), decode_attention=(\w+), gemv=(\w+) "
                  r"\(isa (\w+), cpu (\w+)\)")


def test_host_level_from_flags():
    assert cpu_ext.host_isa(frozenset({"sse2", "avx"})) == cpu_ext.GENERIC
    assert cpu_ext.host_isa(AVX2) == "avx2"
    assert cpu_ext.host_isa(AVX512) == "avx512"
    assert cpu_ext.host_isa(AVX512 | {"avx512_bf16"}) == "avx512_bf16"
    assert cpu_ext.host_isa(AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}) == "amx"
    assert cpu_ext.host_isa(AVX2 | {"amx_tile", "amx_bf16"}) == "avx2"  # a level needs every level below it
    assert cpu_ext.levels_up_to("avx512") == ["avx2", "avx512"] and cpu_ext.levels_up_to(cpu_ext.GENERIC) == []


def test_forced_level_is_checked(monkeypatch):
    assert cpu_ext.resolve_isa(None, "avx512_bf16") == "avx512_bf16"
    assert cpu_ext.resolve_isa("avx2", "amx") == "avx2"
    with pytest.raises(ValueError, match=r"PDSERVE_CPU_ISA='sse9'.*avx2, avx512, avx512_bf16, amx"):
        cpu_ext.resolve_isa("sse9", "amx")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA=amx is above this CPU's level avx512_bf16"):
        cpu_ext.resolve_isa("amx", "avx512_bf16")
    with pytest.raises(ValueError, match="above this CPU's level generic"):
        cpu_ext.resolve_isa("avx2", cpu_ext.GENERIC)
    monkeypatch.setenv(env.CPU_ISA, " AVX2 ")
    assert env.cpu_isa() == "avx2"
    monkeypatch.setenv(env.CPU_ISA, "")
    assert env.cpu_isa() is None


def test_level_decides_flags_and_build_name():
    assert "-march=x86-64-v3" in cpu_ext.cflags("avx2") and "-march=native" not in cpu_ext.cflags("avx2")
    assert "-mno-avx512bf16" in cpu_ext.cflags("avx512") and "-mno-amx-tile" in cpu_ext.cflags("avx512_bf16")
    assert cpu_ext.cflags("amx") == ["-O3", "-march=native", "-std=c++17", "-fopenmp"]
    names = {cpu_ext.build_name("k", cpu_attention.SOURCE, lv) for lv in cpu_ext.ISA_LEVELS}
    assert len(names) == len(cpu_ext.ISA_LEVELS)


@pytest.mark.skipif(cpu_ext.host_isa() == "amx", reason="every level fits an AMX CPU")
def test_building_above_the_cpu_is_refused():
    with pytest.raises(ValueError, match="above this CPU's level"):
        cpu_ext.build("pdserve_never", cpu_attention.SOURCE, "nothing", "amx")


def test_report_line_names_each_path(caplog):
    line = kernels.kernel_report()
    m = LINE.fullmatch(line)
    assert m, line
    attention, moe, mx, decode, gemv, level, host = m.groups()
    assert (level, host) == (cpu_ext.isa(), cpu_ext.host_isa())
    assert attention == cpu_attention.path() and decode == cpu_attention.decode_path()
    assert mx in ("avx512", "avx2", "scalar", "torch") and moe in (*cpu_ext.ISA_LEVELS, "torch")
    assert gemv in ("off", "avx512_bf16", "avx512", "avx2", "scalar", "torch")
    kernels.log_kernel_report.cache_clear()
    with caplog.at_level(logging.INFO, logger="engine.kernels"):
        kernels.log_kernel_report()
        kernels.log_kernel_report()
    assert [r.getMessage() for r in caplog.records if r.name == "engine.kernels"] == [line]  # once per process


FORCED_AVX2 = """
import torch
from engine.kernels import kernel_report
from engine.layers import cpu_attention, cpu_gemv
print(kernel_report())
torch.manual_seed(0)
q, k, v = torch.randn(2, 3, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32)
slots = torch.stack([torch.arange(20), torch.arange(20, 40)])
got = cpu_attention.paged_attention(q, k, v, slots, None, 0.2)
want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k[slots].transpose(1, 2),
                                                        v[slots].transpose(1, 2), scale=0.2, enable_gqa=True)
torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
print("decode ok")
"""


def run_forced(level: str, code: str) -> subprocess.CompletedProcess:
    environ = env.child_environ(PYTHONPATH=ROOT, **{env.CPU_ISA: level})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif("avx2" not in cpu_ext.levels_up_to(cpu_ext.host_isa()), reason="not an x86-64-v3 CPU")
def test_a_process_forced_to_avx2_builds_and_reports_avx2():
    """A whole process at avx2 (on an AVX-512 host: no AVX-512 instruction in any kernel): the report line says so
    and the decode kernel (its scalar branch there) still equals torch."""
    done = run_forced("avx2", FORCED_AVX2)
    assert done.returncode == 0, done.stderr[-3000:]
    m = LINE.search(done.stdout)
    assert m, done.stdout
    attention, moe, mx, decode, gemv, level, host = m.groups()
    assert (level, host) == ("avx2", cpu_ext.host_isa())
    assert attention in ("avx2", "torch") and moe in ("avx2", "torch") and mx == "avx2" and decode == "scalar"
    assert "decode ok" in done.stdout


def test_a_bad_level_fails_the_process_clearly():
    done = run_forced("avx9000", "from engine import cpu_ext; cpu_ext.isa()")
    assert done.returncode != 0 and "ValueError: PDSERVE_CPU_ISA='avx9000' is not an ISA level" in done.stderr


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_for():
    """A build killed mid-way (a timeout, SIGKILL) leaves torch's baton file in the build directory, and every later
    load of that kernel waited for it forever (seen: a test's ``pdserve run`` killed while building the GEMV hung
    every later build in its PDSERVE_HOME). The build takes its directory's flock, finds the baton nobody holds,
    removes it with one WARNING and loads."""
    level = cpu_ext.isa()
    build_dir = os.path.join(env.pdserve_home(), "torch_extensions",
                             cpu_ext.build_name("pdserve_gemv", cpu_gemv.SOURCE, level))
    os.makedirs(build_dir, exist_ok=True)
    baton = os.path.join(build_dir, cpu_ext.TORCH_BATON)
    with open(baton, "w"):
        pass
    code = "from engine.layers import cpu_gemv; assert cpu_gemv.kernel() is not None; print('built ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env.child_environ(PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "built ok" in done.stdout, done.stderr[-3000:]
    assert "removing the build lock a killed build left behind" in done.stderr
    assert not os.path.exists(baton)
