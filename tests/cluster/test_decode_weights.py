"""``pdserve serve --decode-weights``: what each value resolves to, and clear errors for bad ones."""
import os

import pytest

from cluster.weights import resolve_decode_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED, SHIPPED_MX = os.path.join(ROOT, "models", "glm5-tiny"), os.path.join(ROOT, "models", "glm5-tiny-mxfp4")


def test_model_and_already_quantized_serve_the_checkpoint_itself(tiny_dirs):
    assert resolve_decode_weights(tiny_dirs["dsa"], "model") is None
    if os.path.exists(SHIPPED_MX):
        assert resolve_decode_weights(SHIPPED_MX, "mxfp4") is None  # already MX: served as it is


def test_bad_values_fail_clearly(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="not 'model', one of .*mxfp4.*or a checkpoint directory"):
        resolve_decode_weights(tiny_dirs["dsa"], "fp3")
    with pytest.raises(ValueError, match="not a copy of"):
        resolve_decode_weights(tiny_dirs["dsa"], tiny_dirs["gqa"])  # another model's checkpoint


@pytest.mark.skipif(not os.path.exists(SHIPPED_MX), reason="models/glm5-tiny-mxfp4 not shipped")
def test_a_quantized_copy_directory_is_used_as_given():
    assert resolve_decode_weights(SHIPPED, SHIPPED_MX) == SHIPPED_MX
