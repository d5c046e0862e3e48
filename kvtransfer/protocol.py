"""Wire format of the KV data plane: frames, header schemas, limits, checksums, versions.

A frame is a fixed 16-byte prefix, a msgpack header (a map; never pickle, no ext types)
and, for LAYER frames only, raw tensor bytes::

    prefix  !4sIQ   magic b"PDKV", header_len (u32), payload_len (u64)
    header  msgpack {"t": FrameType, ...fields of that type}
    payload payload_len bytes (LAYER: per component rows, then per component fp32 scales)

Both lengths are checked against limits before a byte of the header is read, and the
header against an exact schema (keys, types, ranges) before its payload is accepted, so a
hostile peer can make us allocate at most ``MAX_HEADER_BYTES`` and never write outside
the pages its ticket names. Page ids and generation counters travel packed as
little-endian u32 (``pack_u32``) so frames for 4096 pages stay ~32 KiB.

Handshake (S = sender on prefill, R = receiver on decode)::

    S -> R  HELLO      v=protocol version, n=sender nonce
    R -> S  CHALLENGE  n=receiver nonce, p=HMAC(secret, "receiver" | n_s | n_r)   (auth.py)
    S -> R  AUTH       p=HMAC(secret, "sender" | n_s | n_r), info={layout, versions, host, options}
    R -> S  READY      info={layout, versions, host, receiver id, shm segment}   or ERROR + close
"""
from __future__ import annotations

import enum
import hashlib
import struct
import tomllib
import zlib
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import crc32c
import msgpack
import xxhash

from kvtransfer.config import ChecksumKind
from kvtransfer.errors import FailReason, ProtocolError, TransferError

PDSERVE_KV_PROTOCOL_VERSION = 3
"""3: FINISH carries the speculative draft state (``dh``, ``dc``)."""
MAGIC = b"PDKV"
PREFIX = struct.Struct("!4sIQ")
MAX_HEADER_BYTES = 64 * 1024
"""Largest header after authentication (a LAYER header for 4096 pages is ~33 KiB)."""
PREAUTH_MAX_HEADER_BYTES = 4096
"""Largest header before the peer has authenticated: strangers get little of our memory."""
MAX_PAGES_PER_FRAME = 4096
MAX_REQ_ID_LEN = 256
MAX_DETAIL_LEN = 2048
MAX_DRAFT_BYTES = 48 * 1024
"""Largest draft state a FINISH carries (GLM-5: hidden 6144 in bf16 is 12 KiB, in fp32 24 KiB)."""
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
TRAILER = struct.Struct("<Q")
"""A LAYER payload's trailing checksum (little-endian u64; CRCs use its low 32 bits)."""
U32_MAX = 2**32 - 1
U63_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


def _pdserve_version() -> str:
    """The installed package version, else the source tree's pyproject version."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"


PDSERVE_VERSION = _pdserve_version()


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    READY = 4
    ERROR = 5
    """Connection-level failure (auth, handshake, framing); the sender of it closes the connection."""
    LAYER = 10
    """TCP: one layer's rows for tokens [ts, te) of one request, payload attached. With ``tr`` the payload
    ends in ``TRAILER`` (the checksum, of the kind announced at the handshake, of the bytes before it):
    the sender hashes each piece just before its ``sendall``, while the piece is in cache, instead of
    reading the whole frame once more before its header can go out."""
    SHM_OPEN = 11
    """shm: the sender asks for a write lease on a request's pages before copying into them
    (naming all of them and their generations by digest: ``pages_digest``); sent by ``KVSender.open``
    when the prefill worker starts the request's forward, else by its first layer."""
    SHM_OPENED = 12
    SHM_LAYER = 13
    """shm: one layer's rows for [ts, te) were copied into the receiver's pages."""
    FINISH = 20
    """Every layer was sent; with ``dh`` the speculative draft state the ticket asks for (``DraftLayout``) and
    ``dc`` its checksum (the handshake's TCP kind; None when that is none)."""
    DONE = 21
    ABORT = 22
    """Either side gives up one request (reason + detail); for shm it also ends the sender's lease."""
    ABORT_ACK = 23
    """shm: the sender confirms it will not write into an aborted request's pages again."""


# --- header schemas -----------------------------------------------------------------------------

Check = Callable[[Any], bool]


def _int(lo: int, hi: int) -> Check:
    return lambda v: type(v) is int and lo <= v <= hi


def _str(max_len: int) -> Check:
    return lambda v: type(v) is str and 0 < len(v) <= max_len


