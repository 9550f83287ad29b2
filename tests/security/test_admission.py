"""Admission certificates: only the owner's, for this peer, this run, and not expired."""

import pytest

from phalanx.errors import ConfigError, PeerProtocolError
from phalanx.security.admission import generate_owner_key, issue, load_owner_private, load_owner_public, verify_certificate

PEER = "12D3KooWGunkA55ShGBm6G2KBfLhk6oUr4GCkEoYyG6bbPj76gTc"
OTHER = "QmReHQdH2S2Vw2oZNLAcATfesFFLpxSFRiF72GJwLv2X4b"


@pytest.fixture
def owner(tmp_path):
    generate_owner_key(tmp_path / "o.key", tmp_path / "o.pub")
    return load_owner_private(tmp_path / "o.key"), load_owner_public(tmp_path / "o.pub")


def test_valid_certificate(owner):
    private, public = owner
    body = verify_certificate(public, issue(private, PEER, "run", 60, now=1000.0), peer_id=PEER, run_id="run", now=1030.0)
    assert body.peer_id == PEER and body.not_after == 1060.0


@pytest.mark.parametrize(
    "peer, run, now, message",
    [
        (OTHER, "run", 1030.0, "certificate of another peer"),
        (PEER, "other", 1030.0, "certificate for run 'run', not 'other'"),
        (PEER, "run", 1061.0, "certificate expired or not yet valid"),
        (PEER, "run", 100.0, "certificate expired or not yet valid"),
    ],
)
def test_wrong_peer_run_or_time(owner, peer, run, now, message):
    private, public = owner
    with pytest.raises(PeerProtocolError, match=message):
        verify_certificate(public, issue(private, PEER, "run", 60, now=1000.0), peer_id=peer, run_id=run, now=now)


def test_other_owner_and_tampering(owner, tmp_path):
    private, public = owner
    generate_owner_key(tmp_path / "x.key", tmp_path / "x.pub")
    forged = issue(load_owner_private(tmp_path / "x.key"), PEER, "run", 60)
    with pytest.raises(PeerProtocolError, match="not signed by the swarm's owner"):
        verify_certificate(public, forged, peer_id=PEER, run_id="run")
    raw = bytearray(issue(private, PEER, "run", 60))
    raw[-70] ^= 1
    with pytest.raises(PeerProtocolError):
        verify_certificate(public, bytes(raw), peer_id=PEER, run_id="run")


def test_keys_are_not_overwritten_and_bad_files_are_config_errors(tmp_path, owner):
    with pytest.raises(ConfigError, match="already exists"):
        generate_owner_key(tmp_path / "o.key", tmp_path / "new.pub")
    (tmp_path / "junk.pub").write_text("nope")
    with pytest.raises(ConfigError, match="--admission: cannot read an owner public key"):
        load_owner_public(tmp_path / "junk.pub")
