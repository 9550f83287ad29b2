"""The round's validators (docs/algorithms.md §2 step 8): the public seed picks `validators` members, each to
recompute another's gradient on the same deterministic minibatch and compare it with the parts it
committed to.

Holding every part its target committed to, a validator also checks the target's reports: nobody else
could check what a reducer reports about its own part (it alone holds that part, and one made-up report
can cancel a wrong aggregate in the fixed-point sum), or what a contributor reports when its reducer
covers for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Optional

import torch

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.btard.claims import Reports
from phalanx.protocol.btard.messages import Accusation, Recompute
from phalanx.protocol.codec import decode, encode, encoded_size_bound
from phalanx.protocol.transport import CallFailed
from phalanx.security.commitments import part_hash, validator_pairs
from phalanx.security.evidence import Offense
from phalanx.security.projection import report_matches

if TYPE_CHECKING:
    from phalanx.protocol.btard.state import RoundState

logger = logging.getLogger(__name__)


def drawn_to_sit_out(seed: bytes, members: list[str], count: int) -> set[str]:
    """validators_sit_out: the members a round's public seed draws (among its committed `members`) to sit
    the next round out, each to replay the phase of a member it picks in secret. At most a third of
    them: a member that sits out does not contribute, so the Byzantine share among those that do grows
    (1 attacker in 4 members with 2 sitting out is half of the contributors, more than CenteredClip
    withstands)."""
    return {validator for validator, _ in validator_pairs(seed, sorted(members), min(count, len(members) // 3))}


class Validator:
    """One member's part in its round's validation: who validates whom, and (if this member is a
    validator) the recomputation and the check of its target's reports."""

    def __init__(self, vr: RoundState) -> None:
        self.vr = vr
        self.target_parts: dict[int, bytes | memoryview] = {}  # as validator: the target's committed parts

    def pairs(self, seed: bytes) -> list[tuple[str, str]]:
        """(validator, target) pairs among the members whose parts count, for the round's public seed
        (none where validators sit out: their targets are their own secret)."""
        if self.vr.config.validators_sit_out:
            return []
        return validator_pairs(seed, sorted(self.vr.contributors), self.vr.config.validators)

    def target(self, seed: bytes) -> Optional[str]:
        """The member this one validates this round, if any."""
        vr = self.vr
        if vr.config.validators_sit_out:
            sat_out = vr.identity.peer_id in vr.sitters
            return vr.target if sat_out and vr.target in vr.contributors else None
        return next((t for v, t in self.pairs(seed) if v == vr.identity.peer_id), None)

    def validates(self, validator: str, target: str, seed: bytes) -> bool:
        """Whether `validator` may accuse `target` of a bad contribution, or of a false report it proves
        with the target's parts: the seed paired them, or (validators_sit_out) it sat the round out."""
        vr = self.vr
        if vr.config.validators_sit_out:
            return validator in vr.sitters and target in vr.contributors
        return (validator, target) in self.pairs(seed)

    async def validate(self, seed: bytes) -> None:
        vr = self.vr
        target = self.target(seed)
        if target is None or vr.recompute is None:
            return
        logger.debug(f"round {vr.round_id.hex()[:8]}: validating {target[-8:]}")
        parts: dict[int, bytes | memoryview] = {}
        if await self.contribution_holds(target, vr.recompute, keep=parts):
            self.target_parts = parts
        else:
            vr.accusations.append(Accusation(accused=target, offense=Offense.BAD_CONTRIBUTION, part=-1, evidence=[]))

    async def contribution_holds(self, target: str, recompute_fn: Recompute, keep: Optional[dict] = None) -> bool:
        """Recompute `target`'s gradient; parts whose hash differs are fetched and compared within tolerance.
        `keep` collects the bytes the target committed to, part by part."""
        vr = self.vr
        honest = (await recompute_fn(target)).detach().float().cpu()
        _, commit = vr.commits[target]
        loop = asyncio.get_running_loop()
        for part, (a, b) in enumerate(vr.bounds):
            mine = encode(honest[a:b], vr.codec)
            if await loop.run_in_executor(None, part_hash, mine) == commit.parts[part]:
                if keep is not None:
                    keep[part] = mine
                continue  # bit-identical recomputation
            try:
                data = await vr.service.fetch_part(
                    vr.members[part], vr.round_id, part, target,
                    encoded_size_bound(b - a, vr.codec), vr.config.phase_timeout_s,
                )  # fmt: skip
            except (CallFailed, RoundAbortedError, PeerProtocolError):
                return False  # nobody can show the part the target committed to
            if part_hash(data) != commit.parts[part]:
                return False
            if keep is not None:
                keep[part] = data
            theirs = vr.part_values(data, part, target)
            expected = decode(bytearray(mine), vr.codec, b - a)
            diff = float(torch.linalg.vector_norm((theirs - expected).double()))
            if (
                not math.isfinite(diff)
                or diff > vr.config.contribution_rtol * float(torch.linalg.vector_norm(expected.double())) + 1e-12
            ):
                return False
        return True

    async def target_truths(
        self, validating: asyncio.Future, seed: bytes, output: torch.Tensor
    ) -> dict[int, tuple[float, float]]:
        """What the target should report on every part we hold that counted it: computed off the event loop
        as soon as `validating` checked its parts, while the reports still travel."""
        await validating
        vr, target = self.vr, self.target(seed)
        if target is None or not self.target_parts:
            return {}
        index = vr.members.index(target)
        # our own part we checked as its reducer; parts we do not hold cannot be judged
        parts = [
            part for part in sorted(self.target_parts)
            if part != vr.me and part in vr.aggregates and part in vr.landed_parts
            and index in vr.aggregates_contributors(part)
        ]  # fmt: skip

        def truths() -> dict[int, tuple[float, float]]:
            return {part: vr.true_report(seed, output, part, target, self.target_parts[part]) for part in parts}

        return await asyncio.get_running_loop().run_in_executor(None, truths)

    def check_target_reports(self, seed: bytes, reports: Reports, truths: dict[int, tuple[float, float]]) -> None:
        """Accuse the target of every report the parts it committed to prove false (or of a missing one)."""
        vr = self.vr
        target = self.target(seed)
        if target is None or not self.target_parts or target not in reports:
            return
        signed, body = reports[target]
        vr.service.hold_target(vr.round_id, target, self.target_parts)
        for part, true in truths.items():
            if part in body.undelivered:
                continue  # a dispute, judged as one
            entry = next((e for e in body.entries if e.part == part), None)
            if entry is not None and entry.aggregate != vr.aggregates[part][1].hash:
                continue  # it reported on another aggregate: its reducer equivocated (the echoes prove it)
            if entry is None or not report_matches((entry.s, entry.norm), true, vr.config.tau):
                logger.info(f"round {vr.round_id.hex()[:8]}: validated {target[-8:]} reported falsely on part {part}")
                vr.accusations.append(
                    Accusation(accused=target, offense=Offense.FALSE_REPORT, part=part, evidence=[signed])
                )