def _text(max_len: int) -> Check:
    return lambda v: type(v) is str and len(v) <= max_len


def _bin(max_len: int, exact: bool = False) -> Check:
    return lambda v: type(v) is bytes and (len(v) == max_len if exact else len(v) <= max_len)


def _u32s(v: Any) -> bool:
    return type(v) is bytes and 0 < len(v) <= 4 * MAX_PAGES_PER_FRAME and len(v) % 4 == 0


def _bool(v: Any) -> bool:
    return type(v) is bool


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _map(v: Any) -> bool:
    return type(v) is dict and len(v) <= 32 and all(type(k) is str for k in v)


_RID, _TID = _str(MAX_REQ_ID_LEN), _str(64)
_TOKEN = _int(0, U32_MAX)
_REQ = {"rid": _RID, "tid": _TID}
_SPAN = {"l": _int(0, 65535), "ts": _TOKEN, "te": _TOKEN, "pg": _u32s, "gn": _u32s}
_REASON = {"reason": _str(32), "detail": _text(MAX_DETAIL_LEN)}

SCHEMAS: dict[FrameType, dict[str, Check]] = {
    FrameType.HELLO: {"v": _int(0, U32_MAX), "n": _bin(NONCE_BYTES, exact=True)},
    FrameType.CHALLENGE: {"n": _bin(NONCE_BYTES, exact=True), "p": _bin(PROOF_BYTES, exact=True)},
    FrameType.AUTH: {"p": _bin(PROOF_BYTES, exact=True), "info": _map},
    FrameType.READY: {"info": _map},
    FrameType.ERROR: dict(_REASON),
    FrameType.LAYER: {**_REQ, **_SPAN, "tr": _bool},
    FrameType.SHM_OPEN: {**_REQ, "dg": _bin(32, exact=True)},
    FrameType.SHM_OPENED: dict(_REQ),
    FrameType.SHM_LAYER: {**_REQ, **_SPAN, "crc": _opt(_int(0, U64_MAX))},
    FrameType.FINISH: {**_REQ, "nt": _TOKEN, "dh": _opt(_bin(MAX_DRAFT_BYTES)), "dc": _opt(_int(0, U64_MAX))},
    FrameType.DONE: {**_REQ, "nb": _int(0, U63_MAX)},
    FrameType.ABORT: {**_REQ, **_REASON},
    FrameType.ABORT_ACK: dict(_REQ),
}
PAYLOAD_FRAMES = frozenset({FrameType.LAYER})


class FramePrefix(NamedTuple):
    header_len: int
    payload_len: int


class Header(NamedTuple):
    type: FrameType
    fields: dict[str, Any]


def encode_frame(ftype: FrameType, fields: dict[str, Any], payload_len: int = 0) -> bytes:
    """Prefix + msgpack header; the caller sends ``payload_len`` payload bytes after it."""
    header = msgpack.packb({"t": int(ftype), **fields}, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(header), payload_len) + header


def decode_prefix(buf: bytes | memoryview, max_header: int, max_payload: int) -> FramePrefix:
    magic, header_len, payload_len = PREFIX.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(FailReason.BAD_FRAME, f"bad magic {bytes(magic)!r}")
    if not 0 < header_len <= max_header:
        raise ProtocolError(FailReason.BAD_FRAME, f"header_len {header_len} outside (0, {max_header}]")
    if payload_len > max_payload:
        raise ProtocolError(FailReason.BAD_FRAME, f"payload_len {payload_len} > limit {max_payload}")
    return FramePrefix(header_len, payload_len)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed")


def decode_header(buf: bytes | memoryview, payload_len: int) -> Header:
    """Parse and validate one header against its schema (exact keys, types, ranges)."""
    try:
        obj = msgpack.unpackb(buf, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_ext,
                              max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                              max_array_len=MAX_PAGES_PER_FRAME, max_map_len=64, max_ext_len=0)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, ValueError...)
        raise ProtocolError(FailReason.BAD_FRAME, f"undecodable header: {type(e).__name__}") from None
    if type(obj) is not dict or type(obj.get("t")) is not int:
        raise ProtocolError(FailReason.BAD_FRAME, "header is not a map with an integer 't'")
    try:
        ftype = FrameType(obj.pop("t"))
    except ValueError:
        raise ProtocolError(FailReason.BAD_FRAME, "unknown frame type") from None
    schema = SCHEMAS[ftype]
    if obj.keys() != schema.keys():
        raise ProtocolError(FailReason.BAD_FRAME, f"{ftype.name} fields {sorted(obj)} != {sorted(schema)}")
    for key, check in schema.items():
        if not check(obj[key]):
            raise ProtocolError(FailReason.BAD_FRAME, f"{ftype.name} field {key!r} out of bounds")
    if payload_len and ftype not in PAYLOAD_FRAMES:
        raise ProtocolError(FailReason.BAD_FRAME, f"{ftype.name} frames carry no payload, got {payload_len} bytes")
    return Header(ftype, obj)


