"""Workloads: deterministic request streams. ``workload.request(i)`` is a pure function of (config, seed, i),
so two runs with one seed send identical requests in the same order, whatever the timing.

Prompt layout (token ids drawn in ``[2, vocab_size)``; 0 and 1 are left to BOS/EOS)::

    [ group prefix: prefix_len tokens | unique suffix: input_len - prefix_len tokens ]
      prefix_len = round(cache_hit * input_len), the same tokens for every request of the group

Two guarantees make the shared part exactly ``prefix_len`` tokens (so a prefix cache can hit exactly the
requested rate once a group's prefix is resident): the first token of group ``g``'s prefix is
``2 + g mod (vocab - 2)`` (distinct groups diverge at token 0), and the first suffix token of request ``i`` is
``2 + i mod (vocab - 2)`` (two requests of a group diverge right after the prefix unless their indices are
``vocab - 2`` apart, where a random token decides). A server's page-granular cache hits
``floor(prefix_len / page) * page`` of it; the bench reports the measured rate next to the target.

Text prompts (``--text-prompts``) use the same layout with one word from ``WORDS`` per "token"; the
server's tokenizer decides the real lengths, which the report takes from ``usage.prompt_tokens``.
"""
from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bench.loadgen.config import BenchConfig

FIRST_ID = 2
"""Smallest token id sent: ids 0 and 1 are BOS/EOS in the models pdserve serves."""
_PREFIX_STREAM = 0x5EED_0001
_GROUP_STREAM = 0x5EED_0002
_LENGTH_STREAM = 0x5EED_0003
_USER_STREAM = 0x5EED_0004
_ORDER_STREAM = 0x5EED_0005

WORDS = tuple("""the of and to in is that for it as was with be by on not he this are or his from at which but have
an had they you were their one all we can her has there been if more when will would who so no time up out about
into them than only other new some could these two may first then do any like my now over such our man me even
most made after also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against go came
right used take three""".split())  # noqa: SIM905 - a paragraph of words reads better than a list


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send (either ``prompt_ids`` or ``text`` is set)."""
    index: int
    """Position in the run's request stream (also the request_id suffix)."""
    input_len: int
    """Prompt length in tokens (words for text prompts)."""
    output_len: int
    """Exact output length: sent as max_tokens with ignore_eos."""
    prefix_len: int
    """Leading tokens shared with the prefix group (0: none)."""
    prefix_group: int | None
    prompt_ids: tuple[int, ...] | None = None
    text: str | None = None
    arrival_s: float | None = None
    """trace: send time relative to the start of the replay."""

    @property
    def req_id(self) -> str:
        return f"bench-{self.index}"


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp_s: float
    input_len: int
    output_len: int
    prefix_group: int | None


class Workload(abc.ABC):
    """A deterministic request stream; ``request(i)`` may be called in any order, any number of times."""

    def __init__(self, cfg: BenchConfig, vocab_size: int | None) -> None:
        if not cfg.text_prompts and (vocab_size is None or vocab_size < 3):
            raise ValueError(f"token prompts need a vocab_size >= 3, got {vocab_size}")
        self.cfg = cfg
        self.vocab_size = vocab_size or 0
        self._prefixes: dict[int, np.ndarray] = {}

    @abc.abstractmethod
    def shape(self, i: int) -> tuple[int, int, int | None, float | None]:
        """(input_len, output_len, prefix_group, arrival_s) of request i."""

    def __len__(self) -> int:
        """How many requests the stream has (an open-ended stream is effectively unbounded)."""
        return 1 << 62

    def request(self, i: int) -> RequestSpec:
        input_len, output_len, group, arrival = self.shape(i)
        prefix_len = round(self.cfg.cache_hit * input_len) if group is not None else 0
        prefix_len = min(prefix_len, input_len - 1)  # keep one unique token: every prompt differs from the rest
        ids = self._draw(i, group, prefix_len, input_len)
        if self.cfg.text_prompts:
            return RequestSpec(i, input_len, output_len, prefix_len, group, text=" ".join(WORDS[t] for t in ids),
                               arrival_s=arrival)
        return RequestSpec(i, input_len, output_len, prefix_len, group, prompt_ids=tuple(ids.tolist()),
                           arrival_s=arrival)

    def _space(self) -> tuple[int, int]:
        """(first id, number of ids) the prompts are drawn from."""
        return (0, len(WORDS)) if self.cfg.text_prompts else (FIRST_ID, self.vocab_size - FIRST_ID)

    def _group_prefix(self, group: int, n: int) -> np.ndarray:
        first, size = self._space()
        have = self._prefixes.get(group)
        if have is None or len(have) < n:
            rng = np.random.default_rng([self.cfg.seed, _PREFIX_STREAM, group])
            have = first + rng.integers(0, size, max(n, 1), dtype=np.int64)  # one stream per group: a prefix of it
            have[0] = first + group % size
            self._prefixes[group] = have
        return have[:n]

    def _draw(self, i: int, group: int | None, prefix_len: int, input_len: int) -> np.ndarray:
        first, size = self._space()
        rng = np.random.default_rng([self.cfg.seed, i])
        suffix = first + rng.integers(0, size, input_len - prefix_len, dtype=np.int64)
        suffix[0] = first + i % size
        if prefix_len == 0:
            return suffix
        return np.concatenate([self._group_prefix(group, prefix_len), suffix])

    def _group_of(self, i: int) -> int | None:
        if self.cfg.cache_hit == 0:
            return None
        return int(np.random.default_rng([self.cfg.seed, _GROUP_STREAM, i]).integers(0, self.cfg.num_prefixes))


