"""``python -m router --port 50051 --http-port 8000 --prefill HOST:PORT,... --decode HOST:PORT,...
[--api-key-file PATH] [--model DIR]``

The API key comes from ``--api-key-file``, else ``$PDSERVE_API_KEY`` (``--api-key`` works too, but every
user of the machine sees it in ``ps``).

Prints ``PDSERVE_READY router HOST:PORT [http HOST:PORT]`` once listening (gRPC, then the OpenAI-compatible
HTTP port unless ``--http-port 0``), serves until SIGTERM/SIGINT, then stops with a
grace period. Flags are generated from ``RouterConfig``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from common import flags, logs
from protos import rpc
from router.config import DEFAULT_HTTP_PORT, RouterConfig, add_config_args, config_from_args
from router.server import RouterServer
from worker import process
from worker.process import run

logger = logging.getLogger("router")


async def amain(cfg: RouterConfig) -> None:
    srv = RouterServer(cfg)
    try:
        await srv.start()
    except OSError as e:
        raise SystemExit(f"router: error: {e}") from None
    missing = await srv.core.registry.wait_first_poll(cfg.startup_timeout_s)
    if missing:
        logger.warning("workers not healthy yet (serving anyway, they join when healthy): %s", ", ".join(missing))
    process.freeze_startup_heap()  # ~26k start-up objects out of every full collection (~10-20 ms each) on the loop
    http = f" http {srv.http.address}" if srv.http is not None else ""
    print(f"PDSERVE_READY router {srv.address}{http}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received: shutting down")
    await srv.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m router", description="pdserve router (public gRPC API)")
    add_config_args(p)
    p.set_defaults(http_port=DEFAULT_HTTP_PORT)
    flags.add_api_key_file_arg(p)
    logs.add_log_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup_logging(args.log_level, args.log_format)
    try:
        cfg = config_from_args(args, api_key=rpc.api_key_from_args(args))
    except (ValueError, OSError) as e:
        print(f"router: error: {e}", file=sys.stderr)
        return 2
    if (not cfg.prefill and not cfg.aggregated) or not cfg.decode:
        print("router: error: give at least one --prefill (or --aggregated) and one --decode worker address",
              file=sys.stderr)
        return 2
    run(amain(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
