"""One KV page as a file: the disk tier's format (``prefill.disk_cache`` names and indexes the files).

::

    header   "<8sQQQII": b"PDSKV001", layout hash, block hash, parent hash, page size, payload bytes
    chunk    page size x uint32: the token ids the page holds the KV of
    payload  the page's bytes, as a ``HostPagePool`` slot (every layer and component, fp8 scales, the MTP layer)
    trailer  uint64: xxh3-64 of header, chunk and payload, seeded with block hash ^ layout hash

A file is written to ``<path>.tmp`` and renamed onto ``path`` (atomic on POSIX): a reader finds no file or a whole
one; what an OS crash may leave half-written fails its checksum (there is no fsync: a lost page is recomputed).
"""
from __future__ import annotations

import os
import struct
from typing import NamedTuple

import torch
import xxhash

MAGIC = b"PDSKV001"
HEADER = struct.Struct("<8sQQQII")
TRAILER = struct.Struct("<Q")
TMP_SUFFIX = ".tmp"


class PageHeader(NamedTuple):
    parent_hash: int
    chunk: tuple[int, ...]


class PageFile:
    """Reads and writes the page files of one pool layout (``layout_hash``, ``page_size`` tokens, ``page_bytes``)."""

    def __init__(self, layout_hash: int, page_size: int, page_bytes: int) -> None:
        self.layout_hash, self.page_size, self.page_bytes = layout_hash, page_size, page_bytes
        self._chunk = struct.Struct(f"<{page_size}I")
        self.head_bytes = HEADER.size + self._chunk.size
        self.file_bytes = self.head_bytes + page_bytes + TRAILER.size
        """The size of every file of this layout."""

    def _seed(self, h: int) -> int:
        return (h ^ self.layout_hash) & (2**64 - 1)

    def write(self, path: str, h: int, parent: int, chunk: tuple[int, ...], row: torch.Tensor) -> None:
        """Write page ``h`` (``row``: its ``[page_bytes]`` uint8 on the CPU) to ``path``, atomically."""
        head = HEADER.pack(MAGIC, self.layout_hash, h, parent, self.page_size, self.page_bytes) + \
            self._chunk.pack(*chunk)
        payload = row.numpy()
        digest = xxhash.xxh3_64(head, seed=self._seed(h))
        digest.update(payload)
        tmp = path + TMP_SUFFIX
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(TRAILER.pack(digest.intdigest()))
            os.replace(tmp, path)
        except BaseException:
            unlink(tmp)
            raise

    def parse(self, head: bytes, h: int) -> PageHeader | None:
        """What a file's header says, None unless it is page ``h`` of this layout."""
        if len(head) != self.head_bytes:
            return None
        magic, layout, bh, parent, page_size, payload = HEADER.unpack_from(head)
        if (magic, layout, bh, page_size, payload) != (MAGIC, self.layout_hash, h, self.page_size, self.page_bytes):
            return None
        return PageHeader(parent, self._chunk.unpack_from(head, HEADER.size))

    def read_header(self, path: str, h: int) -> PageHeader | None:
        """The header of ``path`` (None unless it is a whole-sized file of page ``h``): the payload is not read."""
        try:
            if os.path.getsize(path) != self.file_bytes:
                return None
            with open(path, "rb") as f:
                return self.parse(f.read(self.head_bytes), h)
        except OSError:
            return None

    def read(self, path: str, h: int, expect: PageHeader, out: torch.Tensor) -> str:
        """Read page ``h``'s payload into ``out`` (``[page_bytes]`` uint8 on the CPU) and verify the whole file
        against ``expect``; -> '' when it checks out, else why not."""
        try:
            with open(path, "rb") as f:
                head = f.read(self.head_bytes)
                got = f.readinto(out.numpy())
                trailer = f.read(TRAILER.size + 1)
        except OSError as ex:
            return f"is unreadable ({ex.strerror or ex})"
        if len(head) != self.head_bytes or got != self.page_bytes or len(trailer) != TRAILER.size:
            return "is truncated or too long"
        if self.parse(head, h) != expect:
            return "has the header of another page"
        digest = xxhash.xxh3_64(head, seed=self._seed(h))
        digest.update(out.numpy())
        if digest.intdigest() != TRAILER.unpack(trailer)[0]:
            return "failed its checksum"
        return ""


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
