"""What members' signed reports say about parts besides projections: aggregates they never got
(`undelivered`) and aggregates that did not count their part (`left_out`). Every member reads the same
reports the same way, so every member drops the same disputed parts.

A member that says most reducers left it out did not deliver (an honest majority of reducers counts every
part that reached it in time): it is banned, and its claims settle nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from phalanx.security.commitments import ReportBody
from phalanx.security.statements import Signed

Reports = dict[str, tuple[Signed, ReportBody]]  # member -> its signed report


class Claims:
    """How one member reads reports, given the round's members, how many committed, and each
    aggregate's contributors as its reducer signed them."""

    def __init__(
        self,
        members: tuple[str, ...],
        committed: int,
        contributors: Callable[[int], list[int]],
        sitters: frozenset[str] = frozenset(),
    ) -> None:
        self.members, self.committed, self.contributors = members, committed, contributors
        self.sitters = sitters  # members that sat the round out: no aggregate counts them, so none left them out

    def undelivered_of(self, peer: str, body: ReportBody) -> set[int]:
        """Parts `peer` says it never received (its own part does not count)."""
        return {part for part in body.undelivered if part < len(self.members) and self.members[part] != peer}

    def left_out_by_most(self, peer: str, body: ReportBody) -> bool:
        """Whether `peer` says most other reducers left its part out."""
        if peer in self.sitters:
            return False
        claims = {part for part in body.left_out if part < len(self.members) and self.members[part] != peer}
        return 2 * len(claims) > self.committed - 1

    def left_out_claims(self, peer: str, body: ReportBody) -> set[int]:
        """Parts whose reducer `peer` says left its part out (and whose statement we hold does not count it)."""
        if peer in self.sitters or self.left_out_by_most(peer, body):
            return set()
        index = self.members.index(peer)
        return {
            part for part in body.left_out
            if part < len(self.members) and part != index and index not in self.contributors(part)
        }  # fmt: skip

    def disputes_of(self, peer: str, body: ReportBody) -> set[int]:
        """Parts `peer` disputes: never received, or aggregated without its part."""
        if self.left_out_by_most(peer, body):
            return set()
        return self.undelivered_of(peer, body) | self.left_out_claims(peer, body)

    def claimants(self, reports: Reports, claims: Callable[[str, ReportBody], set[int]]) -> dict[int, set[str]]:
        """Part -> the members whose reports make `claims` about it."""
        out: dict[int, set[str]] = {}
        for peer, (_, body) in reports.items():
            for part in claims(peer, body):
                out.setdefault(part, set()).add(peer)
        return out

    def disputed(self, reports: Reports) -> set[int]:
        """Parts some member disputes: nobody applies them (their check lacks its report, or its part)."""
        return set(self.claimants(reports, self.disputes_of))

    def aggregate_reports(self, part: int, reports: Reports) -> tuple[list[str], list[Optional[tuple[float, float]]]]:
        """Contributors of `part` (as its reducer signed them) and their (s, norm) for it (None if missing)."""
        contributors = [self.members[i] for i in self.contributors(part)]
        out = []
        for peer in contributors:
            entry = None
            if peer in reports:
                for e in reports[peer][1].entries:
                    if e.part == part:
                        entry = (e.s, e.norm)
            out.append(entry)
        return contributors, out
