"""MTP speculative decoding: draft with the model's MTP layer, verify losslessly in one target forward.

Entry points: ``SpecConfig.parse("3/1/4")``; a prefill worker calls ``mtp_prefill`` (or
``mtp_prefill_batch``) after each chunk's target forward; a decode worker keeps a ``SpecSeq`` per
request and calls ``SpecDecoder.step(seqs)`` (or uses ``make_speculator``, the decode scheduler's
``Speculator``); ``SpecEngine`` / ``run_speculative`` run both in-process.
"""
from engine.spec.config import SpecConfig
from engine.spec.decoder import SpecDecoder, SpecStepResult
from engine.spec.generate import SpecEngine, SpecRunResult, run_speculative
from engine.spec.metrics import SpecMetrics
from engine.spec.prefill import MTPChunk, MTPPrefillResult, mtp_prefill, mtp_prefill_batch
from engine.spec.seq import SpecSeq
from engine.spec.worker import MTPSpeculator, make_speculator

__all__ = ["MTPChunk", "MTPPrefillResult", "MTPSpeculator", "SpecConfig", "SpecDecoder", "SpecEngine", "SpecMetrics",
           "SpecRunResult", "SpecSeq", "SpecStepResult", "make_speculator", "mtp_prefill", "mtp_prefill_batch",
           "run_speculative"]
