"""MTP speculative decoding: draft with the model's MTP layer, verify losslessly in one target forward.

Entry points: ``SpecConfig.parse("3/1/4")``; every prefill (a prefill worker's chunks, a decode worker's
local prefill and recompute, ``SpecEngine``) runs ``prefill_forward``: the target forward, then the MTP KV;
a decode worker keeps a ``SpecSeq`` per request and calls ``SpecDecoder.step(seqs)`` (or uses ``make_speculator``, the decode scheduler's
``Speculator``); ``SpecEngine`` / ``run_speculative`` run both in-process.
"""
from engine.speculative.config import SpecConfig
from engine.speculative.decoder import SpecDecoder, SpecStepResult
from engine.speculative.generate import SpecEngine, SpecRunResult, run_speculative
from engine.speculative.metrics import SpecMetrics
from engine.speculative.prefill import (MTPChunk, MTPPrefillResult, PrefillChunk, PrefillChunkResult, mtp_prefill,
                                 mtp_prefill_batch, prefill_forward)
from engine.speculative.seq import SpecSeq
from engine.speculative.worker import MTPSpeculator, make_speculator

__all__ = ["MTPChunk", "MTPPrefillResult", "MTPSpeculator", "PrefillChunk", "PrefillChunkResult", "SpecConfig",
           "SpecDecoder", "SpecEngine", "SpecMetrics", "SpecRunResult", "SpecSeq", "SpecStepResult", "make_speculator", "mtp_prefill", "mtp_prefill_batch",
           "prefill_forward", "run_speculative"]
