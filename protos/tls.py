"""TLS for pdserve's gRPC and HTTP endpoints (``--tls-cert`` / ``--tls-key`` / ``--tls-ca``).

- The public plane (the router's gRPC port and its OpenAI-compatible HTTP port) serves the certificate;
  clients need no certificate of their own (the API key authenticates them).
- The internal plane (the workers' gRPC ports) serves the same certificate; with ``--tls-ca`` it is mutual
  TLS: a worker accepts only clients (the router) presenting a certificate signed by that CA, and the
  router verifies workers against it. Without ``--tls-ca`` the router trusts the certificate itself
  (one self-signed certificate for the whole cluster).
- The KV data plane (kvtransfer: TCP or shared memory) is not TLS. Each connection opens with a mutual
  HMAC-SHA256 challenge-response over fresh nonces (``kvtransfer/auth.py``), so a peer without the cluster
  secret can neither connect nor be connected to. After that handshake the frames are neither encrypted nor
  individually authenticated: the data plane moves gigabytes per second and TLS on it would cost CPU and
  copies on the path that matters most (Mooncake and NIXL make the same trade). An on-path attacker could
  read or alter KV bytes, so keep the data plane on a trusted network or host, or run the nodes over an
  encrypted overlay (WireGuard, IPsec). Shared memory never leaves the host.

Certificates must name the addresses clients dial (a SAN of ``IP:127.0.0.1`` and ``DNS:localhost`` for a
local cluster).
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class TLSConfig:
    cert_file: str
    """PEM certificate (chain) the servers present."""
    key_file: str
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM CA bundle: mutual TLS on the internal plane (workers require a client certificate it signed);
    None: the router trusts ``cert_file`` itself."""

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file), ("--tls-ca", self.ca_file)):
            if path is not None:
                try:
                    with open(path, "rb") as f:
                        head = f.read(64 * 1024)
                except OSError as e:
                    raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
                if b"-----BEGIN " not in head:
                    raise ValueError(f"{flag} {path}: not a PEM file")

    @staticmethod
    def _read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self, require_client_cert: bool = False) -> grpc.ServerCredentials:
        """What a gRPC server binds with; ``require_client_cert`` (internal plane with a CA): mutual TLS."""
        mutual = require_client_cert and self.ca_file is not None
        return grpc.ssl_server_credentials([(self._read(self.key_file), self._read(self.cert_file))],
                                           root_certificates=self._read(self.ca_file) if mutual else None,
                                           require_client_auth=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """What the router dials workers with: trusts the CA (or the certificate itself) and presents the
        certificate (used when workers require one)."""
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca_file or self.cert_file),
                                            private_key=self._read(self.key_file),
                                            certificate_chain=self._read(self.cert_file))

    def http_context(self) -> ssl.SSLContext:
        """The HTTP server's context (TLS 1.2 or later)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def tls_config(cert: str | None, key: str | None, ca: str | None) -> TLSConfig | None:
    """The three flags as a ``TLSConfig`` (None: plain text); ValueError for a half-given pair or a bad file."""
    if (cert is None) != (key is None):
        raise ValueError("give --tls-cert and --tls-key together")
    if cert is None:
        if ca is not None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key")
        return None
    return TLSConfig(cert, key, ca)


def bind(server: grpc.aio.Server, address: str, tls: TLSConfig | None, internal: bool = False) -> int:
    """``add_secure_port`` with ``tls`` (mutual TLS on the ``internal`` plane when it has a CA), else
    ``add_insecure_port``; returns the port (0: the bind failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials(require_client_cert=internal))


def channel(target: str, tls: TLSConfig | None, options) -> grpc.aio.Channel:
    """An asyncio channel to a worker, over TLS when ``tls`` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)
