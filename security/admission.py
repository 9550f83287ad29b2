"""Admission to private swarms: an owner key signs certificates naming the peers it admits.

The owner keeps an Ed25519 private key; every peer of the swarm knows its public key
(`--admission owner.pub`). A certificate binds one peer ID to one run and an expiry;
peers refuse everything from a peer that shows no valid, unexpired certificate.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from pydantic import Field

from phalanx.errors import ConfigError, PeerProtocolError
from phalanx.security.wire import PeerIdStr, WireModel, pack, unpack

DOMAIN = b"phalanx-admission-v1\0"


class CertificateBody(WireModel):
    peer_id: PeerIdStr  # the admitted peer
    run_id: Annotated[str, Field(min_length=1, max_length=64)]  # the swarm it is admitted to
    issued_at: float  # unix time
    not_after: float  # unix time after which it is void


class Certificate(WireModel):
    body: Annotated[bytes, Field(max_length=1024)]  # pack(CertificateBody)
    signature: Annotated[bytes, Field(min_length=64, max_length=64)]  # owner's Ed25519 signature


def generate_owner_key(private_path: Path, public_path: Path) -> None:
    """Write a new owner key pair: the private key (PEM, mode 0600) and the public key to hand out."""
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(f"{path} already exists; refusing to overwrite a key")
    key = ed25519.Ed25519PrivateKey.generate()
    private_path.touch(mode=0o600)
    private_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def load_owner_private(path: Path) -> ed25519.Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--owner-key: cannot read an owner private key from {str(path)!r}: {e}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"--owner-key: {str(path)!r} is not an Ed25519 key made by `phalanx keygen --owner`")
    return key


def load_owner_public(path: Path) -> ed25519.Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--admission: cannot read an owner public key from {str(path)!r}: {e}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError(f"--admission: {str(path)!r} is not an Ed25519 public key made by `phalanx keygen --owner`")
    return key


def issue(owner: ed25519.Ed25519PrivateKey, peer_id: str, run_id: str, valid_s: float, *, now: float | None = None) -> bytes:
    now = time.time() if now is None else now
    body = pack(CertificateBody(peer_id=peer_id, run_id=run_id, issued_at=now, not_after=now + valid_s))
    return pack(Certificate(body=body, signature=owner.sign(DOMAIN + body)))


def open_certificate(owner: ed25519.Ed25519PublicKey, raw: bytes, *, peer_id: str, run_id: str) -> CertificateBody:
    """The body of `raw` if the owner signed it for `peer_id` and `run_id`, whenever it is valid;
    PeerProtocolError otherwise."""
    cert = unpack(raw, Certificate, peer=peer_id)
    try:
        owner.verify(cert.signature, DOMAIN + cert.body)
    except InvalidSignature:
        raise PeerProtocolError("certificate not signed by the swarm's owner", peer=peer_id) from None
    body = unpack(cert.body, CertificateBody, peer=peer_id)
    if body.peer_id != peer_id:
        raise PeerProtocolError("certificate of another peer", peer=peer_id)
    if body.run_id != run_id:
        raise PeerProtocolError(f"certificate for run {body.run_id!r}, not {run_id!r}", peer=peer_id)
    return body


def verify_certificate(
    owner: ed25519.Ed25519PublicKey, raw: bytes, *, peer_id: str, run_id: str, now: float | None = None
) -> CertificateBody:
    """The certificate's body if `raw` admits `peer_id` to `run_id` now; PeerProtocolError otherwise."""
    body = open_certificate(owner, raw, peer_id=peer_id, run_id=run_id)
    now = time.time() if now is None else now
    if not body.issued_at - 300 <= now <= body.not_after:
        raise PeerProtocolError("certificate expired or not yet valid", peer=peer_id)
    return body
