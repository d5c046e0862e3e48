"""Attacks and random cancellations interleaved with a soak's steady load (issue 25).

``bench.soak --chaos`` runs this beside the steady load: every ``every_s`` seconds one action, in a seeded
random order, against the router's public API (loopback only):

    cancel          a request cancelled by the client at a random moment (queued, prefilling, streaming)
    deadline        a request with a deadline of 0.05-0.5 s
    oversized-text  a text prompt far longer than the context can hold (refused before it is tokenized)
    stop-ids        5,000 stop token ids (refused: the cap is 1,024)
    long-id         a 250-character request id (refused: the limit leaves room for retry suffixes)
    kv-slowloris    80 never-authenticating connections to every decode worker's KV port for 10 s
    slow-readers    32 Generate streams on one HTTP/2 connection with a zero flow-control window, for 10 s

Each action's outcome must be one its input allows (``EXPECTED``): a client cancel ends CANCELLED (or OK
when the answer was faster), a deadline DEADLINE_EXCEEDED or OK, bad input INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED for a message over the size limit), the slowloris must leave the steady load unharmed.
Anything else (UNKNOWN, INTERNAL, a hang past the action's bound) is reported as unexpected; the soak
then fails, as it does when its own requests fail or a page, fd or byte of RSS is not back.
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import grpc

from bench.loadgen.fault import KVSlowloris
from bench.loadgen.slowreader import SlowReaders
from common.reasons import Role
from router.client import AsyncGenerationClient, make_request

ACTIONS = ("cancel", "deadline", "oversized-text", "stop-ids", "long-id", "kv-slowloris", "slow-readers")
EXPECTED: dict[str, set[str]] = {
    "cancel": {"CANCELLED", "OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "oversized-text": {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"},
    "stop-ids": {"INVALID_ARGUMENT"},
    "long-id": {"INVALID_ARGUMENT"},
    "kv-slowloris": {"OK"},
    "slow-readers": {"OK"},
}
ACTION_BOUND_S = 120.0
"""No action may take longer than this (a request that hangs is a failure, not a slow success)."""
SLOWLORIS_S = 10.0
SLOW_READERS_S = 10.0


class Chaos:
    """One seeded sequence of actions against ``target`` until ``stop`` is set; ``summary()`` says what came back."""

    def __init__(self, target: str, api_key: str | None, vocab_size: int, every_s: float = 3.0, seed: int = 0,
                 prompt_len: int = 256) -> None:
        self.client = AsyncGenerationClient(target, api_key, timeout_s=ACTION_BOUND_S)
        self.api_key = api_key
        self.vocab_size, self.every_s, self.prompt_len = vocab_size, every_s, prompt_len
        self.rng = random.Random(seed)
        self.outcomes: dict[str, Counter] = {a: Counter() for a in ACTIONS}
        self.unexpected: list[str] = []
        self.slowloris: list[dict[str, Any]] = []
        self._text = " ".join(self.rng.choice(("the", "of", "and", "pdserve", "kv")) for _ in range(400_000))
        """~1 MiB of text, built once (not on the event loop the steady load shares)."""

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(2, self.vocab_size) for _ in range(self.prompt_len)]

    async def run(self, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                action = self.rng.choice(ACTIONS)
                t = asyncio.create_task(self._bounded(action), name=f"chaos-{action}")
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                try:
                    await asyncio.wait_for(stop.wait(), self.every_s)
                except asyncio.TimeoutError:
                    pass
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await self.client.close()

    async def _bounded(self, action: str) -> None:
        try:
            status = await asyncio.wait_for(getattr(self, "_" + action.replace("-", "_"))(), ACTION_BOUND_S)
        except asyncio.TimeoutError:
            status = f"no answer within {ACTION_BOUND_S:g}s"
        self.outcomes[action][status] += 1
        if status not in EXPECTED[action]:
            self.unexpected.append(f"{action}: {status}")

    async def _request(self, call) -> str:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code().name
        except asyncio.CancelledError:  # our own cancel of the call surfaces as a cancelled iteration
            return "CANCELLED"
        return "OK"

    async def _cancel(self) -> str:
        call = self.client.call(token_ids=self._prompt(), max_tokens=64, ignore_eos=True)
        reader = asyncio.ensure_future(self._request(call))
        done, _ = await asyncio.wait({reader}, timeout=self.rng.uniform(0.0, 2.0))
        if not done:
            call.cancel()
        return await reader

    async def _deadline(self) -> str:
        call = self.client.call(token_ids=self._prompt(), max_tokens=64, ignore_eos=True,
                                timeout_s=self.rng.uniform(0.05, 0.5))
        return await self._request(call)

    async def _oversized_text(self) -> str:
        return await self._request(self.client.call(prompt=self._text, max_tokens=4))

    async def _stop_ids(self) -> str:
        return await self._request(self.client.call(token_ids=self._prompt(), max_tokens=4,
                                                    stop_token_ids=list(range(2, 5002))))

    async def _long_id(self) -> str:
        return await self._request(self.client.call(token_ids=self._prompt(), max_tokens=4, request_id="x" * 250))

    async def _kv_slowloris(self) -> str:
        st = await self.client.cluster_status()
        addresses = []
        for w in st.workers:
            if w.role == Role.DECODE and w.kv_address:
                host, _, port = w.kv_address.rpartition(":")
                addresses.append((host.strip("[]"), int(port)))
        holder = KVSlowloris(addresses, num_per_port=80, reopen_s=1.0)
        holder.start()
        try:
            await asyncio.sleep(SLOWLORIS_S)
        finally:
            self.slowloris.append(await holder.close())
        return "OK"

    async def _slow_readers(self) -> str:
        req = make_request(token_ids=self._prompt(), max_tokens=64, ignore_eos=True)
        readers = SlowReaders(self.client.target, 32, req, api_key=self.api_key)
        await asyncio.to_thread(readers.start)
        try:
            await asyncio.sleep(SLOW_READERS_S)
        finally:
            await asyncio.to_thread(readers.close)
        return "OK"

    def summary(self) -> dict[str, Any]:
        return {"outcomes": {a: dict(c) for a, c in self.outcomes.items()}, "unexpected": self.unexpected,
                "slowloris": self.slowloris}
