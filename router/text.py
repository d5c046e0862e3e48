"""Text in and out of the router with the ``tokenizers`` library (no torch): prompt encoding and streamed
text deltas that never split a multi-byte character."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


class TextCodec:
    """``tokenizer.json`` of the served model; encodes like ``engine.tokenizer.Tokenizer`` (no special tokens)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # lazy: tokenizers
        self._tok = Tokenizer.from_file(path)

    @classmethod
    def from_model_dir(cls, model_dir: str | None) -> "TextCodec | None":
        if not model_dir:
            return None
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            return None
        try:
            return cls(path)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer disables text, it does not stop the router
            logger.warning("cannot load %s (%s): text prompts and text deltas are off", path, e)
            return None

    def encode(self, text: str) -> list[int]:
        """Thread-safe; lets other threads run meanwhile (``encode_batch`` releases the GIL, ``encode``
        holds it for the whole text: ~3 s for 8 MB of words)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class Detokenizer:
    """Incremental detokenization (the prefix/read-offset scheme of vLLM): each call returns the new text of
    the tokens so far, holding back a trailing incomplete character (U+FFFD) until later tokens complete it.
    The concatenated deltas plus ``flush()`` equal ``decode(all ids)`` for byte-level tokenizers."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0   # start of the window decoded for context
        self._read = 0     # tokens whose text has been returned

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.codec.decode(self.ids[self._prefix:self._read])
        new_text = self.codec.decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end is returned as is)."""
        prefix_text = self.codec.decode(self.ids[self._prefix:self._read])
        new_text = self.codec.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]
