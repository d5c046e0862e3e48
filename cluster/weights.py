"""Which weights the decode workers load (``--decode-weights``): the model's own, a quantized copy's directory, or
an MX format the model's routed experts are quantized to once and cached. Loads torch (``engine.quant``): the
launchers import it where they resolve the weights, not at the top (``pdserve --help`` stays light)."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

from engine.config import ModelConfig
from engine.defaults import PDSERVE_HOME
from engine.fingerprint import model_hash
from engine.quant.mx import MX_FORMATS
from engine.quant.quantize import quantize_checkpoint
from engine.quant.quark import QuarkConfig

logger = logging.getLogger("cluster.weights")


MX_BLOCK_SIZE = 32
"""Elements per MX scale block along a weight's last (input) dimension (OCP MX v1.0, section 5)."""


def mx_unfit(cfg) -> str:
    """Why the routed experts of ``cfg`` (an ``engine.config.ModelConfig``) cannot be MX-quantized, or "":
    gate/up ([moe_intermediate, hidden]) block along hidden_size, down ([hidden, moe_intermediate]) along
    moe_intermediate_size."""
    bad = [f"{name} {getattr(cfg, name)}" for name in ("hidden_size", "moe_intermediate_size")
           if getattr(cfg, name) % MX_BLOCK_SIZE]
    return f"{' and '.join(bad)} not a multiple of the MX block size {MX_BLOCK_SIZE}" if bad else ""


def resolve_decode_weights(model_dir: str, spec: str) -> str | None:
    """``LocalClusterConfig.decode_weights`` -> the checkpoint directory decode workers load, or None for
    ``model_dir`` itself. An MX format quantizes ``model_dir``'s routed experts once (``pdserve quantize``)
    into a cache keyed by the model's hash, so later starts reuse it."""
    if spec == "model" or not os.path.exists(os.path.join(model_dir, "config.json")):
        return None  # (no model there: the workers fail to start and say why)
    if spec not in MX_FORMATS:
        if not os.path.exists(os.path.join(spec, "config.json")):
            raise ValueError(f"decode weights {spec!r}: not 'model', one of {list(MX_FORMATS)}, or a checkpoint "
                             f"directory")
        a, b = ModelConfig.from_model_dir(model_dir), ModelConfig.from_model_dir(spec)
        if (a.model_type, a.num_hidden_layers, a.hidden_size, a.vocab_size) != \
                (b.model_type, b.num_hidden_layers, b.hidden_size, b.vocab_size):
            raise ValueError(f"decode weights {spec} are not a copy of {model_dir} (model type, layers, hidden "
                             f"size or vocabulary differ)")
        return spec
    if QuarkConfig.for_model_dir(model_dir) is not None:
        return None  # already quantized: serve it as it is
    why = mx_unfit(ModelConfig.from_model_dir(model_dir))
    if why:
        logger.warning("decode weights: %s cannot be quantized to %s (%s): decode workers run the model's own "
                       "weights (--decode-weights model)", model_dir, spec, why)
        return None
    out = os.path.join(PDSERVE_HOME, "quantized", f"{model_hash(model_dir)}-{spec}")
    if not os.path.exists(os.path.join(out, ".complete")):
        logger.warning("decode weights: quantizing %s to %s once (cached at %s)", model_dir, spec, out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
        try:
            quantize_checkpoint(model_dir, tmp, spec, progress=False)
            open(os.path.join(tmp, ".complete"), "w").close()
            if not os.path.exists(os.path.join(out, ".complete")):  # another process may have finished first
                shutil.rmtree(out, ignore_errors=True)  # an interrupted attempt's leftovers
                try:
                    os.replace(tmp, out)
                except OSError:  # it did meanwhile: its copy is the same bytes
                    if not os.path.exists(os.path.join(out, ".complete")):
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
