"""Offenses, the evidence that proves them, and when a ban holds.

Two kinds of proof:
  * self-contained — the offender's own signed statements contradict each other or a rule
    (a part that does not match its commitment, two different aggregates for one part, a
    weight other than 1, a part size its codec cannot take, a reveal that does not open its
    commitment). One honest judge's vote
    carrying them is enough, for anyone who checks it.
  * by majority — offenses only the round's members can judge (false projection reports,
    wrong aggregates, contributions that do not recompute, silence): a ban holds once more
    than half of the round's members (as the leader's signed group lists them) voted it, and
    the votes carry the accused's own commitment to that group. Anyone can sign a group
    statement, so without it two colluding identities could vote any peer out of a "group"
    of three they made up. A member that never committed is banned only by judges that saw
    the group from its leader themselves (`trusted`: the round's own members).
    False accusers are judged the same way. Caveat: a Byzantine leader that forms a real
    group made mostly of Byzantine peers around one honest peer could outvote it; the
    security model assumes every real group has an honest majority.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Optional

from pydantic import Field

from phalanx.errors import PeerProtocolError
from phalanx.security.commitments import (
    AggregateBody,
    CommitBody,
    GroupBody,
    PartBody,
    ReportBody,
    members_digest,
    share_commitment,
)
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import Signed, open_statement
from phalanx.security.wire import PeerIdStr, WireModel

MAX_EVIDENCE = 4


class Offense(str, enum.Enum):
    BAD_COMMITMENT = "bad_commitment"  # signed part hash differs from the signed commitment
    EQUIVOCATION = "equivocation"  # two different signed commitments, aggregates or reports for one slot
    INFLATED_WEIGHT = (
        "inflated_weight"  # a signed part claims a weight other than 1 (verified rounds count everyone once)
    )
    BAD_REVEAL = "bad_reveal"  # the revealed share does not open the MPRNG commitment
    OVERSIZED_PART = "oversized_part"  # a signed part claims more bytes than its codec takes for its numel
    FALSE_REPORT = "false_report"  # projection report differs from the committed data
    WRONG_AGGREGATE = "wrong_aggregate"  # the aggregate fails the fixed-point check
    BAD_CONTRIBUTION = "bad_contribution"  # the contribution does not recompute from the public batch
    WITHHELD = "withheld"  # sent nothing in a phase it had to answer
    LEFT_OUT = "left_out"  # as a reducer, left most members' parts out of its aggregate
    FALSE_ACCUSATION = "false_accusation"  # accused a peer the judges found innocent

    @property
    def self_contained(self) -> bool:
        return self in SELF_CONTAINED


# offenses the offender's own signed statements prove, to anyone: one judge's vote bans
SELF_CONTAINED = frozenset(
    {Offense.BAD_COMMITMENT, Offense.EQUIVOCATION, Offense.INFLATED_WEIGHT, Offense.BAD_REVEAL, Offense.OVERSIZED_PART}
)


class RevealBody(WireModel):
    """Kind "reveal": the MPRNG share, and an echo of the signed commitments and aggregates this
    member received, so that anyone who got a different version holds two signed statements."""

    share: Annotated[bytes, Field(min_length=32, max_length=32)]
    commits: Annotated[list[Signed], Field(max_length=256)]
    aggregates: Annotated[list[Signed], Field(max_length=256)]


class BanVote(WireModel):
    """Kind "ban": one judge's vote that `accused` committed `offense` in round `round_id`."""

    accused: PeerIdStr
    offense: Annotated[Offense, Field(strict=False)]  # sent as its string value
    round_id: Annotated[bytes, Field(max_length=32)]
    evidence: Annotated[list[Signed], Field(max_length=MAX_EVIDENCE)]  # the offender's statements, or the group


@dataclass(frozen=True)
class Vote:
    judge: str
    body: BanVote


