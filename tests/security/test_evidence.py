"""Offenses and bans: which signed evidence proves an offense on its own, and when votes ban.

The forged-group cases are the point of `banned`'s commitment rule: members who collude (or one
attacker with a few free identities) can sign any "group" statement they like, so a group counts
for a ban only if the accused itself committed to it (or the judge saw that group from its leader).
"""

import pytest

from phalanx.security.commitments import (
    AggregateBody,
    CommitBody,
    GroupBody,
    PartBody,
    ReportBody,
    ReportEntry,
    max_part_bytes,
    members_digest,
    share_commitment,
)
from phalanx.security.evidence import BanVote, Offense, RevealBody, Vote, banned, check_self_contained
from phalanx.security.identity import Identity
from phalanx.security.statements import sign_statement

ROUND = b"r" * 16
H = [bytes([i]) * 32 for i in range(8)]


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> list[Identity]:
    return [Identity.generate_ed25519(tmp_path_factory.mktemp(f"id{i}") / "key") for i in range(6)]


def group(leader: Identity, members: list[Identity], round_id: bytes = ROUND):
    return sign_statement(leader, "group", round_id, GroupBody(members=[m.peer_id for m in members]))


def commit(who: Identity, members: list[Identity], round_id: bytes = ROUND, parts=None, share=b"s" * 32):
    body = CommitBody(
        members=members_digest([m.peer_id for m in members]),
        parts=parts or H[: len(members)],
        mprng=share_commitment(round_id, who.peer_id, share),
    )
    return sign_statement(who, "commit", round_id, body)


def part_body(index: int, hash: bytes, weight: float = 1.0, *, numel: int = 100, codec: str = "none", size: int = 400):
    return PartBody(part=index, hash=hash, weight=weight, numel=numel, codec=codec, size=size)


def vote(judge: Identity, accused: Identity, offense: Offense, evidence, round_id: bytes = ROUND) -> Vote:
    body = BanVote(accused=accused.peer_id, offense=offense, round_id=round_id, evidence=evidence)
    sign_statement(judge, "ban", b"", body)  # what a judge publishes; `banned` takes the opened votes
    return Vote(judge.peer_id, body)


# ---- self-contained proofs ------------------------------------------------------------------


def test_a_part_that_differs_from_its_commitment_is_proof(ids):
    a, members = ids[0], ids[:3]
    c = commit(a, members)
    good = sign_statement(a, "part", ROUND, part_body(1, H[1], 1.0))
    bad = sign_statement(a, "part", ROUND, part_body(1, H[5], 1.0))
    assert check_self_contained(Offense.BAD_COMMITMENT, a.peer_id, ROUND, [c, bad])
    assert not check_self_contained(Offense.BAD_COMMITMENT, a.peer_id, ROUND, [c, good])
    # statements of someone else, or of another round, prove nothing about `a`
    assert not check_self_contained(Offense.BAD_COMMITMENT, ids[1].peer_id, ROUND, [c, bad])
    assert not check_self_contained(Offense.BAD_COMMITMENT, a.peer_id, b"x" * 16, [c, bad])


def test_a_weight_other_than_one_is_proof(ids):
    a = ids[0]
    for weight, proven in [(1.0, False), (0.0, True), (2.0, True), (0.5, True)]:
        part = sign_statement(a, "part", ROUND, part_body(0, H[0], weight))
        assert check_self_contained(Offense.INFLATED_WEIGHT, a.peer_id, ROUND, [part]) is proven


@pytest.mark.parametrize(
    "numel, codec, honest",
    [(1000, "none", 4000), (1000, "int8", 4 * 4 + 1000), (1000, "sparse", 4001), (1000, "fp16", 2018), (0, "none", 0)],
)
def test_a_part_size_beyond_its_codec_bound_is_proof(ids, numel, codec, honest):
    """Anyone can check a signed part size against the signed numel and codec, without the round."""
    a = ids[0]

    def signed(size: int, signer: Identity = a, round_id: bytes = ROUND):
        return sign_statement(signer, "part", round_id, part_body(0, H[0], numel=numel, codec=codec, size=size))

    bound = max_part_bytes(numel, codec)
    assert honest <= bound <= honest + 8  # tight (the sizes are encode()'s: 2018 is hivemind's for 1000 fp16 values)
    for size, proven in [(honest, False), (bound, False), (bound + 1, True), (1 << 30, True)]:
        assert check_self_contained(Offense.OVERSIZED_PART, a.peer_id, ROUND, [signed(size)]) is proven
    assert Offense.OVERSIZED_PART.self_contained
    assert banned([vote(ids[5], a, Offense.OVERSIZED_PART, [signed(1 << 30)])]) == {a.peer_id}
    # someone else's statement, another round's, two statements, or one with a codec nobody speaks prove nothing
    assert not check_self_contained(Offense.OVERSIZED_PART, ids[1].peer_id, ROUND, [signed(1 << 30)])
    assert not check_self_contained(Offense.OVERSIZED_PART, a.peer_id, b"x" * 16, [signed(1 << 30)])
    assert not check_self_contained(Offense.OVERSIZED_PART, a.peer_id, ROUND, [signed(1 << 30)] * 2)
    unknown = sign_statement(a, "part", ROUND, part_body(0, H[0], numel=numel, codec="bogus", size=1 << 30))
    assert not check_self_contained(Offense.OVERSIZED_PART, a.peer_id, ROUND, [unknown])


