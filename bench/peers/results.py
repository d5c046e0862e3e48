"""Peer results: parse what each peer's tool prints, take medians, render the tables with ratios.

Pure functions (no processes, no torch), shared by ``engine_table.py`` and ``side_by_side.py``.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field


def median(values: list[float]) -> float | None:
    """The median of the rounds, or None when a peer measured nothing."""
    return statistics.median(values) if values else None


def parse_llama_bench(text: str) -> dict[int, list[float]]:
    """``llama-bench -o json`` -> {prompt tokens: per-repetition tok/s} for prompt-only rows (``-n 0``)."""
    out: dict[int, list[float]] = {}
    for row in json.loads(text):
        if row.get("n_gen", 0) == 0 and row.get("n_prompt", 0) > 0:
            out.setdefault(int(row["n_prompt"]), []).extend(float(x) for x in row["samples_ts"])
    return out


def parse_batched_bench(text: str) -> dict[int, float]:
    """``llama-batched-bench --output-format jsonl`` -> {parallel sequences: generation tok/s (``speed_tg``)}."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            if "speed_tg" in row:
                out[int(row["pl"])] = float(row["speed_tg"])
    return out


@dataclass
class PeerTable:
    """Rows (``decode bs8``, ``prefill 2k``) x columns (peers), each cell the per-round tok/s."""

    columns: list[str]
    """Peers in print order; the first ``num_ours`` are pdserve's own."""
    num_ours: int
    cells: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """row -> column -> rounds."""

    def add(self, row: str, column: str, values: list[float]) -> None:
        self.cells.setdefault(row, {}).setdefault(column, []).extend(values)

    def value(self, row: str, column: str) -> float | None:
        return median(self.cells.get(row, {}).get(column, []))

    def best_ours(self, row: str) -> tuple[str, float] | None:
        """pdserve's best column on ``row`` and its median."""
        vals = [(c, v) for c in self.columns[:self.num_ours] if (v := self.value(row, c)) is not None]
        return max(vals, key=lambda cv: cv[1]) if vals else None

    def ratio(self, row: str, column: str) -> float | None:
        """pdserve's best on ``row`` / ``column``'s (>= 1.0: pdserve is at least as fast)."""
        best, theirs = self.best_ours(row), self.value(row, column)
        return best[1] / theirs if best and theirs else None

    def to_json(self) -> dict:
        return {"columns": self.columns, "num_ours": self.num_ours, "cells": self.cells,
                "median": {r: {c: self.value(r, c) for c in cols} for r, cols in self.cells.items()}}

    @classmethod
    def from_json(cls, d: dict) -> PeerTable:
        return cls(list(d["columns"]), int(d["num_ours"]), {r: {c: list(v) for c, v in cols.items()}
                                                             for r, cols in d["cells"].items()})

    def merge_missing(self, other: PeerTable) -> list[str]:
        """Cells this table lacks taken from ``other`` (a previous run's peers); returns the columns taken."""
        taken = []
        for row, cols in other.cells.items():
            for c, v in cols.items():
                if c in self.columns and not self.cells.get(row, {}).get(c):
                    self.add(row, c, v)
                    taken.append(c)
        return sorted(set(taken))

    def render(self, rows: list[str]) -> str:
        """Markdown: medians (tok/s) per column, then pdserve's best / each peer."""
        peers = self.columns[self.num_ours:]
        head = ["", *self.columns, *(f"best pdserve / {p}" for p in peers)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in rows:
            vals = [fmt_rate(self.value(row, c)) for c in self.columns]
            ratios = [fmt_ratio(self.ratio(row, p)) for p in peers]
            lines.append("| " + " | ".join([row, *vals, *ratios]) + " |")
        return "\n".join(lines)


def fmt_rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def tokens_label(n: int) -> str:
    """2048 -> '2k' (row names of the prefill lengths)."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


SERVED_KEYS = (("request_throughput", "req/s", True), ("output_throughput", "output tok/s", True),
               ("median_ttft_ms", "TTFT p50 ms", False), ("p99_ttft_ms", "TTFT p99 ms", False),
               ("mean_tpot_ms", "TPOT ms", False))
"""vLLM ``bench serve`` keys of the served table (both clients write them): key, header, higher is better."""
RATIO_KEYS = ("output_throughput", "median_ttft_ms", "mean_tpot_ms")


def served_figures(result: dict) -> dict[str, float]:
    """The served table's keys from one run: a ``vllm bench serve`` result (keys at the top) or a pdserve
    ``bench.json`` with one step (keys in ``steps[0]``)."""
    if "steps" in result:
        if len(result["steps"]) != 1:
            raise ValueError(f"expected a one-step pdserve bench result, got {len(result['steps'])} steps")
        result = result["steps"][0]
    return {k: float(result[k]) for k, _, _ in SERVED_KEYS}


def advantage(key: str, ours: float, theirs: float) -> float | None:
    """How many times better pdserve is on ``key`` (> 1.0: pdserve better): a throughput ours / theirs, a
    latency theirs / ours."""
    higher_better = next(h for k, _, h in SERVED_KEYS if k == key)
    num, den = (ours, theirs) if higher_better else (theirs, ours)
    return num / den if den > 0 else None


def render_served(runs: dict[tuple[str, str], dict[str, dict[str, float]]], ours: str) -> str:
    """Markdown, one line per (client, load, server) from {(client, load): {server: figures}}, with pdserve's
    advantage over each server on output tok/s, TTFT p50 and TPOT (> 1.0x: pdserve better)."""
    head = ["client", "load", "server", *(h for _, h, _ in SERVED_KEYS),
            *(f"pdserve adv. {h}" for k, h, _ in SERVED_KEYS if k in RATIO_KEYS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (client, load), servers in runs.items():
        base = servers.get(ours)
        for server, fig in servers.items():
            vals = [f"{fig[k]:,.2f}" if k == "request_throughput" else f"{fig[k]:,.1f}" for k, _, _ in SERVED_KEYS]
            adv = [fmt_ratio(advantage(k, base[k], fig[k]) if base and server != ours else None)
                   for k in RATIO_KEYS]
            lines.append("| " + " | ".join([client, load, server, *vals, *adv]) + " |")
    return "\n".join(lines)
