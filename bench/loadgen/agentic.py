"""The agentic workload's step: sessions that run their turns closed loop, and the step's session figures.

A step runs ``cfg.sessions`` sessions (numbered on from the previous step's, so every step has new ones) in
``workload.session_order``; ``step.value`` of them are in flight at once. A session sends turn 0
(``first_prompt``), waits for it to end, sleeps ``think_time_s``, then sends turn 1 = turn 0's prompt + the
token ids the server returned + a new user chunk, and so on for ``cfg.turns`` turns. A turn that fails
(any status but OK) ends its session there: its later turns are never sent, the session counts as failed, and
its sender moves on to the next session. There is no warm-up and no fixed window: every turn is measured and
the window is the whole step, from its start to the end of the last turn. ``cfg.max_duration_s`` (when set)
bounds the step; turns still running then are cancelled and count as ``DRAIN_TIMEOUT``. Each turn is bounded
by ``request_timeout_s`` anyway, so a session never hangs.

A turn's request id is ``bench-<session x turns + turn>``: the same session and turn always has the same id.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from bench.loadgen.config import BenchConfig
from bench.loadgen.runner import DRAIN_TIMEOUT, LoadStep, RequestRecord, StepRecords, StepRunner
from bench.loadgen.workload import AgenticWorkload, RequestSpec

WINDOW_EPS_S = 1e-6
"""The window ends just after the last turn, so that turn's end is inside it."""


class AgenticRunner(StepRunner):
    """Runs one agentic step: ``first_index`` (a multiple of ``cfg.turns``) names its first session."""

    keep_output_ids = True
    workload: AgenticWorkload

    async def run(self, step: LoadStep, warmup_s: float = 0.0, duration_s: float = 0.0,
                  step_num: int = 0) -> StepRecords:
        """``warmup_s`` and ``duration_s`` are not used: every turn of every session is measured."""
        cfg = self.cfg
        self._t0 = time.perf_counter()
        first = -(-self.next_index // cfg.turns)
        queue = deque(self.workload.session_order(first, cfg.sessions))
        self.next_index = (first + cfg.sessions) * cfg.turns
        ticker = asyncio.create_task(self._tick())
        senders = [asyncio.create_task(self._sessions(queue)) for _ in range(min(int(step.value), cfg.sessions))]
        try:
            await asyncio.wait(senders, timeout=cfg.max_duration_s)
        finally:  # past the bound (or on our own cancellation) every sender and its stream is cancelled
            for t in (ticker, *senders):
                t.cancel()
            ended = await asyncio.gather(ticker, *senders, return_exceptions=True)
        bugs = [e for e in ended if isinstance(e, Exception)]  # a cancelled sender is no Exception
        if bugs:
            raise bugs[0]
        for rec in self.records:
            if not rec.status:
                rec.status, rec.detail = DRAIN_TIMEOUT, f"still running at --max-duration {cfg.max_duration_s}s"
                self.num_failed += 1
        if self.on_progress is not None:
            self.on_progress(self.now(), len(self.records), self.num_done, self.num_failed)
        end = self.now() + WINDOW_EPS_S
        return StepRecords(step, 0.0, end, self.records, elapsed_s=end)

    async def _sessions(self, queue: deque[int]) -> None:
        """One sender: sessions from ``queue`` one after the other until it is empty."""
        while queue:
            await self._session(queue.popleft())

    async def _session(self, session: int) -> None:
        cfg, wl = self.cfg, self.workload
        prompt, returned = wl.first_prompt(session), None
        for turn in range(cfg.turns):
            if returned is not None:
                if cfg.think_time_s:
                    await asyncio.sleep(cfg.think_time_s)
                prompt = wl.next_prompt(prompt, returned, session, turn)
            spec = RequestSpec(session * cfg.turns + turn, len(prompt), cfg.output_len, cfg.system_len, 0,
                               prompt_ids=prompt)
            rec = self._record(spec, self.now())
            rec.session, rec.turn = session, turn
            await self._send(rec, spec)
            if not rec.ok:
                return
            returned = rec.output_ids


def agentic_stats(sr: StepRecords, cfg: BenchConfig) -> dict[str, Any]:
    """The step's session figures (bench.json ``steps[i].agentic``)."""
    by_session: dict[int, list[RequestRecord]] = {}
    for r in sr.records:
        by_session.setdefault(r.session, []).append(r)
    complete = sum(len(rs) == cfg.turns and all(r.ok for r in rs) for rs in by_session.values())
    failed = sum(any(not r.ok for r in rs) for rs in by_session.values())
    ok = [r for r in sr.records if r.ok]
    elapsed = sr.window_s
    per_turn = []
    for t in range(cfg.turns):
        rs = [r for r in ok if r.turn == t]
        prompt = sum(r.prompt_tokens for r in rs)
        per_turn.append({
            "turn": t, "num_ok": len(rs),
            "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in rs])) if rs else None,
            "cache_hit": sum(r.cached_tokens for r in rs) / prompt if prompt else None,
            "ttft_p50_s": float(np.percentile([r.ttft_s for r in rs], 50)) if rs else None,
            "kv_bytes_mean": float(np.mean([r.kv_transfer_bytes for r in rs])) if rs else None,
            "decode_resident_mean": float(np.mean([r.decode_resident_tokens for r in rs])) if rs else None})
    # what every session holds at its end: its last prompt and the tokens returned for it
    state = sum(rs[-1].prompt_tokens + rs[-1].completion_tokens for rs in by_session.values() if rs[-1].ok)
    shipped = [r.prompt_tokens - r.decode_resident_tokens for r in ok]
    return {
        "sessions": cfg.sessions, "turns_per_session": cfg.turns, "in_flight": int(sr.step.value),
        "system_len": cfg.system_len, "user_len": cfg.user_len, "output_len": cfg.output_len,
        "think_time_s": cfg.think_time_s,
        "sessions_started": len(by_session), "sessions_completed": complete, "sessions_failed": failed,
        "turns_sent": len(sr.records), "turns_ok": len(ok),
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else None,
        "tokens_per_s": sum(r.prompt_tokens + r.completion_tokens for r in ok) / elapsed if elapsed > 0 else None,
        "session_state_tokens": state,
        "kv_bytes_per_turn": float(np.mean([r.kv_transfer_bytes for r in ok])) if ok else None,
        "decode_resident": sum(r.decode_resident_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "shipped_tokens_per_turn": float(np.mean(shipped)) if ok else None,
        **_beyond_tail(by_session),
        "per_turn": per_turn,
        "elapsed_s": elapsed,
    }


def _beyond_tail(by_session: dict[int, list[RequestRecord]]) -> dict[str, Any]:
    """Decode-side reuse against its floor: a later turn's *tail* is what its decode worker cannot hold yet (the
    new user chunk and the last token returned, whose KV was never written: prompt - previous prompt - previous
    completion + 1); ``beyond_tail_tokens_*`` = prompt tokens shipped past it (mean, max over turns 2+: at most
    a page with reuse, the whole previous state without)."""
    extra = []
    for rs in by_session.values():
        for prev, r in zip(rs, rs[1:]):
            if prev.ok and r.ok:
                tail = r.prompt_tokens - prev.prompt_tokens - prev.completion_tokens + 1
                extra.append(r.prompt_tokens - r.decode_resident_tokens - tail)
    return {"beyond_tail_tokens_mean": float(np.mean(extra)) if extra else None,
            "beyond_tail_tokens_max": int(max(extra)) if extra else None}
