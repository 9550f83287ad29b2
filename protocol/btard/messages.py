"""What the phases after the data exchange send (accusations, ban votes, evidence and relay requests),
and the verdict a verified round comes to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field

from phalanx.security.evidence import Offense
from phalanx.security.statements import Signed
from phalanx.security.wire import PeerIdStr, RoundId, WireModel

EVIDENCE_METHOD = "evidence"
RELAY_METHOD = "relay"
Recompute = Callable[[str], Awaitable[torch.Tensor]]  # peer ID -> its honest flat gradient at this round's state


class Accusation(WireModel):
    accused: PeerIdStr
    offense: Annotated[Offense, Field(strict=False)]  # sent as its string value
    part: Annotated[int, Field(ge=-1, lt=256)]  # the part concerned, -1 if none
    evidence: Annotated[list[Signed], Field(max_length=4)]


class AccuseBody(WireModel):
    """Kind "accuse"."""

    accusations: Annotated[list[Accusation], Field(max_length=256)]
    suspects: bool = False  # this member saw something wrong (silence, a failed check): everyone votes
    reports: Annotated[list[Signed], Field(max_length=256)] = []  # echo of the reports it judged by


class EvidenceRequest(WireModel):
    round_id: RoundId
    part: int
    contributor: PeerIdStr


class RelayRequest(WireModel):
    """Ask a member for an aggregate it received: `payload` False only asks whether it holds it (the
    reply then waits until it does), True fetches the bytes. The reply header is the reducer's statement."""

    round_id: RoundId
    part: Annotated[int, Field(ge=0, lt=256)]
    payload: bool


class VoteList(WireModel):
    votes: Annotated[list[Signed], Field(max_length=256)]
    disputes: Annotated[list[Signed], Field(max_length=256)] = []  # signed reports that dispute parts


@dataclass
class Verdict:
    banned: set[str] = field(default_factory=set)
    bad_parts: set[int] = field(default_factory=set)  # aggregates not to apply (their reducer is guilty)
    votes: list[Signed] = field(default_factory=list)  # every valid vote seen (to publish)
    accusations: int = 0  # accusations made in the round (by anyone)
    disputed: set[int] = field(default_factory=set)  # parts dropped because a member said it never got them
    relayed: set[int] = field(default_factory=set)  # parts this member took from another member, not their reducer
    clean: bool = False  # every member reported a clean round: the held parts were released
    seed: bytes = b""  # the round's public seed (empty if the reveal never finished)
    contributors: tuple[str, ...] = ()  # committed members whose parts counted (sitters left out), sorted
    committed: tuple[str, ...] = ()  # every committed member, sitters too, sorted
