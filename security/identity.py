"""A peer's identity: the libp2p private key file that fixes its peer ID, used to sign messages.

Signatures are bound to the peer ID the way libp2p binds keys to IDs: the ID is the
multihash of the protobuf-encoded public key (the key itself for Ed25519, its SHA-256
for RSA), so anyone holding a message, its signer's public key and the claimed peer ID
can check all three without asking the network. Both key types libp2p daemons use are
supported: RSA (what hivemind writes to `identity_path`) and Ed25519.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

from phalanx.errors import ConfigError, PeerProtocolError

_RSA, _ED25519 = 0, 1  # libp2p crypto.proto KeyType values
MAX_PUBLIC_KEY_BYTES = 1024  # an RSA-4096 SubjectPublicKeyInfo is ~550 bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_key(key_type: int, data: bytes) -> bytes:
    """libp2p's protobuf key message: {1: KeyType, 2: bytes Data}."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def decode_key(message: bytes) -> tuple[int, bytes]:
    key_type, data, pos = None, None, 0
    while pos < len(message):
        tag, pos = read_varint(message, pos)
        if tag == 0x08:
            key_type, pos = read_varint(message, pos)
        elif tag == 0x12:
            length, pos = read_varint(message, pos)
            if pos + length > len(message):
                raise ValueError("truncated key data")
            data, pos = message[pos : pos + length], pos + length
        else:
            raise ValueError(f"unexpected field tag {tag}")
    if key_type is None or data is None:
        raise ValueError("key message lacks type or data")
    return key_type, data


@functools.lru_cache(maxsize=1024)  # every signature check derives it; a round sees a handful of keys
def peer_id_of(public_key_message: bytes) -> str:
    """The base58 peer ID of a protobuf-encoded public key (libp2p peer-ids spec)."""
    if len(public_key_message) <= 42:
        multihash = b"\x00" + _varint(len(public_key_message)) + public_key_message  # identity
    else:
        multihash = b"\x12\x20" + hashlib.sha256(public_key_message).digest()  # sha2-256
    return base58.b58encode(multihash).decode()


def is_peer_id(text: str) -> bool:
    """Whether `text` is a base58 libp2p peer ID (an identity or SHA-256 multihash of a key)."""
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    if raw[:2] == b"\x12\x20":
        return len(raw) == 34
    if raw[:1] == b"\x00":
        try:
            length, pos = read_varint(raw, 1)
        except ValueError:
            return False
        return length == len(raw) - pos and length > 0
    return False


@dataclass(frozen=True)
class Identity:
    """A loaded private key. `public_key` is the protobuf message other peers verify against."""

    private_key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
    public_key: bytes
    peer_id: str

    @classmethod
    def load(cls, path: Path | str) -> "Identity":
        try:
            key_type, data = decode_key(Path(path).read_bytes())
            if key_type == _RSA:
                private = serialization.load_der_private_key(data, password=None)
                spki = private.public_key().public_bytes(
                    serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
                )
                public = encode_key(_RSA, spki)
            elif key_type == _ED25519:
                private = ed25519.Ed25519PrivateKey.from_private_bytes(data[:32])  # libp2p stores seed ‖ public
                raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
                public = encode_key(_ED25519, raw)
            else:
                raise ValueError(f"key type {key_type} is not supported (RSA or Ed25519 only)")
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"--identity-path: cannot read a libp2p private key from {str(path)!r}: {e}") from None
        return cls(private, public, peer_id_of(public))

    @staticmethod
    def generate_ed25519(path: Path | str) -> "Identity":
        """Write a new Ed25519 identity file (mode 0600) and load it."""
        private = ed25519.Ed25519PrivateKey.generate()
        seed = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        path = Path(path)
        path.touch(mode=0o600, exist_ok=False)
        path.write_bytes(encode_key(_ED25519, seed + raw))
        return Identity.load(path)

    def sign(self, data: bytes) -> bytes:
        if isinstance(self.private_key, rsa.RSAPrivateKey):
            return self.private_key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        return self.private_key.sign(data)


class _Verified:
    """Signatures already checked, by (key, SHA-256 of the data, signature): a verified round checks
    each statement several times (as it arrives, then echoed inside others' reveals and reports)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: dict[tuple[bytes, bytes, bytes], None] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[bytes, bytes, bytes]) -> bool:
        return key in self._seen

    def add(self, key: tuple[bytes, bytes, bytes]) -> None:
        with self._lock:
            self._seen[key] = None
            if len(self._seen) > self.size:
                del self._seen[next(iter(self._seen))]  # the oldest


_verified = _Verified(4096)


def verify(peer_id: str, public_key: bytes, data: bytes, signature: bytes) -> None:
    """Raise PeerProtocolError unless `signature` over `data` was made by the key behind `peer_id`."""
    if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > 1024:
        raise PeerProtocolError("oversized key or signature", peer=peer_id)
    if peer_id_of(public_key) != peer_id:
        raise PeerProtocolError("public key does not belong to the claimed peer ID", peer=peer_id)
    key = (public_key, hashlib.sha256(data).digest(), signature)
    if key in _verified:
        return
    _check_signature(public_key, data, signature, peer_id)
    _verified.add(key)


def _check_signature(public_key: bytes, data: bytes, signature: bytes, peer_id: str) -> None:
    try:
        key_type, data_bytes = decode_key(public_key)
        if key_type == _RSA:
            key = serialization.load_der_public_key(data_bytes)
            if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 2048:
                raise ValueError("weak or non-RSA key")
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        elif key_type == _ED25519:
            ed25519.Ed25519PublicKey.from_public_bytes(data_bytes).verify(signature, data)
        else:
            raise ValueError("unsupported key type")
    except InvalidSignature:
        raise PeerProtocolError("bad signature", peer=peer_id) from None
    except (ValueError, TypeError) as e:
        raise PeerProtocolError(f"unusable public key: {e}", peer=peer_id) from None
