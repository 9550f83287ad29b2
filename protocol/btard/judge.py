"""Accusations, judging and ban votes of a verified round (docs/algorithms.md §2 steps 9–10).

Every member judges every accusation itself from signed inputs: proofs that carry their own evidence,
reports checked against the part bytes their accuser must show, silence, disputes, and the fixed-point
check of each aggregate. Signed ban votes are then exchanged, and security.evidence decides who is banned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.btard.claims import Reports
from phalanx.protocol.btard.messages import Accusation, AccuseBody, Verdict, VoteList
from phalanx.protocol.codec import encoded_size_bound, rounding_bound
from phalanx.protocol.transport import CallFailed
from phalanx.security.commitments import ReportBody, part_hash
from phalanx.security.evidence import BanVote, Offense, Vote, banned, check_self_contained
from phalanx.security.phases import RoundPhase
from phalanx.security.projection import fixed_point_holds, report_matches
from phalanx.security.statements import Signed, Statement, open_statement, sign_statement
from phalanx.security.wire import pack, unpack

if TYPE_CHECKING:
    from phalanx.protocol.btard.state import RoundState
    from phalanx.protocol.btard.validator import Validator

logger = logging.getLogger(__name__)

DISMISSED = object()  # an accusation made in good faith that turned out unfounded: nobody is convicted
Convict = Callable[[str, Offense, list[Signed], str], None]  # (peer, offense, evidence, why)


class Judge:
    """One member's judgment of one round, from the public seed, the reports it holds (its own and the
    echoed ones) and the aggregate it gathered (`output`)."""

    def __init__(
        self, vr: RoundState, validator: Validator, seed: bytes, reports: Reports, output: torch.Tensor
    ) -> None:
        self.vr, self.validator, self.seed, self.reports, self.output = vr, validator, seed, reports, output
        self.claims = vr.claims
        self.guilty: dict[str, tuple[Offense, list[Signed]]] = {}
        # (peer, part) -> the true report, where the accused's was false
        self.corrected: dict[tuple[str, int], tuple[float, float]] = {}
        self.recomputations = 0  # contributions this judge recomputed: every judge did, so votes come that late

    def convict(self, peer: str, offense: Offense, evidence: list[Signed], why: str) -> None:
        """`why` goes to the log: an operator reading one conviction sees what this judge held against it."""
        if peer != self.vr.identity.peer_id and peer not in self.guilty:
            me = self.vr.identity.peer_id[-8:]
            logger.info(f"round {self.vr.round_id.hex()[:8]}: judge {me} finds {peer[-8:]} guilty of {offense.value}: {why}")
            self.guilty[peer] = (offense, evidence)

    def _convict_accuser(self, accuser: str, acc: Accusation, why: str) -> None:
        what = f"accused {acc.accused[-8:]} of {acc.offense.value} (part {acc.part}), but {why}"
        self.convict(accuser, Offense.FALSE_ACCUSATION, [self.vr.group_statement], what)

    async def judge(self, accusations: dict[str, list[Accusation]], revealed: set[str]) -> Verdict:
        vr, claims, convict = self.vr, self.claims, self.convict
        group = [vr.group_statement]
        for accused, (offense, evidence) in vr.proofs.items():  # provable offenses first
            convict(accused, offense, evidence, "its own signed statements prove it")
        for accuser, items in accusations.items():
            await self._judge_accuser(accuser, items)
        # silence: members that joined but never committed, or committed and never revealed or reported
        for peer in vr.members:
            missing = [
                phase for phase, got in (("commitment", vr.commits), ("reveal", revealed), ("report", self.reports))
                if peer not in got
            ]  # fmt: skip
            if missing:
                convict(peer, Offense.WITHHELD, group, f"its {' and '.join(missing)} never came")
        # disputes: what most members never got, its reducer withheld; what only a minority never got,
        # they could have taken from the others (relay), so they withhold their report. Parts of
        # reducers already found guilty (a crashed one is silent) settle nothing more.
        for part, disputers in claims.claimants(self.reports, claims.undelivered_of).items():
            reducer = vr.members[part]
            if reducer in self.guilty:
                continue
            if 2 * len(disputers) > len(vr.commits) - 1:
                convict(reducer, Offense.WITHHELD, group, f"most members never got its aggregate of part {part}")
            else:
                for peer in disputers:
                    convict(peer, Offense.WITHHELD, group, f"it alone disputes part {part}, which most members got")
        # parts left out: who was late cannot be proven. A reducer that left out most members' parts, or
        # a member whose part most reducers left out, is the one that failed (an honest majority of
        # reducers counts every part that reached it in time, and honest members send theirs at once).
        # Otherwise the part is dropped and nobody is banned.
        for peer, (_, body) in self.reports.items():
            if claims.left_out_by_most(peer, body):
                convict(peer, Offense.WITHHELD, group, "most reducers left its parts out")
        for part, claimants in claims.claimants(self.reports, claims.left_out_claims).items():
            reducer = vr.members[part]
            if reducer not in self.guilty and 2 * len(claimants) > len(vr.commits) - 1:
                convict(reducer, Offense.LEFT_OUT, group, f"it left most members' parts out of part {part}")
        bad_parts = self.check_aggregates(convict)
        votes = [
            sign_statement(
                vr.identity,
                "ban",
                b"",
                BanVote(accused=p, offense=o, round_id=vr.round_id, evidence=self._evidence(p, o, e)),
            )
            for p, (o, e) in self.guilty.items()
        ]
        disputes = [signed for signed, body in self.reports.values() if body.undelivered or body.left_out]
        verdict = await self._vote(votes, bad_parts, disputes, claims.disputed(self.reports))
        verdict.accusations = sum(len(items) for items in accusations.values())
        return verdict

    def _evidence(self, accused: str, offense: Offense, evidence: list[Signed]) -> list[Signed]:
        """A vote by majority carries the group and, for the swarm at large, the accused's commitment to it."""
        commit = self.vr.commits.get(accused)
        return evidence if offense.self_contained or commit is None else [*evidence, commit[0]]

    async def _judge_accuser(self, accuser: str, items: list[Accusation]) -> None:
        vr = self.vr
        judged: set[tuple[str, Offense, int]] = set()
        for acc in items:
            # judging may fetch a part per accusation: an accuser found false once, or repeating
            # itself, gets no more of our downloads
            if accuser in self.guilty or (acc.accused, acc.offense, acc.part) in judged:
                continue
            if acc.offense is Offense.BAD_CONTRIBUTION and any(o is Offense.BAD_CONTRIBUTION for _, o, _ in judged):
                continue  # a validator checks one member: one replay per accuser
            judged.add((acc.accused, acc.offense, acc.part))
            if acc.offense.self_contained:
                if check_self_contained(acc.offense, acc.accused, vr.round_id, list(acc.evidence)):
                    self.convict(acc.accused, acc.offense, list(acc.evidence), f"{accuser[-8:]} showed the proof")
                else:
                    self._convict_accuser(accuser, acc, "its proof does not hold")
            elif acc.offense is Offense.FALSE_REPORT:
                verdict = await self._judge_false_report(accuser, acc)
                if verdict is DISMISSED:
                    continue
                if isinstance(verdict, str):
                    self._convict_accuser(accuser, acc, verdict)
                else:
                    self.corrected[(acc.accused, acc.part)] = verdict
                    why = f"its report on part {acc.part} differs from the one recomputed from the bytes {accuser[-8:]} showed"
                    self.convict(acc.accused, Offense.FALSE_REPORT, [vr.group_statement], why)
            elif acc.offense is Offense.BAD_CONTRIBUTION:
                if not self.validator.validates(accuser, acc.accused, self.seed) or vr.recompute is None:
                    self._convict_accuser(accuser, acc, "the seed did not make it the validator of that target")
                    continue
                self.recomputations += 1
                if await self.validator.contribution_holds(acc.accused, vr.recompute):
                    self._convict_accuser(accuser, acc, "the recomputed contribution matches its commitment")
                else:
                    why = "its recomputed contribution differs from its commitment"
                    self.convict(acc.accused, Offense.BAD_CONTRIBUTION, [vr.group_statement], why)

    async def _judge_false_report(self, accuser: str, acc: Accusation):
        """The true report if `acc.accused` lied about part `acc.part`; why not (a str) if the accusation is false;
        DISMISSED if it says the accused never reported while we hold a true report of it (it kept
        its report from the accuser alone, which cannot be proven either way).
        Accusers are the part's reducer, and the round's validator about its target (with the report)."""
        vr, part = self.vr, acc.part
        if part < 0 or part >= len(vr.members) or acc.accused not in vr.commits:
            return "no such part, or the accused never committed"
        by_validator = self.validator.validates(accuser, acc.accused, self.seed) and bool(acc.evidence)
        if vr.members[part] != accuser and not by_validator:
            return "it neither reduced that part nor validates the accused"
        entry, unreported = None, not acc.evidence and acc.accused in self.reports
        if acc.evidence or unreported:  # the accused's signed report, or (it never reported to the accuser) ours
            try:
                signed = acc.evidence[0] if acc.evidence else self.reports[acc.accused][0]
                _, claimed = open_statement(signed, ReportBody, kind=RoundPhase.REPORT, round_id=vr.round_id, sender=acc.accused)
            except PeerProtocolError:
                return "the report it showed is not the accused's"
            if part in claimed.undelivered:  # a dispute, not a lie about a report
                return DISMISSED if unreported else "the accused's report disputes that part"
            entry = next((e for e in claimed.entries if e.part == part), None)
        a, b = vr.bounds[part]
        try:
            data = await vr.service.fetch_part(
                accuser, vr.round_id, part, acc.accused, encoded_size_bound(b - a, vr.codec), vr.config.phase_timeout_s
            )
        except (CallFailed, RoundAbortedError, PeerProtocolError) as e:
            return f"it did not show the accused's part ({e})"  # it cannot show what it claims to have received
        if part_hash(data) != vr.commits[acc.accused][1].parts[part]:
            return "the part it showed is not the one the accused committed to"
        if part not in vr.aggregates:
            return "this judge holds no aggregate of that part"  # we cannot judge it
        if entry is not None and entry.aggregate != vr.aggregates[part][1].hash:
            if entry.aggregate in vr.signed_aggregates.get(part, {}):
                return "the report is on another aggregate its reducer signed"  # the reducer equivocated, not the reporter
            entry = None  # a report against an aggregate nobody signed is no report
        true = vr.true_report(self.seed, self.output, part, acc.accused, data)
        if entry is not None and report_matches((entry.s, entry.norm), true, vr.config.tau):
            return DISMISSED if unreported else "the report matches the one recomputed from the part it showed"
        return true

    def check_aggregates(self, convict: Convict) -> set[int]:
        """Parts not to apply: disputed, of a guilty reducer, unchecked, or failing the fixed-point check
        (whose reducer is convicted)."""
        vr = self.vr
        disputed = self.claims.disputed(self.reports)
        bad: set[int] = set(disputed)
        for part in range(len(vr.members)):
            reducer = vr.members[part]
            if reducer in self.guilty:
                bad.add(part)
                continue
            if part in disputed:
                continue
            if part not in vr.aggregates and part != vr.me:
                continue  # not received: already a missing part
            contributors, entries = self.claims.aggregate_reports(part, self.reports)
            if any(peer in self.claims.sitters for peer in contributors):
                # it counted a member whose own signed commitment says it sat the round out
                convict(reducer, Offense.WRONG_AGGREGATE, [vr.group_statement], "it counted a member that sat out")
                bad.add(part)
                continue
            values = []
            for peer, entry in zip(contributors, entries, strict=True):
                entry = self.corrected.get((peer, part), entry)
                if entry is None:
                    break
                values.append(entry)
            if len(values) != len(contributors) or not values:
                # someone's report is missing (they are judged for silence), and its reducer did not show the
                # true one (an honest reducer accuses it, and the judges recompute it): unchecked, not applied
                bad.add(part)
                continue
            a, b = vr.bounds[part]
            v = self.output[a:b]
            slack = rounding_bound(v, vr.codec)  # what the codec may have moved the reducer's aggregate
            if not fixed_point_holds(
                values, [1.0] * len(values), vr.config.tau, vr.config.eps, float(v.norm()), b - a, slack
            ):
                convict(reducer, Offense.WRONG_AGGREGATE, [vr.group_statement], f"part {part} fails the fixed-point check")
                bad.add(part)
        return bad

    def _forwarded_disputes(self, forwarded: list[Signed]) -> set[int]:
        """Disputed parts in signed reports another member forwarded with its votes (each checked)."""
        vr, parts = self.vr, set()
        for signed in forwarded:
            try:
                statement, body = open_statement(signed, ReportBody, kind=RoundPhase.REPORT, round_id=vr.round_id)
            except PeerProtocolError:
                continue
            if statement.sender in vr.commits and statement.sender not in vr.equivocators:
                parts |= self.claims.disputes_of(statement.sender, body)
        return parts

    async def _vote(
        self, votes: list[Signed], bad_parts: set[int], disputes: list[Signed], disputed: set[int]
    ) -> Verdict:
        """Exchange ban votes, and the disputes each member saw (`disputes`: the signed reports behind our
        `disputed` parts), so that a report sent to only some members still makes every member drop the
        same parts."""
        vr = self.vr
        received = await vr.service.exchange.all_to_all(
            vr.round_id, RoundPhase.VOTE, pack(VoteList(votes=votes, disputes=disputes)),
            deadline=vr.next_deadline(vr.recompute_allowance_s(self.recomputations)), expect=vr.committed,
        )  # fmt: skip
        disputed = set(disputed)
        valid: list[Vote] = []
        signed_votes: list[Signed] = []
        for peer, raw in received.items():
            try:
                vote_list = unpack(raw, VoteList, peer=peer)
                for signed in vote_list.votes:
                    statement, body = open_statement(signed, BanVote, kind="ban", round_id=b"", sender=peer)
                    if body.round_id == vr.round_id:
                        valid.append(Vote(peer, body))
                        signed_votes.append(signed)
            except PeerProtocolError:
                continue
            disputed |= self._forwarded_disputes(vote_list.disputes)
        out = banned(valid, trusted=[(vr.round_id, tuple(vr.members))])  # our leader's group, checked by us
        for part, reducer in enumerate(vr.members):
            if reducer in out:
                bad_parts.add(part)
        return Verdict(banned=out, bad_parts=bad_parts | disputed, votes=signed_votes, disputed=disputed)


