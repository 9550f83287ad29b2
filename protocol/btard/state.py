"""What one member knows of one verified round: the signed inputs every phase reads and adds to.

The phase modules (relay, reports, validator, judge) take this state and nothing of the round that
drives them, so the round (round.py) imports them and none imports it back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import torch

from phalanx.protocol.btard.behavior import Behavior
from phalanx.protocol.btard.claims import Claims
from phalanx.protocol.btard.messages import Accusation, Recompute
from phalanx.protocol.btard.service import BtardService
from phalanx.protocol.codec import Codec, decode
from phalanx.protocol.config import VerifyConfig
from phalanx.security.commitments import AggregateBody, CommitBody, new_share
from phalanx.security.evidence import Offense, check_self_contained
from phalanx.security.projection import direction, report
from phalanx.security.statements import Signed

# A member waits this many times its own recomputation's duration for another's: a validator or judge on
# slower hardware (or sharing its machine) replays the same steps more slowly.
RECOMPUTE_MARGIN = 2.0


class RoundState:
    """One member's view of one verified round: its members and parts, what it committed and received,
    and what it proved or accuses; the phases' shared helpers read it."""

    def __init__(
        self,
        service: BtardService,
        *,
        round_id: bytes,
        members: tuple[str, ...],
        group_statement: Signed,
        bounds: list[tuple[int, int]],
        codec: Codec,
        config: VerifyConfig,
        behavior: Behavior,
        vector: torch.Tensor,
        recompute: Optional[Recompute] = None,
        recompute_s: float = 0.0,
        target: Optional[str] = None,
    ) -> None:
        self.service, self.identity = service, service.identity
        # a member sitting the round out (validators_sit_out): the member whose contribution it checks,
        # picked in secret; `recompute` has its replay ready
        self.target = target
        self.recompute = recompute  # a validator's recomputation of another member's contribution
        # how long one recomputation takes here (diloco: a phase of H inner steps, far longer than a phase
        # timeout): the phases that wait for validators' and judges' recomputations wait that much longer
        self.recompute_s = recompute_s
        self.vector = vector  # this member's committed contribution (flat, CPU float32)
        self.round_id, self.members, self.group_statement = round_id, members, group_statement
        self.bounds, self.codec, self.config, self.behavior = bounds, codec, config, behavior
        self.me = members.index(self.identity.peer_id)
        self.share = new_share()
        self.my_hashes: list[bytes] = []
        self.commits: dict[str, tuple[Signed, CommitBody]] = {}
        self.aggregates: dict[int, tuple[Signed, AggregateBody]] = {}
        self.part_statements: dict[str, Signed] = {}  # contributors to my part -> their signed part statement
        self.payloads: dict[str, bytes | memoryview] = {}  # contributors to my part -> the exact bytes they sent
        self.my_contributors: list[int] = []
        self.accusations: list[Accusation] = []
        self.signed_aggregates: dict[int, dict[bytes, Signed]] = {}  # part -> hash -> the reducer's statement
        self.proofs: dict[str, tuple[Offense, list[Signed]]] = {}  # self-contained proofs found locally
        self.expected: Optional[set[int]] = None  # parts whose aggregate statement we wait for (committed reducers)
        self.equivocators: set[str] = set()  # members proven to have sent different reports
        self.landed_parts: set[int] = set()  # parts whose aggregate arrived whole
        self._seed: Optional[asyncio.Future] = None  # the public seed, once the reveal is done
        self._deadline = 0.0  # the last phase's (time.monotonic())

    @property
    def committed(self) -> set[str]:
        return set(self.commits)

    @property
    def sitters(self) -> set[str]:
        """Committed members sitting this round out: their parts count in no aggregate."""
        return {peer for peer, (_, commit) in self.commits.items() if commit.sits_out}

    @property
    def contributors(self) -> set[str]:
        """Committed members whose parts every aggregate must count."""
        return self.committed - self.sitters

    @property
    def claims(self) -> Claims:
        return Claims(self.members, len(self.commits), self.aggregates_contributors, frozenset(self.sitters))

    def missing_parts(self) -> set[int]:
        return (self.expected or set()) - self.landed_parts - {self.me}

    def next_deadline(self, extra_s: float = 0.0) -> float:
        """The next phase's deadline: a phase timeout (plus `extra_s`) after the previous phase's, or after
        now once that passed. A member may wait out a whole phase for a message kept from it alone (a
        withheld report) and start the next phase a phase timeout after the others; counted from the
        previous deadline, they still wait for what it sends there."""
        self._deadline = max(time.monotonic(), self._deadline) + self.config.phase_timeout_s + extra_s
        return self._deadline

    def recompute_allowance_s(self, recomputations: int = 1) -> float:
        """How much longer than a phase timeout to wait for members that first recompute `recomputations`
        contributions (none without validators)."""
        return RECOMPUTE_MARGIN * self.recompute_s * recomputations if self.config.validators else 0.0

    def accusation_allowance_s(self) -> float:
        """The accusation phase waits for validators' recomputations, unless they sat out with it done."""
        return 0.0 if self.config.validators_sit_out else self.recompute_allowance_s()

    def prove(self, accused: str, offense: Offense, evidence: list[Signed]) -> None:
        if accused != self.identity.peer_id and check_self_contained(offense, accused, self.round_id, evidence):
            self.proofs.setdefault(accused, (offense, evidence))

    def seed_future(self) -> asyncio.Future:
        if self._seed is None:
            self._seed = asyncio.get_running_loop().create_future()
        return self._seed

    def part_values(self, data: bytes | memoryview, part: int, peer: str) -> torch.Tensor:
        """The part's values, read in place from writable float32 bytes (a held row, a recomputed part):
        a fresh 10 MB copy costs more in page faults than the projection that reads it."""
        a, b = self.bounds[part]
        writable = isinstance(data, memoryview) and not data.readonly
        if self.codec is Codec.NONE and not writable:
            data = bytearray(data)  # torch reads float32 only from a writable buffer
        return decode(data, self.codec, b - a, peer=peer)

    def aggregates_contributors(self, part: int) -> list[int]:
        if part == self.me:
            return self.my_contributors
        if part in self.aggregates:
            return list(self.aggregates[part][1].contributors)
        return []

    def true_report(self, seed, output, part: int, contributor: str, data: bytes | memoryview) -> tuple[float, float]:
        """What `contributor` should have reported on `part`, from the bytes it committed to."""
        a, b = self.bounds[part]
        x = self.part_values(data, part, contributor)
        return report(x, output[a:b], direction(seed, part, b - a), self.config.tau)
