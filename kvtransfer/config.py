"""Configuration of the KV data plane (receiver on decode workers, sender on prefill workers).

``PDSERVE_CLUSTER_SECRET`` (read by ``common.env``) is the default of both configs' ``cluster_secret``.
"""
from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

from common import env, flags
from common.net import is_loopback

MIN_SECRET_BYTES = 16
MIB = 1 << 20
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
"""The Mooncake transfer engine's protocols (``--mooncake-protocol``)."""


class TransportKind(enum.Enum):
    """How a sender moves bytes to one receiver."""

    AUTO = "auto"
    """Shared memory when the receiver is on this host and its pool is shm-backed, else TCP."""
    TCP = "tcp"
    """Always TCP (the payload goes through the socket)."""
    SHM = "shm"
    """Try shared memory even when host ids differ (e.g. containers sharing /dev/shm); TCP on failure."""
    MOONCAKE = "mooncake"
    """Mooncake's transfer engine writes into the receiver's registered pages (``mooncake.py``: TCP or RDMA);
    TCP when the receiver offers none or the engine cannot start."""


class WireDType(enum.Enum):
    """Element type of the TCP payload."""

    NATIVE = "native"
    """The pool's own dtype: pages arrive bit-identical."""
    FP8_E4M3 = "fp8_e4m3"
    """bf16/fp16/fp32 pools only: per-token fp8 + fp32 scale on the wire (halves bf16 bytes, lossy)."""


class ChecksumKind(enum.Enum):
    """Payload checksum. The sender announces its kinds in the handshake; the receiver verifies with them.

    XXH3-64 (the default; zstd's and rsync's hash, SIMD) runs ~28 GiB/s per core on cache-hot data on the
    2-core dev box; CRC-32C (Castagnoli, the iSCSI / ext4 / RDMA one, on the CPU's CRC instruction) ~17 GiB/s;
    ``zlib.crc32`` ~3.4 GiB/s, about the speed of loopback TCP itself. Every byte is read once more on
    each side for the check, so its speed bounds the transfer on a machine whose cores also do the copies.
    Both XXH3 and CRC-32C detect any burst of corrupted bits a broken NIC, driver or DMA would produce
    (XXH3 with probability 1 - 2^-64 for random corruption; it is not a MAC: authentication is the HMAC
    handshake's job)."""

    XXH3 = "xxh3"
    CRC32C = "crc32c"
    CRC32 = "crc32"
    NONE = "none"


def secret_from_env() -> bytes | None:
    """``PDSERVE_CLUSTER_SECRET`` as bytes, or None when unset or empty."""
    value = env.cluster_secret()
    return value.encode() if value else None


def _check_secret(secret: bytes | None) -> None:
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"cluster_secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES}")


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