class FixedWorkload(Workload):
    """prefill-bound and single-stream: every request input_len in / output_len out."""

    def shape(self, i: int) -> tuple[int, int, int | None, float | None]:
        return self.cfg.input_len, self.cfg.output_len, self._group_of(i), None


class RandomWorkload(Workload):
    """Input and output lengths uniform in the configured inclusive ranges."""

    def shape(self, i: int) -> tuple[int, int, int | None, float | None]:
        rng = np.random.default_rng([self.cfg.seed, _LENGTH_STREAM, i])
        (ilo, ihi), (olo, ohi) = self.cfg.input_range, self.cfg.output_range
        return int(rng.integers(ilo, ihi + 1)), int(rng.integers(olo, ohi + 1)), self._group_of(i), None


class TraceWorkload(Workload):
    """Replays (timestamp, input_len, output_len, prefix_group) entries; a null group shares no prefix."""

    def __init__(self, cfg: BenchConfig, vocab_size: int | None, entries: Sequence[TraceEntry]) -> None:
        super().__init__(cfg, vocab_size)
        if not entries:
            raise ValueError(f"trace {cfg.trace} has no entries")
        t0 = entries[0].timestamp_s
        self.entries = [TraceEntry((e.timestamp_s - t0) / cfg.trace_speed, e.input_len, e.output_len,
                                   e.prefix_group) for e in entries]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def span_s(self) -> float:
        return self.entries[-1].timestamp_s

    def shape(self, i: int) -> tuple[int, int, int | None, float | None]:
        e = self.entries[i]
        return e.input_len, e.output_len, (e.prefix_group if self.cfg.cache_hit > 0 else None), e.timestamp_s


class AgenticWorkload(Workload):
    """Multi-turn sessions over one shared system + tools prefix (``system_len`` tokens, group 0's prefix).

    Session ``s`` opens with ``system prefix + user_chunk(s, 0)``; turn ``t + 1`` sends turn ``t``'s prompt +
    the tokens the server returned for it + ``user_chunk(s, t + 1)`` (``next_prompt``), so its prompt depends on
    the server's answer. The user chunks and the order in which sessions start (``session_order``) depend on the
    seed only. The first token of session ``s``'s first chunk is ``2 + s mod (vocab - 2)``: sessions diverge right
    after the shared prefix. ``request(i)`` is not used: the prompts come from ``first_prompt`` / ``next_prompt``.
    """

    def shape(self, i: int) -> tuple[int, int, int | None, float | None]:
        raise TypeError("agentic prompts depend on the server's answers: use first_prompt / next_prompt")

    def user_chunk(self, session: int, turn: int) -> np.ndarray:
        first, size = self._space()
        rng = np.random.default_rng([self.cfg.seed, _USER_STREAM, session, turn])
        chunk = first + rng.integers(0, size, self.cfg.user_len, dtype=np.int64)
        if turn == 0:
            chunk[0] = first + session % size
        return chunk

    def first_prompt(self, session: int) -> tuple[int, ...]:
        return tuple(np.concatenate([self._group_prefix(0, self.cfg.system_len),
                                     self.user_chunk(session, 0)]).tolist())

    def next_prompt(self, prompt: Sequence[int], returned_ids: Sequence[int], session: int,
                    turn: int) -> tuple[int, ...]:
        """Turn ``turn``'s prompt: the previous one, what the server returned for it, a new user chunk."""
        return (*prompt, *returned_ids, *self.user_chunk(session, turn).tolist())

    def session_order(self, first_session: int, num_sessions: int) -> list[int]:
        """Sessions ``first_session ..`` in the order they start (a seeded permutation)."""
        rng = np.random.default_rng([self.cfg.seed, _ORDER_STREAM, first_session])
        return (first_session + rng.permutation(num_sessions)).tolist()


def load_trace(path: str) -> list[TraceEntry]:
    """Parse a JSONL trace, sorted by timestamp; raises ValueError naming the bad line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                group = obj.get("prefix_group")
                e = TraceEntry(float(obj["timestamp"]), int(obj["input_len"]), int(obj["output_len"]),
                               None if group is None else int(group))
            except (KeyError, ValueError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}:{n}: expected {{\"timestamp\", \"input_len\", \"output_len\", "
                                 f"\"prefix_group\"}}, got {line.strip()[:120]!r} ({err})") from None
            if e.input_len < 1 or e.output_len < 1 or e.timestamp_s < 0:
                raise ValueError(f"{path}:{n}: lengths must be >= 1 and timestamp >= 0, got {line.strip()[:120]!r}")
            out.append(e)
    return sorted(out, key=lambda e: e.timestamp_s)


def make_workload(cfg: BenchConfig, vocab_size: int | None) -> Workload:
    """``cfg`` must be resolved (``with_defaults()``)."""
    if cfg.workload == "trace":
        return TraceWorkload(cfg, vocab_size, load_trace(cfg.trace))
    if cfg.workload == "random":
        return RandomWorkload(cfg, vocab_size)
    if cfg.workload == "agentic":
        return AgenticWorkload(cfg, vocab_size)
    return FixedWorkload(cfg, vocab_size)
