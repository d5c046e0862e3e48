"""Where the default model lives, and environment variables (read here and nowhere else)."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

PDSERVE_HOME = os.environ.get("PDSERVE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
"""Scratch space for generated models and benchmark output."""
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_DEFAULT = os.path.join(REPO_ROOT, "models", "glm5-tiny")
"""The trained default model shipped in the repository (once it exists)."""


def default_model_dir() -> str:
    """The shipped default model, or a tiny random GLM-5-architecture model created on first use."""
    if os.path.exists(os.path.join(SHIPPED_DEFAULT, "config.json")):
        return SHIPPED_DEFAULT
    from engine.checkpoint import TINY_GLM5, init_random_model
    path = os.path.join(PDSERVE_HOME, "models", "tiny-random-glm5")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        logger.warning("no trained default model shipped yet: creating a tiny random GLM-5 model at %s", path)
        init_random_model(TINY_GLM5, path)
    return path