def failing_aggregates(
    vr: RoundState, validator: Validator, seed: bytes, reports: Reports, output: torch.Tensor
) -> list[str]:
    """Reducers whose aggregate fails its check with the reports as they are (before any judging)."""
    failing: list[str] = []
    Judge(vr, validator, seed, reports, output).check_aggregates(lambda peer, *_: failing.append(peer))
    return failing


async def exchange_accusations(
    vr: RoundState, suspects: bool, reports: Reports
) -> tuple[dict[str, list[Accusation]], bool]:
    """Exchange accusations, with an echo of every report judged by: a member that sent different
    reports to different members (to get an honest reducer convicted by those that got the false one)
    is proven to, and its reports count for nobody. Returns each member's accusations, and whether
    anyone saw something wrong (then every member votes). Validators send theirs after recomputing their
    target's contribution, so the phase waits that much longer."""
    for accused, (offense, evidence) in vr.proofs.items():
        vr.accusations.append(Accusation(accused=accused, offense=offense, part=-1, evidence=evidence))
    echo = [signed for signed, _ in reports.values()]
    body = AccuseBody(accusations=vr.accusations, suspects=suspects, reports=echo)
    mine = sign_statement(vr.identity, RoundPhase.ACCUSE, vr.round_id, body)
    received = await vr.service.exchange.all_to_all(
        vr.round_id, RoundPhase.ACCUSE, pack(mine), deadline=vr.next_deadline(vr.accusation_allowance_s()), expect=vr.committed,
        send=vr.behavior.speaks(RoundPhase.ACCUSE),
    )  # fmt: skip
    out: dict[str, list[Accusation]] = {}
    anyone_suspects = len(received) < len(vr.committed)  # a silent member is itself a reason to vote
    for peer, raw in received.items():
        try:
            signed = unpack(raw, Signed, peer=peer)
            _, body = open_statement(signed, AccuseBody, kind=RoundPhase.ACCUSE, round_id=vr.round_id, sender=peer)
            out[peer] = list(body.accusations)
            anyone_suspects = anyone_suspects or body.suspects
            _compare_reports(vr, body.reports, reports)
        except PeerProtocolError:
            anyone_suspects = True
    return out, anyone_suspects or bool(vr.equivocators)


def _compare_reports(vr: RoundState, echoed: list[Signed], reports: Reports) -> None:
    """Take the echoed reports we lack (a member that kept its report from some members must not split
    their verdicts), and prove equivocation where an echo differs from the report we got."""
    for signed in echoed:
        try:
            sender = unpack(signed.statement, Statement).sender
            mine = reports.get(sender)
            if sender not in vr.commits or (mine is not None and mine[0].statement == signed.statement):
                continue  # the same report: nothing to check (n² of these per round, no signature to verify)
            _, body = open_statement(signed, ReportBody, kind=RoundPhase.REPORT, round_id=vr.round_id, sender=sender)
        except PeerProtocolError:
            continue
        if mine is None:
            reports[sender] = (signed, body)
        else:
            vr.equivocators.add(sender)
            vr.prove(sender, Offense.EQUIVOCATION, [mine[0], signed])
