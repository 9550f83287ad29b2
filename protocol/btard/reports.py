"""Projection reports (docs/algorithms.md §2 step 7): each contributor's (s, ‖x − v‖) of its part against
each aggregate along the round's public random direction, which the fixed-point check sums.

Projections start as aggregates land, off the event loop: x − v and its norm at once, ⟨z, x − v⟩ once
the seed is public. A reducer also projects every row it aggregated, to check its contributors' reports.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Optional

import torch

from phalanx.errors import PeerProtocolError
from phalanx.protocol.btard.claims import Reports
from phalanx.protocol.btard.messages import Accusation
from phalanx.protocol.codec import Codec, decode, encode
from phalanx.security.commitments import ReportBody, ReportEntry
from phalanx.security.evidence import Offense
from phalanx.security.phases import RoundPhase
from phalanx.security.projection import (
    clipped_reports,
    direction,
    distances,
    projections,
    recompute,
    report,
    report_matches,
)
from phalanx.security.statements import Signed, open_statement, sign_statement
from phalanx.security.wire import pack, unpack

if TYPE_CHECKING:
    from phalanx.protocol.btard.relay import AggregateRelay
    from phalanx.protocol.btard.state import RoundState

logger = logging.getLogger(__name__)


class Reporter:
    """One member's projections and reports in one verified round."""

    def __init__(self, vr: RoundState, relay: AggregateRelay) -> None:
        self.vr, self.relay = vr, relay
        self._own: dict[int, asyncio.Task] = {}  # part -> (s, ‖x − v‖) (1,) each of this member's contribution
        self._rows: Optional[asyncio.Task] = None  # (s, norms) (k,) each of every row our aggregate came from

    def landed(self, part: int, value: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        """Start projecting this member's contribution to `part` (if counted) and, for its own part, `rows`."""
        vr = self.vr
        if vr.me in vr.aggregates_contributors(part):
            own = self.as_sent(part).view(1, -1)
            self._own[part] = asyncio.ensure_future(self._project(part, own, value))
        if rows is not None:
            self._rows = asyncio.ensure_future(self._project(part, rows, value))

    async def counted_projections(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """As a reducer, once the seed is public: (s, ‖x − v‖) of every part its aggregate counted."""
        return None if self._rows is None else await asyncio.shield(self._rows)

    async def _project(self, part: int, rows: torch.Tensor, value: torch.Tensor):
        """(s, ‖x − v‖) (k,) each for `rows` against aggregate `value`. Cancelled only while it waits for the seed."""
        loop = asyncio.get_running_loop()
        norms = await loop.run_in_executor(None, distances, rows, value)
        seed = await asyncio.shield(self.vr.seed_future())
        z = direction(seed, part, rows.shape[1])
        return clipped_reports(
            await loop.run_in_executor(None, projections, rows, value, z), norms, self.vr.config.tau
        ), norms

    def as_sent(self, part: int) -> torch.Tensor:
        """This member's part as its reducer decoded it (lossy codecs change it)."""
        vr = self.vr
        a, b = vr.bounds[part]
        values = vr.vector[a:b].detach().float().cpu()
        if vr.codec is Codec.NONE:
            return values
        return decode(bytearray(encode(values, vr.codec)), vr.codec, b - a)

    def _own_reports(
        self, seed, output, done: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[int, float, float]]:
        """(part, s, norm) of this member's contribution to every aggregate that counted it."""
        vr, out = self.vr, []
        for part in range(len(vr.members)):
            if vr.me not in vr.aggregates_contributors(part) or part not in vr.landed_parts:
                continue
            if part in done:  # projected as the aggregate landed
                s, norms = done[part]
                out.append((part, float(s[0]), float(norms[0])))
            else:
                a, b = vr.bounds[part]
                out.append(
                    (part, *report(self.as_sent(part), output[a:b], direction(seed, part, b - a), vr.config.tau))
                )
        return out

    def _left_out_of(self) -> set[int]:
        """Aggregates that did not count this member's part, though it sent one (their reducer committed)."""
        vr = self.vr
        if vr.identity.peer_id in vr.sitters:
            return set()  # no aggregate was to count us
        return {
            part for part in vr.aggregates
            if part != vr.me and part in (vr.expected or set()) and vr.me not in vr.aggregates_contributors(part)
        }  # fmt: skip

    async def exchange(self, seed: bytes, output: torch.Tensor) -> Reports:
        """Send this member's signed report; the members' reports that arrived in time."""
        vr = self.vr
        entries = []
        self.relay.give_up(vr.missing_parts())  # the data phase is over: what did not land never will
        done = {part: await task for part, task in self._own.items()}
        own = await asyncio.get_running_loop().run_in_executor(None, self._own_reports, seed, output, done)
        for part, s, norm in own:
            s, norm = await vr.behavior.reported(vr, part, s, norm)
            entries.append(ReportEntry(part=part, aggregate=vr.aggregates[part][1].hash, s=s, norm=norm))
        body = ReportBody(
            entries=entries,
            undelivered=sorted(vr.behavior.claimed_undelivered(vr, self.relay.settled(relayed=False))),
            left_out=sorted(self._left_out_of()),
        )
        mine_signed = sign_statement(vr.identity, RoundPhase.REPORT, vr.round_id, body)
        received = await vr.service.exchange.all_to_all(
            vr.round_id, RoundPhase.REPORT, pack(mine_signed), deadline=vr.next_deadline(), send=vr.behavior.speaks(RoundPhase.REPORT),
            expect=vr.committed, payload_for=vr.behavior.reports_for(vr, body),
        )  # fmt: skip
        reports = {}
        for peer, raw in received.items():
            if peer not in vr.commits:
                continue
            try:
                signed = unpack(raw, Signed, peer=peer)
                _, body = open_statement(signed, ReportBody, kind=RoundPhase.REPORT, round_id=vr.round_id, sender=peer)
                reports[peer] = (signed, body)
            except PeerProtocolError as e:
                logger.info(f"bad report from {peer[-8:]}: {e}")
        return reports

    async def reducer_truth(self, seed, output, own_rows, own_received) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm) of every part this reducer received, from the exact rows it aggregated."""
        vr = self.vr
        if self._rows is not None:
            s, norms = await self._rows
            if len(norms) == len(own_received):
                return s, norms
        a, b = vr.bounds[vr.me]
        received = list(own_received)
        rows = own_rows if len(received) == own_rows.shape[0] else own_rows[received]  # no copy when all arrived
        z = direction(seed, vr.me, b - a)
        return await asyncio.get_running_loop().run_in_executor(None, recompute, rows, output[a:b], z, vr.config.tau)

    def check_as_reducer(self, reports: Reports, own_received, truth) -> None:
        """Accuse every contributor to our part whose report differs from what its row shows."""
        vr = self.vr
        part = vr.me
        s_true, n_true = truth
        for k, i in enumerate(own_received):
            peer = vr.members[i]
            if peer == vr.identity.peer_id:
                continue
            true = (float(s_true[k]), float(n_true[k]))
            if peer not in reports:  # a contributor that does not report: judges take the true value from us
                vr.accusations.append(Accusation(accused=peer, offense=Offense.FALSE_REPORT, part=part, evidence=[]))
                continue
            if part in reports[peer][1].undelivered:
                continue  # it says our aggregate never reached it: judged as a dispute, the part is dropped
            entry = next((e for e in reports[peer][1].entries if e.part == part), None)
            mine = vr.aggregates[part][1].hash
            if (
                entry is None
                or entry.aggregate != mine
                or not report_matches((entry.s, entry.norm), true, vr.config.tau)
            ):
                vr.accusations.append(
                    Accusation(accused=peer, offense=Offense.FALSE_REPORT, part=part, evidence=[reports[peer][0]])
                )
        for victim in vr.behavior.false_accusations(vr, reports):
            vr.accusations.append(
                Accusation(accused=victim, offense=Offense.FALSE_REPORT, part=part, evidence=[reports[victim][0]])
            )

    async def close(self) -> None:
        """Wait for the projections: no thread may still read the rows once they are handed back."""
        pending = list(self._own.values()) + ([self._rows] if self._rows is not None else [])
        await asyncio.gather(*pending, return_exceptions=True)