DRAFT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class DraftLayout:
    """The speculative draft state a decode worker asks prefill to ship with a request's KV (MTP): the MTP
    layer's normed output at the prompt's last pair (``engine.speculative.seq.SpecSeq.draft_hidden``), so the first
    decode round after the transfer already speculates. It travels in FINISH, checksummed like a payload;
    a FINISH without it (a prefill worker that has no MTP layer, or an older one) fails the transfer."""

    hidden_size: int
    """Values in the state (the model's hidden size)."""
    dtype: str
    """Their dtype on the wire: the decode worker's compute dtype (``float32``, ``bfloat16``, ``float16``)."""

    def __post_init__(self) -> None:
        if self.dtype not in DRAFT_DTYPE_BYTES:
            raise ValueError(f"draft dtype must be one of {sorted(DRAFT_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.hidden_size < 1:
            raise ValueError(f"draft hidden_size must be >= 1, got {self.hidden_size}")

    @property
    def num_bytes(self) -> int:
        return self.hidden_size * DRAFT_DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, object]:
        return {"hidden_size": self.hidden_size, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, object] | None) -> "DraftLayout | None":
        return None if d is None else cls(int(d["hidden_size"]), str(d["dtype"]))  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class KVReceiverConfig:
    """Decode side: where to listen, how long reservations live, what frames to accept."""

    host: str = "127.0.0.1"
    """Bind address. Anything but loopback requires a cluster secret."""
    port: int = 0
    """Bind port; 0 picks a free one (read it back from ``KVReceiver.address``)."""
    advertise_host: str | None = None
    """Host written into tickets for senders to connect to; defaults to ``host``."""
    cluster_secret: bytes | None = field(default_factory=secret_from_env)
    """Shared secret for the mutual HMAC handshake; defaults to ``$PDSERVE_CLUSTER_SECRET``."""
    tp_size: int = 1
    """Rank processes of this worker (tensor parallelism); announced in the handshake."""
    kv_split: bool = False
    """Each rank's pool holds a slice of every token's KV (GQA heads under tensor parallelism) instead of all
    of it (MLA's replicated latent, or tp 1): rank 0 alone cannot ship or take a whole token's KV."""
    ticket_ttl_s: float = 60.0
    """A reservation that receives no frame within this long is freed (EXPIRED)."""
    draft: DraftLayout | None = None
    """The draft state every ticket asks for (a speculating decode worker); None: KV only."""
    stall_timeout_s: float = 10.0
    """A transfer that started but makes no progress for this long is freed (STALLED)."""
    claim_timeout_s: float = 60.0
    """A completed transfer nobody claims with ``wait_complete`` is freed after this long."""
    handshake_timeout_s: float = 5.0
    """A connection that has not authenticated within this long is closed."""
    reap_interval_s: float = 0.1
    """Period of the reaper that enforces the three timeouts above."""
    max_connections: int = 64
    """Authenticated connections beyond which a newly authenticated peer is refused (ERROR busy). Connections
    still in the handshake never count here (``admission.py``)."""
    max_unauthenticated: int = 32
    """Connections still in the handshake; when full, a new one closes the oldest of them."""
    unauth_rate_per_s: float = 64.0
    """New connections accepted per second and source host (token bucket); the rest are closed at once."""
    unauth_burst: int = 64
    """Connections a source host may open at once before ``unauth_rate_per_s`` applies."""
    log_interval_s: float = 10.0
    """Refused, evicted and timed-out handshakes log at most one line per kind per interval, with a count."""
    max_frame_bytes: int = 256 * MIB
    """Largest payload one frame may carry."""
    max_reserved_pages: int | None = None
    """Cap on pages held by reservations, so incoming transfers cannot starve running decodes."""
    require_checksum: bool = True
    """Reject TCP senders that do not checksum their payloads."""
    socket_buffer_bytes: int = 4 * MIB
    """SO_RCVBUF / SO_SNDBUF; 0 leaves the kernel's autotuning alone."""
    offer_shm: bool = True
    """Offer a shm-backed pool to senders on the same host."""
    mooncake_protocol: str | None = None
    """Offer Mooncake transfer-engine writes into this pool to senders that ask (``tcp`` or ``rdma``);
    None: not offered. Needs the ``pdserve[mooncake]`` extra and a host-memory pool."""
    remote_writer_grace_s: float = 5.0
    """A one-sided writer on another host (Mooncake) whose connection was lost without acknowledging an
    abort is trusted to have stopped after this long (its pid cannot be checked from here); then the
    reservation's pages are freed."""

    def __post_init__(self) -> None:
        _check_secret(self.cluster_secret)
        if not self.cluster_secret and not is_loopback(self.host):
            raise ValueError(f"refusing to bind the KV data plane to {self.host!r} without a cluster secret: "
                             f"set {env.CLUSTER_SECRET} or cluster_secret, or bind to 127.0.0.1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _check_positive(self, "ticket_ttl_s", "stall_timeout_s", "claim_timeout_s", "handshake_timeout_s",
                        "reap_interval_s", "max_connections", "max_frame_bytes", "max_unauthenticated",
                        "unauth_rate_per_s", "unauth_burst", "log_interval_s", "remote_writer_grace_s")
        if self.mooncake_protocol is not None and self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake_protocol must be None, 'tcp' or 'rdma', got {self.mooncake_protocol!r}")
        if self.max_reserved_pages is not None and self.max_reserved_pages < 1:
            raise ValueError(f"max_reserved_pages must be >= 1 or None, got {self.max_reserved_pages}")
        if self.socket_buffer_bytes < 0:
            raise ValueError(f"socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes}")

    @property
    def ticket_host(self) -> str:
        return self.advertise_host or self.host


