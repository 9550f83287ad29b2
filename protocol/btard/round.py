"""One member's view of one verified round (BTARD, docs/algorithms.md §2): phases 2 and 6 around the data.

    commit     every member signs the hashes of the parts it will send + an MPRNG commitment;
               nobody sends data before all commitments are in (late members are left out)
    data       parts and aggregates travel with signed statements (protocol.allreduce hooks); an
               aggregate its reducer keeps from a member reaches it through the others (relay.py)
    reveal     MPRNG shares + an echo of the commitments and aggregates each member got; a member
               reveals once it holds every reducer's signed aggregate statement, which heads the
               aggregate's bytes: every aggregate is fixed before anyone can know the seed, and the
               reveal and the projections overlap the rest of the gather
    report     each contributor's projection of its part against each aggregate, and the parts it
               disputes (claims.py)
    validate   a validator chosen by the public seed recomputes one member's gradient (validator.py)
    accuse     accusations with evidence, and an echo of every report judged by
    judge/vote every member judges every accusation itself; signed ban votes are exchanged (judge.py)

Every member runs the same checks on the same signed inputs, so honest members reach the
same verdicts and keep the same state version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import torch

from phalanx.aggregation.base import norm_limit
from phalanx.errors import PeerProtocolError
from phalanx.protocol.btard.judge import Judge, exchange_accusations, failing_aggregates
from phalanx.protocol.btard.messages import Verdict
from phalanx.protocol.btard.relay import AggregateRelay
from phalanx.protocol.btard.reports import Reporter
from phalanx.protocol.btard.service import BtardService, Held
from phalanx.protocol.btard.state import RoundState
from phalanx.protocol.btard.validator import Validator
from phalanx.protocol.codec import Codec, decode, encoded_size_bound
from phalanx.protocol.exchange import Check, signed_by_sender
from phalanx.security.commitments import (
    AggregateBody,
    CommitBody,
    PartBody,
    members_digest,
    part_hash,
    part_hasher,
    public_seed,
    share_commitment,
)
from phalanx.security.evidence import Offense, RevealBody
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import Signed, Statement, open_statement, sign_statement
from phalanx.security.wire import pack, unpack

logger = logging.getLogger(__name__)
# of a phase timeout: how long a member asks the others for commitments and reveals that never reached it.
# Every member must derive the seed from the same reveals; one lost on a single link (a relayed connection
# between two homes) would give one honest member another seed, and every report of its a false one.
PHASE_RELAY = 0.25


class VerifiedRound(RoundState):
    """One member's view of one verified round, run phase by phase; also the data phases' PartGuard."""

    def __init__(self, service: BtardService, **fields: Any) -> None:
        """`fields`: RoundState's (round id, members, group statement, bounds, codec, config, behavior, vector)."""
        super().__init__(service, **fields)
        self.relay = AggregateRelay(self, adopt=self.adopt_statement)
        self.validator = Validator(self)
        self.reporter = Reporter(self, self.relay)
        self._reveal_task: Optional[asyncio.Task] = None
        self._validating: Optional[asyncio.Task] = None  # starts with the seed, while the gather may still run
        self._verifying = False  # once verification began, the held parts stay for the judges
        self._echoes: Optional[asyncio.Task] = None  # aggregate statements taken from early reveals
        service.open[self.round_id] = self

    @property
    def undelivered(self) -> set[int]:
        """Parts we stopped waiting for; once the data phase is over, every part that did not land whole."""
        return self.relay.settled(relayed=False)

    async def serve_relay(self, peer: str, part: int, payload: bool) -> tuple[bytes, bytes | memoryview]:
        return await self.relay.serve(peer, part, payload)

    # ---- phase 2: commit ----------------------------------------------------------------------

    async def commit(self, payloads: list[bytes | memoryview], *, sits_out: bool = False) -> None:
        """Commit to the exact bytes of every part; afterwards `committed` lists who may take part.
        `sits_out`: this member's parts count in no aggregate (it still reduces, reports and judges)."""
        loop = asyncio.get_running_loop()  # BLAKE3 releases the GIL: hash the parts side by side, off the loop
        self.my_hashes = list(await asyncio.gather(*(loop.run_in_executor(None, part_hash, p) for p in payloads)))
        self.payloads[self.identity.peer_id] = payloads[self.me]  # a view of the vector, which outlives the round
        body = CommitBody(
            members=members_digest(self.members),
            parts=self.behavior.committed_hashes(self.my_hashes),
            mprng=share_commitment(self.round_id, self.identity.peer_id, self.share),
            sits_out=sits_out,
        )
        mine = sign_statement(self.identity, RoundPhase.COMMIT, self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id, RoundPhase.COMMIT, pack(mine), deadline=self.next_deadline(), send=self.behavior.speaks(RoundPhase.COMMIT),
            relay=self._relay(RoundPhase.COMMIT),
        )  # fmt: skip
        digest = members_digest(self.members)
        for peer, raw in received.items():
            try:
                signed = unpack(raw, Signed, peer=peer)
                _, commit = open_statement(signed, CommitBody, kind=RoundPhase.COMMIT, round_id=self.round_id, sender=peer)
                if commit.members != digest or len(commit.parts) != len(self.members):
                    raise PeerProtocolError("commitment for another group", peer=peer)
            except PeerProtocolError as e:
                logger.info(f"dropping {peer[-8:]} from round {self.round_id.hex()[:8]}: {e}")
                continue
            self.commits[peer] = (signed, commit)
        self.expected = {self.members.index(peer) for peer in self.commits}
        self._echoes = asyncio.ensure_future(self._statements_from_reveals())

    # ---- phases 3-5: PartGuard hooks ----------------------------------------------------------

    def sign_part(self, part: int, payload: bytes | memoryview, weight: float) -> bytes:
        a, b = self.bounds[part]
        if len(payload) > encoded_size_bound(b - a, self.codec):  # signing it would prove an offense of ours
            raise RuntimeError(f"our {self.codec.value} part of {b - a} values takes {len(payload)} bytes: beyond its bound")
        body = PartBody(
            part=part, hash=self.my_hashes[part], weight=weight, numel=b - a, codec=self.codec.value,
            size=self.behavior.signed_part_size(len(payload)),
        )  # fmt: skip
        return pack(sign_statement(self.identity, "part", self.round_id, body))

    def check_size(self, sender: int, part: int, header, payload_len: int) -> None:
        """At the sink, before the part's bytes are allocated: a signed size beyond what the signed codec
        takes for the signed numel is proof (self-contained: anyone can check it without the round); a
        signed numel or codec other than the round's, or a declared length other than the signed size, is
        refused (the transport's header is not signed)."""
        peer = self.members[sender]
        signed, body = self._part_statement(peer, part, header)
        if body.oversized():
            self.prove(peer, Offense.OVERSIZED_PART, [signed])
            raise PeerProtocolError(f"signed {body.size} bytes for {body.numel} values of {body.codec[:16]}", peer=peer)
        a, b = self.bounds[part]
        if body.numel != b - a or body.codec != self.codec.value:
            raise PeerProtocolError(
                f"signed a part of {body.numel} values of {body.codec[:16]}, the round's has {b - a} of {self.codec.value}",
                peer=peer,
            )
        if payload_len != body.size:
            raise PeerProtocolError(f"declared {payload_len} bytes, signed {body.size}", peer=peer)

    def _part_statement(self, peer: str, part: int, header) -> tuple[Signed, PartBody]:
        """The part statement `peer` signed in `header`, for this round and `part`, once it committed."""
        if peer not in self.commits:
            raise PeerProtocolError("sent a part without a commitment", peer=peer)
        signed = unpack(header.signature, Signed, peer=peer)
        _, body = open_statement(signed, PartBody, kind="part", round_id=self.round_id, sender=peer)
        if body.part != part:
            raise PeerProtocolError("signed a part statement for another part", peer=peer)
        return signed, body

    def hasher(self):
        return part_hasher()

    def accept_part(self, sender: int, part: int, payload: bytes | memoryview, header, digest: bytes) -> None:
        peer = self.members[sender]
        signed, body = self._part_statement(peer, part, header)
        if body.weight != 1.0:  # BTARD-SGD counts every member once: the checks assume it
            self.prove(peer, Offense.INFLATED_WEIGHT, [signed])
            raise PeerProtocolError(f"claimed weight {body.weight}", peer=peer)
        if body.weight != header.weight:
            raise PeerProtocolError("header weight differs from the signed one", peer=peer)
        commit_signed, commit = self.commits[peer]
        if body.hash != commit.parts[part]:
            self.prove(peer, Offense.BAD_COMMITMENT, [commit_signed, signed])
            raise PeerProtocolError("part does not match its commitment", peer=peer)
        if len(payload) != body.size:  # (the sink held the declared length to it; this is the bytes themselves)
            raise PeerProtocolError(f"sent {len(payload)} bytes, signed {body.size}", peer=peer)
        if digest != body.hash:
            raise PeerProtocolError("part bytes do not match their signed hash", peer=peer)
        a, b = self.bounds[part]
        norm = float(torch.linalg.vector_norm(decode(payload, self.codec, b - a, peer=peer)))
        if not norm <= norm_limit(torch.float32):
            # CenteredClip would skip it, but then its sender's report (NaN, Inf) fails every check: the
            # part is left out instead, and a sender whose parts most reducers left out is banned
            raise PeerProtocolError(f"sent a part with NaN, Inf or a norm of {norm:.3g}", peer=peer)
        self.part_statements[peer] = signed
        # raw float32 parts live on in the reducer's rows (kept for the round): no copy needed
        self.payloads[peer] = payload if self.codec is Codec.NONE else bytes(payload)

    def counted(self, received: list[int]) -> list[int]:
        sitters = self.sitters
        return self.behavior.counted(self, [i for i in received if self.members[i] not in sitters])

    def sign_aggregate(self, part: int, payload: bytes | memoryview, contributors: list[int]) -> bytes:
        self.my_contributors = list(contributors)
        body = AggregateBody(part=part, hash=part_hash(payload), contributors=list(contributors))
        signed = sign_statement(self.identity, "aggregate", self.round_id, body)
        # held from now on: a validator may fetch a part as soon as the seed is public
        self.service.hold(self.round_id, Held(part, dict(self.payloads), frozenset(self.members)))
        self._record_aggregate(part, signed, body)
        self.relay.wait_for_reports()
        return pack(signed)

    async def _statements_from_reveals(self) -> None:
        """Take the aggregate statements others echo in early reveals: a reducer that holds its statement
        back from us cannot keep us from revealing in time (each one is signed by its reducer)."""
        seen: set[str] = set()
        while self._reveal_task is None:
            arrived = await self.service.exchange.arrivals(self.round_id, RoundPhase.REVEAL, seen)
            seen |= set(arrived)
            for peer, raw in arrived.items():
                opened = self._open_reveal(peer, raw)
                for echoed in opened[1].aggregates if opened is not None else []:
                    self.adopt_statement(echoed)

    def adopt_statement(self, echoed: Signed) -> None:
        """Record an echoed aggregate statement we still lack (its signature is checked only then)."""
        try:
            sender = unpack(echoed.statement, Statement).sender
            part = self.members.index(sender) if sender in self.members else -1
            if part not in (self.expected or set()) or part in self.aggregates or part in self.undelivered:
                return
            _, body = open_statement(echoed, AggregateBody, kind="aggregate", round_id=self.round_id, sender=sender)
        except PeerProtocolError:
            return
        if body.part == part and body.well_formed(len(self.members), sender in self.sitters) and self._reveal_task is None:
            self._record_aggregate(part, echoed, body)

    def fallback(self, part: int) -> asyncio.Future:
        return self.relay.fallback(part)

    def reducer_failed(self, part: int) -> None:
        self.relay.reducer_failed(part)

    def reply_for(self, receiver: int, header: bytes, payload: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
        return self.behavior.aggregate_reply(self, receiver, header, payload)

    def announced(self, part: int, header) -> None:
        """The reducer of `part` signed the aggregate whose bytes now follow."""
        reducer = self.members[part]
        if part in self.undelivered:
            raise PeerProtocolError("aggregate statement came after we stopped waiting for it", peer=reducer)
        signed = unpack(header.statement, Signed, peer=reducer)
        _, body = open_statement(signed, AggregateBody, kind="aggregate", round_id=self.round_id, sender=reducer)
        if body.part != part:
            raise PeerProtocolError("signed an aggregate statement for another part", peer=reducer)
        if not body.well_formed(len(self.members), reducer in self.sitters):
            raise PeerProtocolError("signed an aggregate whose contributors are not a list of members", peer=reducer)
        if part in self.aggregates and self.aggregates[part][0].statement != signed.statement:  # known from an echo
            self.prove(reducer, Offense.EQUIVOCATION, [self.aggregates[part][0], signed])
            raise PeerProtocolError("sent us another aggregate than the one it signed for the others", peer=reducer)
        self._record_aggregate(part, signed, body)

    def accept_aggregate(self, part: int, payload: bytes | memoryview, header, digest: bytes) -> None:
        if part in self.undelivered:
            raise PeerProtocolError("aggregate came after we stopped waiting for it", peer=self.members[part])
        signed, body = self.aggregates.get(part, (None, None))
        if signed is None or signed.statement != unpack(header.statement, Signed, peer=self.members[part]).statement:
            raise PeerProtocolError(
                "aggregate arrived without the statement that announced it", peer=self.members[part]
            )
        if digest != body.hash:
            raise PeerProtocolError("aggregate does not match its signed statement", peer=self.members[part])
        self.relay.received[part] = payload  # a fresh buffer per reply (raw parts: their slice of the output)

    def _record_aggregate(self, part: int, signed: Signed, body: AggregateBody) -> None:
        self.aggregates[part] = (signed, body)
        self.signed_aggregates.setdefault(part, {})[body.hash] = signed
        if self._reveal_task is None and self.expected is not None and self.expected <= set(self.aggregates):
            self._reveal_task = asyncio.ensure_future(self._reveal())  # every aggregate is fixed now

    def landed(self, part: int, value: torch.Tensor, rows: Optional[torch.Tensor] = None, received=()) -> None:
        """Aggregate `part` is final (as this member will apply it): start its projections off the
        event loop while other parts are still moving."""
        self.landed_parts.add(part)
        self.relay.landed(part)
        self.reporter.landed(part, value, rows)

    async def close(self) -> None:
        """Stop the round's background work and hand its buffers back (no thread may still write them)."""
        self.service.open.pop(self.round_id, None)
        tasks = [t for t in (self._reveal_task, self._validating, self._echoes) if t is not None]
        for task in tasks:
            task.cancel()
        if not self.seed_future().done():
            self.seed_future().cancel()
        await asyncio.gather(self.relay.close(), self.reporter.close(), *tasks, return_exceptions=True)
        if not self._verifying:  # the data phase failed: nobody will judge this round
            self.service.release(self.round_id)
        # The data phase keeps this object as its part guard for a few seconds more (late parts), into the
        # next round: a validator's recomputation (a whole vector, its parts viewed here) must not stay
        # with it. What judges may still ask for is held by the service (hold_target), not by this name.
        self.validator.target_parts = {}

    # ---- phase 6: verify and judge ------------------------------------------------------------

    async def verify(
        self,
        output: torch.Tensor,
        own_rows: Optional[torch.Tensor],
        own_received: tuple[int, ...],
    ) -> Verdict:
        """Run reveal, report, validation, accusation and voting; returns who is banned and which
        aggregates must not be applied. `output` is the gathered result (this member's contribution is `self.vector`)."""
        try:
            verdict = await self._verify(output, own_rows, own_received)
            verdict.relayed = self.relay.settled(relayed=True)
            seed = self.seed_future()
            verdict.seed = seed.result() if seed.done() and not seed.cancelled() else b""
            verdict.contributors = tuple(sorted(self.contributors))
            verdict.committed = tuple(sorted(self.committed))
            return verdict
        finally:
            await self.close()

    async def _verify(self, output, own_rows, own_received) -> Verdict:
        self._verifying = True
        if not self.service.holds(self.round_id):  # a round where this member reduced nothing
            self.service.hold(self.round_id, Held(self.me, dict(self.payloads), frozenset(self.members)))
        t0 = time.monotonic()
        early = self._reveal_task is not None
        if self._reveal_task is None:  # some reducer's statement never came: reveal now
            self._reveal_task = asyncio.ensure_future(self._reveal())
        seed, revealed = await self._reveal_task
        t1 = time.monotonic()
        # What needs only the seed runs while the reports travel: the reducer's own projections of
        # every part it received (off the event loop) and the validator's recomputation (started with the seed).
        truth = None
        if own_rows is not None:
            truth = asyncio.ensure_future(self.reporter.reducer_truth(seed, output, own_rows, own_received))
        validating = self._validating
        target_truths = asyncio.ensure_future(self.validator.target_truths(validating, seed, output))
        try:
            reports = await self.reporter.exchange(seed, output)
            t2 = time.monotonic()
            if truth is not None:
                self.reporter.check_as_reducer(reports, own_received, await truth)
            self.validator.check_target_reports(seed, reports, await target_truths)
        finally:
            validating.cancel()
            # never leave a thread reading the rows or the target's parts
            await asyncio.gather(*(t for t in (truth, target_truths) if t is not None), return_exceptions=True)
        suspects = self._suspects_anything(seed, reports, output, revealed)
        t3 = time.monotonic()
        accusations, anyone_suspects = await exchange_accusations(self, suspects, reports)
        reports = {peer: r for peer, r in reports.items() if peer not in self.equivocators}
        logger.debug(
            f"round {self.round_id.hex()[:8]} verify: reveal {t1 - t0:.3f} s{' (started in the data phase)' if early else ''}, report {t2 - t1:.3f} s, "
            f"checks {t3 - t2:.3f} s, accuse {time.monotonic() - t3:.3f} s"
        )
        if not anyone_suspects and not any(accusations.values()):
            # Every member saw a clean round: nothing to judge, no vote phase, and nobody will ask for the
            # held parts (validators fetch them before they send their accusations, which we all have).
            self.service.release(self.round_id)
            return Verdict(clean=True)
        return await Judge(self, self.validator, seed, reports, output).judge(accusations, revealed)

    def _suspects_anything(self, seed, reports, output, revealed) -> bool:
        """Whether this member will have a verdict to vote on even without accusations."""
        if self.proofs or self.accusations:
            return True
        if any(p not in self.commits or p not in revealed or p not in reports for p in self.members):
            return True
        claims = self.claims
        if claims.disputed(reports) or any(claims.left_out_by_most(peer, body) for peer, (_, body) in reports.items()):
            return True  # the disputed parts are dropped (and who failed banned) by a verdict everyone computes alike
        return bool(failing_aggregates(self, self.validator, seed, reports, output))

    async def _reveal(self) -> tuple[bytes, set[str]]:
        body = RevealBody(
            share=self.share,
            commits=[signed for signed, _ in self.commits.values()],
            aggregates=[signed for signed, _ in self.aggregates.values()],
        )
        mine = sign_statement(self.identity, RoundPhase.REVEAL, self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id,
            RoundPhase.REVEAL,
            pack(mine),
            deadline=self.next_deadline(),
            send=self.behavior.speaks(RoundPhase.REVEAL),
            expect=self.committed,
            relay=self._relay(RoundPhase.REVEAL),
        )
        shares: dict[str, bytes] = {}
        for peer, raw in received.items():
            if peer not in self.commits:
                continue
            opened = self._open_reveal(peer, raw)
            if opened is None:
                continue
            signed, reveal = opened
            commit_signed, commit = self.commits[peer]
            if share_commitment(self.round_id, peer, reveal.share) != commit.mprng:
                self.prove(peer, Offense.BAD_REVEAL, [commit_signed, signed])
                continue
            shares[peer] = reveal.share
            self._compare_echoes(reveal)
        seed = public_seed(self.round_id, shares)
        self.seed_future().set_result(seed)
        self._validating = asyncio.ensure_future(self.validator.validate(seed))
        return seed, set(shares)

    def _relay(self, phase: RoundPhase) -> tuple[float, Check]:
        return PHASE_RELAY * self.config.phase_timeout_s, signed_by_sender(self.round_id, phase)

    def _open_reveal(self, peer: str, raw: bytes) -> Optional[tuple[Signed, RevealBody]]:
        try:
            signed = unpack(raw, Signed, peer=peer)
            return signed, open_statement(signed, RevealBody, kind=RoundPhase.REVEAL, round_id=self.round_id, sender=peer)[1]
        except PeerProtocolError as e:
            logger.info(f"bad reveal from {peer[-8:]}: {e}")
            return None

    def _compare_echoes(self, reveal: RevealBody) -> None:
        """Two different signed commitments or aggregates for one slot prove equivocation."""
        for echoed in list(reveal.commits) + list(reveal.aggregates):
            try:
                statement = unpack(echoed.statement, Statement)
            except PeerProtocolError:
                continue
            if statement.kind == RoundPhase.COMMIT and statement.sender in self.commits:
                mine = self.commits[statement.sender][0]
                if echoed.statement != mine.statement:
                    self.prove(statement.sender, Offense.EQUIVOCATION, [mine, echoed])
            elif statement.kind == "aggregate" and statement.sender in self.members:
                part = self.members.index(statement.sender)
                try:
                    _, body = open_statement(echoed, AggregateBody, kind="aggregate", round_id=self.round_id)
                except PeerProtocolError:
                    continue
                if body.part == part:
                    self.signed_aggregates.setdefault(part, {})[body.hash] = echoed
                if part in self.aggregates and echoed.statement != self.aggregates[part][0].statement:
                    self.prove(statement.sender, Offense.EQUIVOCATION, [self.aggregates[part][0], echoed])
