"""Commitments and the round's public randomness (MPRNG)."""

import hashlib

import pytest

from phalanx.errors import PeerProtocolError
from phalanx.security.commitments import (
    AggregateBody,
    CommitBody,
    members_digest,
    new_share,
    part_hash,
    part_hasher,
    public_seed,
    share_commitment,
    validator_pairs,
)
from phalanx.security.wire import pack, unpack


def test_part_hash_is_blake3_and_streams_piece_by_piece():
    data = bytes(range(256)) * 4099
    h = part_hasher()
    for i in range(0, len(data), 1000):
        h.update(memoryview(data)[i : i + 1000])
    assert h.digest() == part_hash(data) == part_hash(bytearray(data)) == part_hash(memoryview(data))
    assert part_hash(data) != part_hash(data[:-1] + b"\1") and len(part_hash(data)) == 32


def test_share_commitment_binds_round_peer_and_share():
    share = new_share()
    base = share_commitment(b"r" * 16, "alice", share)
    assert share_commitment(b"r" * 16, "alice", share) == base
    assert base not in {
        share_commitment(b"o" * 16, "alice", share),
        share_commitment(b"r" * 16, "bob", share),
        share_commitment(b"r" * 16, "alice", new_share()),
    }


def test_public_seed_depends_on_every_share_and_not_on_their_order():
    shares = {"alice": b"a" * 32, "bob": b"b" * 32, "carol": b"c" * 32}
    seed = public_seed(b"r" * 16, shares)
    assert public_seed(b"r" * 16, dict(reversed(list(shares.items())))) == seed
    assert public_seed(b"r" * 16, {**shares, "carol": b"d" * 32}) != seed  # the last revealer cannot keep it
    assert public_seed(b"r" * 16, {k: v for k, v in shares.items() if k != "bob"}) != seed
    assert public_seed(b"o" * 16, shares) != seed


def test_validator_pairs_are_public_distinct_and_never_self():
    members = ["a", "b", "c", "d", "e"]
    seeds = [hashlib.sha256(bytes([i])).digest() for i in range(200)]
    for count in range(0, 7):
        for seed in seeds[:20]:
            pairs = validator_pairs(seed, members, count)
            assert pairs == validator_pairs(seed, list(reversed(members)), count)  # the order given does not matter
            assert len(pairs) == min(count, len(members))
            validators, targets = [v for v, _ in pairs], [t for _, t in pairs]
            assert len(set(validators)) == len(validators) and len(set(targets)) == len(targets)
            assert all(v != t for v, t in pairs)
            if count >= len(members):
                assert set(targets) == set(members)  # everyone is validated
    # the seed decides: every member validates, and is validated, for some seeds
    single = [validator_pairs(seed, members, 1)[0] for seed in seeds]
    assert {v for v, _ in single} == set(members) and {t for _, t in single} == set(members)
    assert validator_pairs(seeds[0], ["a"], 3) == [] and validator_pairs(seeds[0], ["a", "a"], 3) == []


def test_members_digest_is_order_sensitive():
    assert members_digest(["a", "b"]) != members_digest(["b", "a"])
    assert members_digest(["a", "b"]) == members_digest(("a", "b"))
    assert members_digest(["ab", "c"]) != members_digest(["a", "bc"])


@pytest.mark.parametrize(
    "contributors, members, ok",
    [
        ([0, 1, 2], 3, True),
        ([1], 3, True),
        ([0, 2], 3, False),  # the reducer (part 1) did not count its own part
        ([2, 1], 3, False),  # not increasing
        ([1, 1, 2], 3, False),  # repeated
        ([1, 3], 3, False),  # not a member
        ([], 3, False),
    ],
)
def test_aggregate_contributors_must_be_increasing_members_with_the_reducer(contributors, members, ok):
    assert AggregateBody(part=1, hash=b"h" * 32, contributors=contributors).well_formed(members) is ok


def test_a_commitment_with_a_short_hash_is_refused_on_the_wire():
    raw = pack(CommitBody(members=b"m" * 32, parts=[b"p" * 32], mprng=b"s" * 32))
    assert unpack(raw, CommitBody).parts == [b"p" * 32]
    short = raw.replace(b"p" * 32, b"p" * 31)
    with pytest.raises(PeerProtocolError):
        unpack(short, CommitBody)