@dataclass(frozen=True, slots=True)
class KVSenderConfig:
    """Prefill side: how to reach receivers, what to put on the wire, how long to wait."""

    cluster_secret: bytes | None = field(default_factory=secret_from_env)
    """Shared secret for the mutual HMAC handshake; defaults to ``$PDSERVE_CLUSTER_SECRET``."""
    transport: TransportKind = TransportKind.AUTO
    """Per receiver: shm when possible (AUTO), forced TCP, or shm attempted (falls back to TCP)."""
    tp_size: int = 1
    """Rank processes of this worker (tensor parallelism); announced in the handshake."""
    kv_split: bool = False
    """Each rank's pool holds a slice of every token's KV (GQA heads under tensor parallelism) instead of all
    of it (MLA's replicated latent, or tp 1): rank 0 alone cannot ship or take a whole token's KV."""
    wire_dtype: WireDType = WireDType.NATIVE
    """TCP payload dtype; FP8_E4M3 halves bf16 bytes at the cost of exactness."""
    checksum: ChecksumKind = ChecksumKind.XXH3
    """Checksum of TCP payloads."""
    shm_checksum: ChecksumKind = ChecksumKind.NONE
    """Checksum of shm copies: off by default, the bytes never leave this host's memory and the
    check would cost more than the copy (one extra read on each side)."""
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    connect_retry_s: float = 15.0
    """A connection the receiver refuses (ERROR busy / timeout) or resets (its limits, see ``admission.py``) is
    retried for at most this long, and never past the latest expiry of the tickets waiting for it. Nothing
    listening (ECONNREFUSED) and connect timeouts are not retried: the caller fails over at once."""
    connect_backoff_s: float = 0.05
    """First wait before a retried connect; doubles per attempt."""
    connect_backoff_max_s: float = 1.0
    """Longest wait between two connect attempts."""
    send_timeout_s: float = 30.0
    """One frame must be fully written within this long, else the connection is declared stalled."""
    finish_timeout_s: float = 60.0
    """From FINISH to the receiver's DONE."""
    enqueue_timeout_s: float = 30.0
    """``send_layer`` blocks at most this long when ``max_pending_frames`` are queued."""
    max_pending_frames: int = 64
    """Layer sends queued but not yet written, over all receivers (bounded memory and concurrency)."""
    max_frame_bytes: int = 64 * MIB
    """Larger layer sends are split into several frames."""
    socket_buffer_bytes: int = 4 * MIB
    """SO_SNDBUF / SO_RCVBUF; 0 leaves the kernel's autotuning alone."""
    release_retries: int = 6
    """After a lost connection with shm leases out, reconnect up to this many times (backoff from
    ``release_backoff_s``, doubling) to tell the receiver we stopped writing, so it frees those pages now
    instead of when this process exits."""
    release_backoff_s: float = 0.1
    mooncake_protocol: str = "tcp"
    """With ``transport=MOONCAKE``: the transfer engine's protocol, ``tcp`` or ``rdma``."""

    def __post_init__(self) -> None:
        _check_secret(self.cluster_secret)
        _check_positive(self, "connect_timeout_s", "handshake_timeout_s", "send_timeout_s", "finish_timeout_s",
                        "enqueue_timeout_s", "max_pending_frames", "max_frame_bytes", "release_backoff_s",
                        "connect_retry_s", "connect_backoff_s", "connect_backoff_max_s")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake_protocol must be 'tcp' or 'rdma', got {self.mooncake_protocol!r}")
        if self.release_retries < 0:
            raise ValueError(f"release_retries must be >= 0, got {self.release_retries}")
        if self.socket_buffer_bytes < 0:
            raise ValueError(f"socket_buffer_bytes must be >= 0, got {self.socket_buffer_bytes}")


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """The KV transport flags, accepted by prefill and decode workers alike (a launcher passes the same extra
    arguments to both). Prefill: how to send. Decode: ``mooncake`` offers Mooncake writes into its pool (TCP
    and shm are always accepted)."""

    kv_transport: str = TransportKind.AUTO.value
    """KV transfer transport: auto (shm on the same host, else tcp), tcp, shm, or mooncake (the transfer engine
    of pdserve[mooncake]; falls back to tcp with a warning)"""
    mooncake_protocol: str = "tcp"
    """with --kv-transport mooncake: the transfer engine's protocol"""


def add_transport_args(p: argparse.ArgumentParser) -> None:
    """``--kv-transport`` and ``--mooncake-protocol`` (the fields of ``TransportConfig``)."""
    flags.add_config_args(p, TransportConfig, choices={"kv_transport": tuple(k.value for k in TransportKind),
                                                       "mooncake_protocol": MOONCAKE_PROTOCOLS})


def receiver_mooncake_protocol(args: argparse.Namespace | TransportConfig) -> str | None:
    """``KVReceiverConfig.mooncake_protocol`` from the flags of ``add_transport_args``."""
    return args.mooncake_protocol if args.kv_transport == TransportKind.MOONCAKE.value else None
