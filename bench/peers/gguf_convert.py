"""llama.cpp's ``convert_hf_to_gguf.py`` for the peers' glm4_moe checkpoint (runs in the peers' llama venv).

    python gguf_convert.py LLAMA_CPP_DIR HF_DIR [convert_hf_to_gguf.py flags...]

The converter's GLM-4.5 vocabulary path expects GLM's own tokenizer (its pre-tokenizer hash and the
``[gMASK]``/``<|user|>``/``<|observation|>`` tokens). The bench checkpoint carries pdserve's default tokenizer
instead: a byte-level BPE with GPT-2's split regex, so it is written as what it is, a ``gpt2`` model with the
``gpt-2`` pre-tokenizer (the converter's generic BPE path, which pads the vocabulary to the model's 32000
with unused tokens). Nothing else of the conversion changes. Stdlib + the converter only: no pdserve imports.
"""
from __future__ import annotations

import sys


def main() -> None:
    llama_dir, hf_dir, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path.insert(0, llama_dir)
    import convert_hf_to_gguf  # the converter itself, importable from LLAMA_CPP_DIR
    from conversion.base import TextModel  # after the sys.path set-up above: the source tree under test
    from conversion.glm import Glm4MoeModel  # after the sys.path set-up above: the source tree under test

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
