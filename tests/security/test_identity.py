"""Identities: peer IDs derived exactly as libp2p does, signatures bound to them."""

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from phalanx.errors import ConfigError, PeerProtocolError
from phalanx.security.identity import Identity, verify


@pytest.fixture
def rsa_identity(tmp_path):
    path = tmp_path / "rsa.id"
    P2P.generate_identity(str(path))  # what hivemind writes for --identity-path
    return path


def test_rsa_identity_matches_hivemind(rsa_identity):
    identity = Identity.load(rsa_identity)
    assert identity.peer_id == PeerID.from_identity(rsa_identity.read_bytes()).to_base58()


def test_ed25519_identity_matches_the_daemon(tmp_path):
    identity = Identity.generate_ed25519(tmp_path / "ed.id")
    assert identity.peer_id.startswith("12D3KooW")
    assert (tmp_path / "ed.id").stat().st_mode & 0o777 == 0o600

    async def daemon_peer_id():
        p2p = await P2P.create(identity_path=str(tmp_path / "ed.id"), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            return p2p.peer_id.to_base58()
        finally:
            await p2p.shutdown()

    assert asyncio.run(daemon_peer_id()) == identity.peer_id


@pytest.mark.parametrize("kind", ["rsa", "ed25519"])
def test_signatures_are_bound_to_the_peer_id(kind, rsa_identity, tmp_path):
    me = Identity.load(rsa_identity) if kind == "rsa" else Identity.generate_ed25519(tmp_path / "me.id")
    other = Identity.generate_ed25519(tmp_path / "other.id")
    signature = me.sign(b"round 7 commitment")
    verify(me.peer_id, me.public_key, b"round 7 commitment", signature)
    with pytest.raises(PeerProtocolError, match="bad signature"):
        verify(me.peer_id, me.public_key, b"round 8 commitment", signature)
    with pytest.raises(PeerProtocolError, match="public key does not belong to the claimed peer ID"):
        verify(other.peer_id, me.public_key, b"round 7 commitment", signature)
    with pytest.raises(PeerProtocolError, match="bad signature"):
        verify(other.peer_id, other.public_key, b"round 7 commitment", signature)


def test_unreadable_identity_is_a_config_error(tmp_path):
    path = tmp_path / "junk.id"
    path.write_bytes(b"\x08\x05\x12\x01x")
    with pytest.raises(ConfigError, match="--identity-path: cannot read a libp2p private key"):
        Identity.load(path)


def test_a_checked_signature_is_remembered_but_never_for_other_data_or_another_peer(tmp_path, monkeypatch):
    import phalanx.security.identity as identity_module

    me = Identity.generate_ed25519(tmp_path / "me.id")
    other = Identity.generate_ed25519(tmp_path / "other.id")
    checks = []
    real = identity_module._check_signature
    monkeypatch.setattr(identity_module, "_check_signature", lambda *a: (checks.append(a[1]), real(*a)))
    monkeypatch.setattr(identity_module, "_verified", identity_module._Verified(2))
    signature = me.sign(b"commit")
    verify(me.peer_id, me.public_key, b"commit", signature)
    verify(me.peer_id, me.public_key, b"commit", signature)  # echoed in a reveal: not checked again
    assert checks == [b"commit"]
    with pytest.raises(PeerProtocolError, match="bad signature"):
        verify(me.peer_id, me.public_key, b"commit!", signature)
    with pytest.raises(PeerProtocolError, match="public key does not belong"):
        verify(other.peer_id, me.public_key, b"commit", signature)
    with pytest.raises(PeerProtocolError, match="bad signature"):
        verify(me.peer_id, me.public_key, b"commit", signature[:-1] + bytes([signature[-1] ^ 1]))
    for text in (b"a", b"b"):  # the memory holds 2: the first entry is forgotten and checked again
        verify(me.peer_id, me.public_key, text, me.sign(text))
    verify(me.peer_id, me.public_key, b"commit", signature)
    assert checks == [b"commit", b"commit!", b"commit", b"a", b"b", b"commit"]
