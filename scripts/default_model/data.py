"""Byte-level BPE tokenizer trained on the corpus' train files, and token windows for training.

Each file becomes ``<|bos|> source <|eos|>``; the files of a split are concatenated into one
token stream and training samples random windows from it (windows may cross file boundaries, so
the model also learns to start mid-file, as prompts without BOS do).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1
"""Special tokens come first in the vocabulary; config.json's bos/eos ids must equal these."""


def train_tokenizer(texts: list[str], vocab_size: int):
    """A GPT-2-style byte-level BPE (``tokenizers``); deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(BOS) != BOS_ID or tok.token_to_id(EOS) != EOS_ID:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """``[sum of (len + 2)]`` int64: ``BOS text EOS`` for every text, concatenated."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(torch.tensor([BOS_ID] + enc.ids + [EOS_ID], dtype=torch.int64))
    return torch.cat(parts)


class Windows(NamedTuple):
    inputs: torch.Tensor  # [B, T + extra] token windows; position i's targets are i + 1, i + 2, ...


def random_windows(stream: torch.Tensor, batch_size: int, window_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, window_len]`` windows at uniformly random offsets."""
    starts = torch.randint(0, stream.numel() - window_len, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + window_len] for s in starts.tolist()])


def strided_windows(stream: torch.Tensor, window_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows from the start of ``stream`` (deterministic evaluation batches)."""
    n = min(max_windows, stream.numel() // window_len)
    return stream[: n * window_len].view(n, window_len)
