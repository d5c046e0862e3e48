"""common/: the one loopback check, the one bind refusal, the one place the environment is read."""
import os

import pytest

from common import env
from common.net import check_bind, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "10.0.0.1", "[fe80::1]", "example.com", "localhost.evil"])
def test_reachable_addresses(host):
    """The empty host binds every interface and a hostname may resolve anywhere: neither is private (the
    gRPC check used to call "" loopback, the KV-transfer one did not)."""
    assert not is_loopback(host)


def test_check_bind_refuses_an_open_unauthenticated_service():
    check_bind("127.0.0.1", None, "router")
    check_bind("0.0.0.0", "a-secret-of-enough-length", "router")
    with pytest.raises(ValueError, match=f"router would listen on every interface without a secret: set {env.CLUSTER_SECRET}"):
        check_bind("", None, "router")
    with pytest.raises(ValueError, match="10.0.0.1"):
        check_bind("10.0.0.1", b"", "decode worker")


def test_env_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv(env.CLUSTER_SECRET, "")
    assert env.cluster_secret() is None
    monkeypatch.setenv(env.CLUSTER_SECRET, "s3cret")
    assert env.cluster_secret() == "s3cret"
    monkeypatch.delenv(env.API_KEY, raising=False)
    assert env.api_key() is None
    monkeypatch.setenv(env.GC_FREEZE, "0")
    assert not env.gc_freeze()
    monkeypatch.setenv(env.TUNE_MALLOC, "1")
    assert env.tune_malloc()
    monkeypatch.setenv(env.HOME, "/tmp/pdserve-home")
    assert env.pdserve_home() == "/tmp/pdserve-home"


def test_only_common_env_reads_pdserve_variables():
    """Every ``PDSERVE_*`` read goes through common.env (launchers may still write them for children)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bad = []
    for pkg in ("common", "protos", "engine", "worker", "kvtransfer", "prefill", "decode", "router", "cluster",
                "bench", "cli"):
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                path = os.path.join(dirpath, f)
                if not f.endswith(".py") or path.endswith(os.path.join("common", "env.py")):
                    continue
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if ("environ.get(" in line or "getenv(" in line) and "PDSERVE_" in line:
                        bad.append(f"{os.path.relpath(path, root)}:{n}")
    assert not bad
