"""``pdserve serve --tls-cert/--tls-key/--tls-ca``: the public gRPC and HTTP ports speak TLS to real TLS
clients, the workers' gRPC ports require a client certificate signed by the CA (mutual TLS), and plaintext
is refused on every one of them. The certificates are made here with the openssl command."""
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from serve_helpers import ServeProcess

from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.client import GenerationClient

SECRET = "tls-test-secret-0123456789abcdef"


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, and a certificate it signed for 127.0.0.1 / localhost (servers and the router's client side)."""
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=pdserve test CA", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost", cwd=d)
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    return {k: str(d / f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_tls_on_the_public_ports_and_mutual_tls_on_the_worker_plane(tiny_dirs, certs, tmp_path):
    sp = ServeProcess(["--model", tiny_dirs["dsa"], "--port", "0", "--http-port", "-1", "--dtype", "float32",
                       "--decode-weights", "model", "--no-speculative", "--num-pages", "256",
                       "--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"],
                       "--run-dir", str(tmp_path / "run")], str(tmp_path / "serve.out"),
                      env={"PDSERVE_CLUSTER_SECRET": SECRET})
    try:
        sp.wait_listening()
        assert sp.http_url.startswith("https://")
        # gRPC over TLS: a real TLS client generates; a plaintext one gets no answer
        with GenerationClient(sp.address, timeout_s=60, tls_ca=certs["ca"]) as client:
            out = client.generate(token_ids=[3, 5, 7], max_tokens=6, ignore_eos=True)
            assert out.finish_reason == "length" and len(out.token_ids) == 6
            workers = client.cluster_status().workers
        with GenerationClient(sp.address, timeout_s=5) as plain, pytest.raises(grpc.RpcError) as e:
            plain.generate(token_ids=[3, 5, 7], max_tokens=2)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        # HTTPS: a real TLS HTTP client verifying the chain; plain HTTP on the same port fails
        ctx = ssl.create_default_context(cafile=certs["ca"])
        body = json.dumps({"prompt": [3, 5, 7], "max_tokens": 4, "ignore_eos": True}).encode()
        req = urllib.request.Request(sp.http_url + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
            assert r.status == 200 and json.load(r)["choices"][0]["finish_reason"] == "length"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(sp.http_url.replace("https://", "http://") + "/models", timeout=5)
        # the worker plane: mutual TLS (a client certificate signed by the CA), plaintext refused
        md = (("authorization", f"Bearer {SECRET}"),)
        mutual = grpc.ssl_channel_credentials(read(certs["ca"]), read(certs["key"]), read(certs["cert"]))
        anonymous = grpc.ssl_channel_credentials(read(certs["ca"]))
        for w in workers:
            stub = worker_pb2_grpc.DecodeWorkerStub if w.role == "decode" else worker_pb2_grpc.PrefillWorkerStub
            with grpc.secure_channel(w.address, mutual) as ch:
                assert stub(ch).GetStatus(worker_pb2.StatusRequest(), metadata=md, timeout=10).healthy
            for ch in (grpc.secure_channel(w.address, anonymous), grpc.insecure_channel(w.address)):
                with ch, pytest.raises(grpc.RpcError) as e:
                    stub(ch).GetStatus(worker_pb2.StatusRequest(), metadata=md, timeout=5)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE, w.address
        assert not any(line.startswith("Traceback") for line in sp.output().splitlines())
    finally:
        assert sp.stop() == 0
    assert os.path.exists(tmp_path / "run" / "router.log")