def pack_u32(values: Iterable[int]) -> bytes:
    vals = list(values)
    return struct.pack(f"<{len(vals)}I", *vals)


def unpack_u32(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def pages_digest(page_bytes: bytes, gen_bytes: bytes) -> bytes:
    """SHA-256 of a whole reservation's packed page ids and generations (SHM_OPEN: any length fits)."""
    return hashlib.sha256(page_bytes + gen_bytes).digest()


class _Crc:
    """A CRC continued over pieces: ``update(data)``, ``intdigest()``, like xxhash's streaming objects."""

    __slots__ = ("_fn", "_crc")

    def __init__(self, fn: Callable[[Any, int], int]) -> None:
        self._fn, self._crc = fn, 0

    def update(self, data: memoryview) -> None:
        self._crc = self._fn(data, self._crc)

    def intdigest(self) -> int:
        return self._crc


def new_digest(kind: ChecksumKind) -> Any:
    """A fresh streaming ``kind`` checksum (``update(data)`` over the payload's bytes in order, any split,
    then ``intdigest()``), or None when checksums are off. All kinds release the GIL on large buffers."""
    if kind is ChecksumKind.NONE:
        return None
    if kind is ChecksumKind.XXH3:
        return xxhash.xxh3_64()
    return _Crc(crc32c.crc32c if kind is ChecksumKind.CRC32C else zlib.crc32)


def checksum(kind: ChecksumKind, views: Iterable[memoryview]) -> int | None:
    """The ``kind`` checksum over the views' bytes in order (None when checksums are off); see ``ChecksumKind``
    for the cost of each."""
    views = list(views)
    if kind is ChecksumKind.XXH3 and len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    digest = new_digest(kind)
    if digest is None:
        return None
    for v in views:
        digest.update(v)
    return digest.intdigest()


# --- handshake compatibility --------------------------------------------------------------------

def peer_info(layout_dict: dict, tp_size: int = 1, kv_split: bool = False, **extra: Any) -> dict[str, Any]:
    """What a peer announces about itself in AUTH / READY: versions, the page layout of rank 0's pool and the
    worker's tensor-parallel KV layout (``kv_tp``: ranks, and whether each rank holds a slice of every token)."""
    return {"protocol": PDSERVE_KV_PROTOCOL_VERSION, "pdserve": PDSERVE_VERSION, "layout": layout_dict,
            "kv_tp": [tp_size, kv_split], **extra}


def check_compatible(local: dict[str, Any], remote: dict[str, Any]) -> None:
    """Raise ``TransferError(INCOMPATIBLE)`` listing every difference that would corrupt pages."""
    problems = []
    for key in ("protocol", "pdserve"):
        if remote.get(key) != local[key]:
            problems.append(f"{key} version: local {local[key]!r} != peer {remote.get(key)!r}")
    mine, theirs = local["layout"], remote.get("layout")
    if type(theirs) is not dict:
        problems.append("peer sent no layout")
    else:
        for key in ("model_type", "num_layers", "page_size", "kv_dtype"):
            if theirs.get(key) != mine[key]:
                problems.append(f"{key}: local {mine[key]!r} != peer {theirs.get(key)!r}")
        if theirs.get("components") != mine["components"]:
            problems.append(f"components (name, per-token shape = head dims): local {mine['components']!r} "
                            f"!= peer {theirs.get('components')!r}")
    (my_tp, my_split), (their_tp, their_split) = local.get("kv_tp", [1, False]), remote.get("kv_tp", [1, False])
    if my_split or their_split:  # rank 0 holds only its heads: pages would arrive with the wrong heads or half
        problems.append(f"tensor-parallel KV layout: local {my_tp} rank(s){' with split KV heads' * my_split}, "
                        f"peer {their_tp} rank(s){' with split KV heads' * their_split}; KV transfer needs every "
                        f"token's whole KV on rank 0 (MLA, or tp 1 for GQA models): per-rank GQA head "
                        f"gather/scatter is not implemented")
    if problems:
        raise TransferError(FailReason.INCOMPATIBLE, "incompatible KV peer: " + "; ".join(problems))
