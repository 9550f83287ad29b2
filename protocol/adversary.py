"""Protocol-level attacks, for tests, demos and benchmarks (`phalanx join --attack NAME`).

Each attack overrides one hook of `Behavior` (protocol/btard/behavior.py), the honest member
the verified round consults wherever a member could lie. Gradient-level
attacks (what a member contributes) live with the trainer in peer/attacks.py.
"""

from __future__ import annotations

import torch
from phalanx.aggregation.registry import Registry
from phalanx.protocol.btard.behavior import Behavior
from phalanx.security.commitments import AggregateBody, part_hash
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import sign_statement
from phalanx.security.wire import pack, unpack


class WrongAggregate(Behavior):
    """As a reducer, returns its aggregate shifted far from the fixed point (the same to everyone).
    One random projection misses a shift with a small probability (0 of 2000 seeds for this one on the
    test swarm's data; 1 of 2000 for a tenth of it)."""

    name = "wrong_aggregate"

    def wrap_reducer(self, reducer):
        def shifted(rows, weights):
            value = reducer(rows, weights)
            return value + (value.abs().mean() + 1e-3)
        return shifted


class Equivocate(Behavior):
    """As a reducer, sends a different (signed) aggregate to every other receiver."""

    name = "equivocate"

    def aggregate_reply(self, vr, receiver, header, payload):
        if receiver % 2 == 0:
            return header, payload
        from phalanx.protocol.allreduce import AggregateHeader

        forged = torch.frombuffer(bytearray(payload), dtype=torch.float32) + 1.0
        data = forged.numpy().tobytes()
        head = unpack(header, AggregateHeader)
        body = AggregateBody(part=vr.me, hash=part_hash(data), contributors=vr.my_contributors)
        statement = pack(sign_statement(vr.identity, "aggregate", vr.round_id, body))
        return pack(AggregateHeader(contributors=head.contributors, statement=statement)), data


class FalseReport(Behavior):
    """Reports projections that do not match its data (to frame honest reducers)."""

    name = "false_report"

    async def reported(self, vr, part, s, norm):
        return s + 0.5 * norm + 1.0, norm


class CoverUp(WrongAggregate):
    """As a reducer, shifts its aggregate (as wrong_aggregate) and covers it up with its report on its own
    part, which only it holds: s chosen so that the fixed-point sum comes out 0. Only the validator, when
    the public seed makes it this member's target, holds that part too."""

    name = "cover_up"

    async def reported(self, vr, part, s, norm):
        counted = await vr.reporter.counted_projections() if part == vr.me else None
        return (s, norm) if counted is None else (s - float(counted[0].sum()), norm)


class EquivocateReport(Behavior):
    """Sends its true report to one reducer and, to everyone else, a report that puts that reducer's
    aggregate off its fixed point: the reducer sees nothing to accuse, the others see a wrong aggregate."""

    name = "equivocate_report"

    def reports_for(self, vr, body):
        victim = (vr.me + 1) % len(vr.members)
        entries = [e.model_copy(update={"s": e.s + 0.5 * e.norm + 1.0}) if e.part == victim else e for e in body.entries]
        forged = pack(sign_statement(vr.identity, RoundPhase.REPORT, vr.round_id, body.model_copy(update={"entries": entries})))
        return {peer: forged for i, peer in enumerate(vr.members) if i not in (vr.me, victim)}


class WithholdReport(Behavior):
    """Sends its report to everyone but one reducer, which must then accuse it of not reporting while
    the others hold the report (to get that reducer convicted of a false accusation)."""

    name = "withhold_report"

    def reports_for(self, vr, body):
        return {vr.members[(vr.me + 1) % len(vr.members)]: None}


class FalseAccusation(Behavior):
    """As a reducer, accuses an honest contributor of a false report."""

    name = "false_accusation"

    def false_accusations(self, vr, reports):
        victims = sorted(p for p in reports if p != vr.identity.peer_id)
        return victims[:1]


class WithholdReveal(Behavior):
    """Commits to an MPRNG share and never reveals it (to bias the public seed)."""

    name = "withhold_reveal"

    def speaks(self, phase):
        return phase != RoundPhase.REVEAL


class BadCommitment(Behavior):
    """Commits to its honest parts, then sends different bytes."""

    name = "bad_commitment"

    def sent_vector(self, vector):
        return -vector


class Silent(Behavior):
    """Joins groups and then stays silent."""

    name = "silent"
    silent = True


class WithholdAggregate(Behavior):
    """As a reducer, signs its aggregate and delivers it to nobody (nobody can relay it either)."""

    name = "withhold_aggregate"

    def aggregate_reply(self, vr, receiver, header, payload):
        from phalanx.errors import RoundAbortedError

        raise RoundAbortedError("withheld (attack)")


class FalseDispute(Behavior):
    """Says an aggregate the others got (and would have relayed) never reached it, to void that part."""

    name = "false_dispute"

    def claimed_undelivered(self, vr, undelivered):
        return undelivered | {(vr.me + 1) % len(vr.members)}


class LeaveOut(Behavior):
    """As a reducer, aggregates its own part alone (leaves out everyone else's), so that its aggregate
    is whatever it wants and still passes the projection check of its only contributor."""

    name = "leave_out"

    def counted(self, vr, received):
        return [vr.me]


class InflateWeight(Behavior):
    """Claims a weight of 1000 for its parts."""

    name = "inflate_weight"

    def claimed_weight(self, weight):
        return 1000.0


class OversizedPart(Behavior):
    """Signs 1 GiB as the size of each of its parts, so that reducers that believed it would allocate that
    much before reading a byte: the signed size is more than the codec takes for the signed numel."""

    name = "oversized_part"

    def signed_part_size(self, size):
        return 1 << 30


class DeflateWeight(Behavior):
    """Claims a weight of 0 for its parts: a reducer that honoured it would compute an aggregate that
    fails the projection check (which counts every member once), and be convicted for it."""

    name = "deflate_weight"

    def claimed_weight(self, weight):
        return 0.0


class PoisonState(Behavior):
    """Hands peers that download its state (newcomers, members that fell behind) a model with noise of
    half each tensor's norm added: refused, because most of the round's members hold another state."""

    name = "poison_state"

    def served_state(self, tensors):
        g = torch.Generator().manual_seed(0)
        out = {}
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel():
                noise = torch.randn(t.shape, generator=g, dtype=t.dtype)
                t = t + noise * (0.5 * float(t.norm()) / max(float(noise.norm()), 1e-12))
            out[name] = t
        return out


PROTOCOL_ATTACKS: Registry[type[Behavior]] = Registry("protocol attack")
for _cls in (
    WrongAggregate, Equivocate, FalseReport, FalseAccusation, WithholdReveal, BadCommitment, Silent, InflateWeight,
    WithholdAggregate, FalseDispute, LeaveOut, DeflateWeight, CoverUp, EquivocateReport, WithholdReport, PoisonState,
    OversizedPart,
):  # fmt: skip
    PROTOCOL_ATTACKS.register(_cls.name, _cls)
