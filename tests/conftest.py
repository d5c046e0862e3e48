import logging
import os
import sys

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random transformers checkpoints saved to disk: {'dsa': dir, 'gqa': dir}."""
    from tiny import make_hf_model
    out = {}
    for kind in ("dsa", "gqa"):
        d = tmp_path_factory.mktemp(f"tiny_{kind}")
        make_hf_model(kind).save_pretrained(d)
        out[kind] = str(d)
    return out


@pytest.fixture(scope="session")
def tiny_glm5_dir(tmp_path_factory):
    """A tiny random GLM-5 checkpoint (``TINY_GLM5`` with index_topk 64, seed 1): the scheduler tests' model,
    loaded by each in the dtype it needs."""
    from engine.checkpoint import TINY_GLM5, init_random_model  # as tiny_dirs: the engine only for tests using it
    d = str(tmp_path_factory.mktemp("tiny_glm5"))
    init_random_model({**TINY_GLM5, "index_topk": 64}, d, seed=1)
    return d