def check_self_contained(offense: Offense, accused: str, round_id: bytes, evidence: list[Signed]) -> bool:
    """Whether `evidence` (statements signed by `accused`) proves `offense` on its own."""
    try:
        if offense is Offense.BAD_COMMITMENT and len(evidence) == 2:
            _, commit = open_statement(evidence[0], CommitBody, kind=RoundPhase.COMMIT, round_id=round_id, sender=accused)
            _, part = open_statement(evidence[1], PartBody, kind="part", round_id=round_id, sender=accused)
            return part.part < len(commit.parts) and commit.parts[part.part] != part.hash
        if offense is Offense.INFLATED_WEIGHT and len(evidence) == 1:
            _, part = open_statement(evidence[0], PartBody, kind="part", round_id=round_id, sender=accused)
            return part.weight != 1.0
        if offense is Offense.OVERSIZED_PART and len(evidence) == 1:
            _, part = open_statement(evidence[0], PartBody, kind="part", round_id=round_id, sender=accused)
            return part.oversized()
        if offense is Offense.BAD_REVEAL and len(evidence) == 2:
            _, commit = open_statement(evidence[0], CommitBody, kind=RoundPhase.COMMIT, round_id=round_id, sender=accused)
            _, reveal = open_statement(evidence[1], RevealBody, kind=RoundPhase.REVEAL, round_id=round_id, sender=accused)
            return share_commitment(round_id, accused, reveal.share) != commit.mprng
        if offense is Offense.EQUIVOCATION and len(evidence) == 2:
            for kind, model in ((RoundPhase.COMMIT, CommitBody), ("aggregate", AggregateBody), (RoundPhase.REPORT, ReportBody)):
                try:
                    _, a = open_statement(evidence[0], model, kind=kind, round_id=round_id, sender=accused)
                    _, b = open_statement(evidence[1], model, kind=kind, round_id=round_id, sender=accused)
                except PeerProtocolError:
                    continue
                same_slot = kind != "aggregate" or a.part == b.part
                return same_slot and a != b
    except PeerProtocolError:
        return False
    return False


def group_members(evidence: list[Signed], round_id: bytes) -> Optional[list[str]]:
    """Members listed by the leader's signed group statement for `round_id`, if `evidence` holds one."""
    for signed in evidence:
        try:
            _, group = open_statement(signed, GroupBody, kind="group", round_id=round_id)
        except PeerProtocolError:
            continue
        return list(group.members)
    return None


def committed_to(evidence: list[Signed], accused: str, round_id: bytes, members: list[str]) -> bool:
    """Whether `evidence` holds `accused`'s own signed commitment to round `round_id` with exactly `members`."""
    digest = members_digest(members)
    for signed in evidence:
        try:
            _, commit = open_statement(signed, CommitBody, kind=RoundPhase.COMMIT, round_id=round_id, sender=accused)
        except PeerProtocolError:
            continue
        if commit.members == digest:
            return True
    return False


def banned(votes: list[Vote], trusted: Iterable[tuple[bytes, tuple[str, ...]]] = ()) -> set[str]:
    """Everyone a set of (verified) votes bans: self-contained proofs count alone, other offenses
    need votes from more than half of the round's members, citing a group the accused committed to
    or one of the `trusted` (round id, members) groups."""
    trusted = set(trusted)
    out: set[str] = set()
    # votes add up per accused and round, whatever offense each judge saw first (judges may
    # convict for different offenses of the same peer), and only when they cite the same group
    tallies: dict[tuple[str, bytes, tuple[str, ...]], set[str]] = defaultdict(set)
    for vote in votes:
        body = vote.body
        if body.offense.self_contained:
            if check_self_contained(body.offense, body.accused, body.round_id, list(body.evidence)):
                out.add(body.accused)
            continue
        members = group_members(list(body.evidence), body.round_id)
        if members is None or vote.judge not in members or body.accused not in members:
            continue
        trusted_group = (body.round_id, tuple(members)) in trusted
        if not trusted_group and not committed_to(list(body.evidence), body.accused, body.round_id, members):
            continue
        tallies[(body.accused, body.round_id, tuple(members))].add(vote.judge)
    for (accused, _, members), judges in tallies.items():
        if len(judges) > len(members) // 2:
            out.add(accused)
    return out
