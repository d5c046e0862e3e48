"""Oversized-request attacks on a running router (issue 25): what each gets back, how long it takes, whether
the router's health check keeps answering meanwhile, and what they do to the router's memory and the
decode workers' pages.

    pdserve serve --port 50051 &                # note the router's pid it prints
    PDSERVE_API_KEY=KEY python -m bench.big_requests --target 127.0.0.1:50051 --router-pid PID

Attacks: a text prompt of ``--text-mib`` MiB; ``--stop-ids`` stop token ids; a 250-character request id
(repeated ``--long-ids`` times); ``--unauth`` concurrent unauthenticated messages of ``--unauth-mib`` MiB
(only meaningful when the router requires an API key). 0 skips an attack.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.flags import add_api_key_file_arg
from common.reasons import Role
from protos import rpc
from protos.pdserve.v1 import generation_pb2
from router.client import GenerationClient, make_request


class HealthProbe:
    """Health checks every 50 ms from another process (this one's GIL is busy building big requests);
    ``worst_s``: the slowest answer while it ran."""

    def __init__(self, target: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork after gRPC started
        self._ready, self._stop, self._worst = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        self._proc = ctx.Process(target=_probe, args=(target, self._ready, self._stop, self._worst), daemon=True)
        self.worst_s = 0.0

    def __enter__(self) -> "HealthProbe":
        self._proc.start()
        if not self._ready.wait(60):
            raise RuntimeError("the health probe did not connect")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._proc.join(130)
        self.worst_s = self._worst.value


def _probe(target: str, ready, stop, worst) -> None:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected before the attack starts
        ready.set()
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=120)
            except grpc.RpcError:
                pass
            worst.value = max(worst.value, time.monotonic() - t0)
            stop.wait(0.05)


def rss_mib(pid: int | None) -> dict[str, float]:
    if pid is None:
        return {}
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def attempt(client: GenerationClient, target: str, **kw) -> dict:
    """One request under a health probe: status code, message, seconds to the answer, worst health check."""
    t0 = time.monotonic()
    with HealthProbe(target) as probe:
        try:
            out = client.generate(max_tokens=4, timeout_s=600, **kw)
            code, msg = "OK", out.finish_reason
        except grpc.RpcError as e:
            code, msg = e.code().name, (e.details() or "")[:120]
    return {"code": code, "message": msg, "answer_s": round(time.monotonic() - t0, 3),
            "worst_health_check_s": round(probe.worst_s, 3)}


def decode_pages_free(client: GenerationClient) -> int:
    return sum(w.pages_free for w in client.cluster_status().workers if w.role == Role.DECODE)


def long_ids(client: GenerationClient, target: str, num: int) -> dict:
    before = decode_pages_free(client)
    results = [attempt(client, target, token_ids=list(range(10, 60)), request_id=f"{i:03d}" + "x" * 247)
               for i in range(num)]
    time.sleep(1.0)  # aborts settle
    return {"num": num, "codes": sorted({r["code"] for r in results}), "message": results[0]["message"],
            "decode_pages_free_before": before, "decode_pages_free_after": decode_pages_free(client)}


def unauthenticated(target: str, num: int, mib: float) -> dict:
    raw = make_request(prompt="a" * int(mib * 2**20)).SerializeToString()

    def one(_):
        with grpc.insecure_channel(target, options=rpc.CHANNEL_OPTIONS) as ch:
            call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                   response_deserializer=generation_pb2.GenerateResponse.FromString)
            try:
                list(call(raw, timeout=120))
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
    t0 = time.monotonic()
    with ThreadPoolExecutor(num) as pool:
        codes = list(pool.map(one, range(num)))
    return {"codes": sorted(set(codes)), "seconds": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser("python -m bench.big_requests", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--api-key", default=None)
    add_api_key_file_arg(ap)
    ap.add_argument("--router-pid", type=int, default=None, help="to report the router's RSS (same machine)")
    ap.add_argument("--text-mib", type=float, default=16.0)
    ap.add_argument("--stop-ids", type=int, default=10_000_000)
    ap.add_argument("--long-ids", type=int, default=20)
    ap.add_argument("--unauth", type=int, default=20)
    ap.add_argument("--unauth-mib", type=float, default=60.0)
    args = ap.parse_args(argv)
    key = rpc.api_key_from_args(args)
    report: dict = {"rss_mib_start": rss_mib(args.router_pid)}
    with GenerationClient(args.target, api_key=key, timeout_s=600) as c:
        if args.text_mib:
            text = "hello world " * int(args.text_mib * 2**20 / 12)
            report["text"] = {"mib": args.text_mib, **attempt(c, args.target, prompt=text)}
        if args.stop_ids:
            report["stop_ids"] = {"num": args.stop_ids, **attempt(c, args.target, token_ids=[5, 6, 7],
                                                                   stop_token_ids=[9] * args.stop_ids)}
        if args.long_ids:
            report["long_ids"] = long_ids(c, args.target, args.long_ids)
    if args.unauth and key:
        report["unauthenticated"] = {"num": args.unauth, "mib": args.unauth_mib,
                                     **unauthenticated(args.target, args.unauth, args.unauth_mib)}
    report["rss_mib_end"] = rss_mib(args.router_pid)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
