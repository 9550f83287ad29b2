"""Signed statements: bound to their signer's peer ID, kind and round, so none can be replayed as
another kind of message, in another round, or as someone else's."""

import re

import pytest

from phalanx.errors import PeerProtocolError
from phalanx.security.commitments import PartBody, ReportBody
from phalanx.security.identity import Identity
from phalanx.security.statements import Signed, open_statement, sign_statement

ROUND = b"r" * 16
BODY = PartBody(part=0, hash=b"h" * 32, weight=1.0, numel=100, codec="none", size=400)


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> list[Identity]:
    return [Identity.generate_ed25519(tmp_path_factory.mktemp(f"id{i}") / "key") for i in range(2)]


def test_a_statement_opens_with_its_kind_round_and_sender(ids):
    signed = sign_statement(ids[0], "part", ROUND, BODY)
    statement, body = open_statement(signed, PartBody, kind="part", round_id=ROUND, sender=ids[0].peer_id)
    assert (statement.kind, statement.round_id, statement.sender, body) == ("part", ROUND, ids[0].peer_id, BODY)


@pytest.mark.parametrize(
    "opened, message",
    [
        (dict(kind="report"), "a 'part' statement where a 'report' was expected"),
        (dict(kind="part", round_id=b"o" * 16), "part statement of another round (replayed?)"),
        (dict(kind="part", sender="someone else"), "part statement signed by"),
    ],
)
def test_a_statement_is_refused_for_another_kind_round_or_sender(ids, opened, message):
    signed = sign_statement(ids[0], "part", ROUND, BODY)
    if opened.get("sender") == "someone else":
        opened["sender"] = ids[1].peer_id
    with pytest.raises(PeerProtocolError, match=re.escape(message)):
        open_statement(signed, PartBody, **opened)


def test_a_tampered_statement_or_a_borrowed_signature_is_refused(ids):
    signed = sign_statement(ids[0], "part", ROUND, BODY)
    other = sign_statement(ids[1], "part", ROUND, BODY)
    tampered = bytearray(signed.statement)
    tampered[-1] ^= 1
    forgeries = [
        Signed(statement=bytes(tampered), public_key=signed.public_key, signature=signed.signature),
        # mallory's key and signature over alice's statement: the key is not the sender's
        Signed(statement=signed.statement, public_key=other.public_key, signature=other.signature),
        Signed(statement=signed.statement, public_key=signed.public_key, signature=other.signature),
    ]
    for forged in forgeries:
        with pytest.raises(PeerProtocolError):
            open_statement(forged, PartBody, kind="part", round_id=ROUND)


def test_a_body_of_another_model_is_refused(ids):
    signed = sign_statement(ids[0], "part", ROUND, BODY)
    with pytest.raises(PeerProtocolError):
        open_statement(signed, ReportBody, kind="part", round_id=ROUND)
