"""Tokenizer wrapper over the ``tokenizers`` library (``tokenizer.json`` in the model directory)."""
from __future__ import annotations

import os


class Tokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok  # lazy: tokenizers
        self._tok = _Tok.from_file(path)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "Tokenizer | None":
        path = os.path.join(model_dir, "tokenizer.json")
        return cls(path) if os.path.exists(path) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