def test_a_reveal_that_does_not_open_the_commitment_is_proof(ids):
    a = ids[0]
    c = commit(a, ids[:2], share=b"s" * 32)
    opens = sign_statement(a, "reveal", ROUND, RevealBody(share=b"s" * 32, commits=[], aggregates=[]))
    other = sign_statement(a, "reveal", ROUND, RevealBody(share=b"t" * 32, commits=[], aggregates=[]))
    assert not check_self_contained(Offense.BAD_REVEAL, a.peer_id, ROUND, [c, opens])
    assert check_self_contained(Offense.BAD_REVEAL, a.peer_id, ROUND, [c, other])


def test_two_different_statements_for_one_slot_are_equivocation(ids):
    a = ids[0]
    def agg(h):
        return sign_statement(a, "aggregate", ROUND, AggregateBody(part=0, hash=h, contributors=[0, 1]))

    def rep(s):
        entries = [ReportEntry(part=0, aggregate=H[0], s=s, norm=1.0)]
        return sign_statement(a, "report", ROUND, ReportBody(entries=entries))

    assert check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [agg(H[0]), agg(H[1])])
    assert check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [rep(0.0), rep(1.0)])
    assert check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [commit(a, ids[:2]), commit(a, ids[:3])])
    # the same statement twice, or aggregates for two different parts, are not
    assert not check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [agg(H[0]), agg(H[0])])
    other_part = sign_statement(a, "aggregate", ROUND, AggregateBody(part=1, hash=H[1], contributors=[0, 1]))
    assert not check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [agg(H[0]), other_part])
    # two statements of different kinds are no slot at all
    assert not check_self_contained(Offense.EQUIVOCATION, a.peer_id, ROUND, [agg(H[0]), rep(0.0)])


def test_offenses_judged_by_majority_are_never_self_contained(ids):
    a = ids[0]
    c = commit(a, ids[:2])
    for offense in Offense:
        if not offense.self_contained:
            assert not check_self_contained(offense, a.peer_id, ROUND, [c, c])


# ---- bans by majority -------------------------------------------------------------------------


def test_a_majority_of_the_round_bans_with_the_accused_commitment(ids):
    members = ids[:5]
    accused = members[4]
    evidence = [group(members[0], members), commit(accused, members)]
    votes = [vote(j, accused, Offense.FALSE_REPORT, evidence) for j in members[:2]]
    assert banned(votes) == set()  # 2 of 5 is not a majority
    votes.append(vote(members[2], accused, Offense.WRONG_AGGREGATE, evidence))  # offenses add up per accused
    assert banned(votes) == {accused.peer_id}


def test_votes_from_outside_the_group_or_for_another_round_do_not_count(ids):
    members, outsider = ids[:3], ids[5]
    accused = members[2]
    evidence = [group(members[0], members), commit(accused, members)]
    assert (
        banned(
            [vote(members[0], accused, Offense.WITHHELD, evidence), vote(outsider, accused, Offense.WITHHELD, evidence)]
        )
        == set()
    )
    other_round = b"o" * 16
    assert banned([vote(j, accused, Offense.WITHHELD, evidence, round_id=other_round) for j in members[:2]]) == set()


def test_a_forged_group_bans_nobody(ids):
    """Two colluders sign a group of themselves and an honest peer that never was in such a round,
    and vote it out: 2 of 3 is a majority of that group, but the honest peer never committed to it."""
    victim, byz = ids[0], ids[3:5]
    fake = group(byz[0], [byz[0], byz[1], victim])
    votes = [vote(j, victim, Offense.WITHHELD, [fake]) for j in byz]
    assert banned(votes) == set()
    # nor with the victim's real commitment to another group, or to the same members in another round
    real = commit(victim, [victim, ids[1], ids[2]])
    elsewhere = commit(victim, [byz[0], byz[1], victim], round_id=b"e" * 16)
    for evidence in ([fake, real], [fake, elsewhere]):
        assert banned([vote(j, victim, Offense.WITHHELD, evidence) for j in byz]) == set()


def test_a_group_the_judge_saw_from_its_leader_needs_no_commitment(ids):
    """A member that never committed can still be banned by the round's own members, who hold the
    leader's statement for their round; the swarm at large cannot check that it was ever there."""
    members = ids[:3]
    silent = members[2]
    evidence = [group(members[0], members)]
    votes = [vote(j, silent, Offense.WITHHELD, evidence) for j in members[:2]]
    assert banned(votes) == set()
    assert banned(votes, trusted=[(ROUND, tuple(m.peer_id for m in members))]) == {silent.peer_id}
    # trusting one group vouches for no other
    assert banned(votes, trusted=[(b"o" * 16, tuple(m.peer_id for m in members))]) == set()


def test_a_self_contained_proof_bans_on_one_vote_from_anyone(ids):
    a = ids[0]
    part = sign_statement(a, "part", ROUND, part_body(0, H[0], 5.0))
    assert banned([vote(ids[5], a, Offense.INFLATED_WEIGHT, [part])]) == {a.peer_id}
    # a vote whose evidence does not prove it bans nobody, whoever casts it
    honest_part = sign_statement(a, "part", ROUND, part_body(0, H[0], 1.0))
    assert banned([vote(j, a, Offense.INFLATED_WEIGHT, [honest_part]) for j in ids[1:]]) == set()
