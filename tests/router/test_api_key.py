"""Issue 25: the API key was only accepted in argv, where every user of the machine sees it (``ps``). It now
comes from ``--api-key-file`` or ``$PDSERVE_API_KEY`` (``--api-key`` still works, with a warning)."""
import asyncio
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from protos import rpc
from common.env import API_KEY
from router.client import GenerationClient

KEY = "router-key-0123456789"


def test_key_sources_and_their_precedence(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(API_KEY, "from-env")
    path = tmp_path / "key"
    path.write_text("  from-file\n")
    path.chmod(0o600)
    assert rpc.api_key() == "from-env"
    with caplog.at_level(logging.WARNING, logger="protos.rpc"):
        assert rpc.api_key(path=str(path)) == "from-file" and not caplog.records
        assert rpc.api_key("from-flag") == "from-flag"
        assert "visible to every user" in caplog.text
        path.chmod(0o644)
        caplog.clear()
        assert rpc.api_key(path=str(path)) == "from-file" and "chmod 600" in caplog.text
    with pytest.raises(ValueError, match="not both"):
        rpc.api_key("from-flag", str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        rpc.api_key(path=str(path))
    with pytest.raises(OSError):
        rpc.api_key(path=str(tmp_path / "missing"))
    monkeypatch.delenv(API_KEY)
    assert rpc.api_key() is None


@pytest.mark.parametrize("source", ["env", "file"])
def test_router_process_takes_its_key_from_the_environment_or_a_file(source, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY}
    args = ["--port", "0", "--http-port", "-1", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9",
            "--startup-timeout-s", "0.5", "--health-timeout-s", "0.5"]
    if source == "env":
        env[API_KEY] = KEY
    else:
        (tmp_path / "key").write_text(KEY + "\n")
        (tmp_path / "key").chmod(0o600)
        args += ["--api-key-file", str(tmp_path / "key")]
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen([sys.executable, "-m", "router", *args], stdout=log, stderr=subprocess.STDOUT,
                                  env=env)
    try:
        address = ready_address(router, log_path)
        with open(f"/proc/{router.pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
        for key, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
                          (KEY, grpc.StatusCode.OK)):
            with GenerationClient(address, api_key=key) as c:
                try:
                    c.cluster_status()
                    got = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    got = e.code()
            assert got == code, (key, got)
        http = ready_line(log_path).split()[4]  # "PDSERVE_READY router HOST:PORT http HOST:PORT": the same key
        for key, status in ((None, 401), ("wrong", 401), (KEY, 200)):
            req = urllib.request.Request(f"http://{http}/v1/models",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    got_status = r.status
            except urllib.error.HTTPError as e:
                got_status = e.code
            assert got_status == status, (key, got_status)
    finally:
        router.terminate()
        router.wait(30)
    assert "visible to every user" not in log_path.read_text()


def ready_line(log_path) -> str:
    return next(line for line in log_path.read_text().splitlines() if line.startswith("PDSERVE_READY router "))


def ready_address(proc: subprocess.Popen, log_path, timeout_s: float = 60.0) -> str:
    """The address of a ``python -m router`` from its ``PDSERVE_READY router HOST:PORT`` line (it serves
    without healthy workers: their addresses here refuse connections)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("PDSERVE_READY router "):
                return line.split()[2]
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"router not ready: {log_path.read_text()[-2000:]}")


def test_router_process_refuses_an_unreadable_key_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "router", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9",
                          "--api-key-file", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "missing" in out.stderr


@pytest.mark.parametrize("response_streaming", [False, True])
def test_an_unauthenticated_call_is_refused_before_its_request_is_read(response_streaming):
    """Issue 25: 20 unauthenticated 60 MiB messages took the router to 2.9 GB: the request was read whole
    (and deserialized) before the interceptor's refusal ran. Now the refusal never reads it."""
    async def go():
        parsed = []

        def deserialize(raw: bytes) -> bytes:
            parsed.append(len(raw))
            return raw

        async def unary(request, context):
            return b"ok"

        async def stream(request, context):
            yield b"ok"
        kind = grpc.unary_stream_rpc_method_handler if response_streaming else grpc.unary_unary_rpc_method_handler
        handler = kind(stream if response_streaming else unary, request_deserializer=deserialize,
                       response_serializer=lambda b: b)
        server = rpc.make_server(KEY, "API key")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                method = ch.unary_stream if response_streaming else ch.unary_unary
                call = method("/t.S/M", request_serializer=lambda b: b, response_deserializer=lambda b: b)

                async def result(metadata):
                    try:
                        out = [r async for r in call(b"x" * 100_000, metadata=metadata, timeout=10)] \
                            if response_streaming else await call(b"x" * 100_000, metadata=metadata, timeout=10)
                        return grpc.StatusCode.OK, out
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                code, msg = await result(rpc.auth_metadata("wrong"))
                assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in msg
                assert parsed == []  # never read
                code, out = await result(rpc.auth_metadata(KEY))
                assert code == grpc.StatusCode.OK and parsed == [100_000]
        finally:
            await server.stop(0)
    asyncio.run(asyncio.wait_for(go(), 30))
