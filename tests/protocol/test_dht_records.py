"""A reader's check of what a DHT get returned: valid, unexpired records only, each counted if not."""

from hivemind.utils import ValueWithExpiration

from phalanx.protocol.dht_records import read_signed
from phalanx.protocol.membership import PeerRecord
from phalanx.security.identity import Identity
from phalanx.security.records import sign_record

NOW = 1_800_000_000.0
KEY = "phalanx.run.0123456789abcdef.peers"


def test_a_reader_keeps_valid_unexpired_records_and_counts_the_rest(tmp_path):
    alice, bob, mallory = (Identity.generate_ed25519(tmp_path / f"{n}.id") for n in ("a", "b", "m"))
    a, a_exp = sign_record(alice, KEY, PeerRecord(state="online", step=3), signed_at=NOW, ttl_s=8)
    b, b_exp = sign_record(bob, KEY, PeerRecord(state="online", step=3), signed_at=NOW - 20, ttl_s=8)  # expired
    m, m_exp = sign_record(mallory, KEY, PeerRecord(state="leaving", step=0), signed_at=NOW, ttl_s=8)
    found = ValueWithExpiration(
        {
            alice.peer_id: ValueWithExpiration(a, a_exp),
            bob.peer_id: ValueWithExpiration(b, b_exp),
            "QmNotAPeerButAnyString": ValueWithExpiration({"state": "online", "step": 1}, NOW + 5),
            mallory.peer_id: ValueWithExpiration(m, m_exp + 100),  # kept alive past what mallory signed
        },
        NOW + 8,
    )
    records, invalid = read_signed(found, PeerRecord, key=KEY, max_ttl_s=60, now=NOW)
    assert records == {alice.peer_id: (PeerRecord(state="online", step=3), a_exp)}
    assert invalid == 2  # the unsigned and the kept-alive one; the expired one simply lapsed
    assert read_signed(ValueWithExpiration("split", NOW + 3600), PeerRecord, key=KEY, max_ttl_s=60, now=NOW) == ({}, 1)
    assert read_signed(None, PeerRecord, key=KEY, max_ttl_s=60, now=NOW) == ({}, 0)
