"""Reports and what they dispute (protocol/btard/reports.py, claims.py): disputed and left-out parts are
dropped by everyone, a member most reducers left out is the one banned, an aggregate nobody can check is
not applied, and a report kept from one reducer changes nothing."""

import asyncio

import pytest
import torch

from phalanx.protocol.adversary import PROTOCOL_ATTACKS, Behavior
from phalanx.protocol.engine import Averaged
from tests.protocol.btard.btard_rounds import CONFIG, inputs, run_round
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("attack", ["false_dispute", "withhold_aggregate"])
def test_a_disputed_part_is_dropped_by_everyone(attack):
    """A minority that says it never got an aggregate the others got (false_dispute), or a reducer
    that withheld its aggregate from everyone: either way every member drops that part."""

    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS[attack]()]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            attacker = peers[3].peer_id
            outcomes = await run_round(peers, inputs(4))
            members = outcomes[0].group.members
            at = members.index(attacker)
            disputed = {(at + 1) % 4} if attack == "false_dispute" else {at}
            dropped = disputed | {at}  # and the banned attacker's own aggregate
            for outcome in outcomes[:3]:
                assert outcome.verdict.banned == {attacker}
                assert outcome.verdict.disputed == disputed
                assert outcome.verdict.bad_parts == set(outcome.result.missing_parts) == dropped

    asyncio.run(main())


def _late_to(peer, reducers: set[str], seconds: float) -> None:
    """Make `peer` send its parts to `reducers` after their deadline (CONFIG's all-reduce waits 5 s)."""
    service = peer.engine.allreduce
    send = service._send_part

    async def send_late(spec, j, *args):
        if spec.members[j] in reducers:
            await asyncio.sleep(seconds)
        return await send(spec, j, *args)

    service._send_part = send_late


class _LeaveOutOne(Behavior):
    """A reducer that leaves one received part (`victim`'s) out of its aggregate."""

    name = "leave_out_one"
    victim = ""

    def counted(self, vr, received):
        return [i for i in received if vr.members[i] != self.victim]


@pytest.mark.parametrize("who", ["reducer leaves one part out", "member late to one reducer"])
def test_a_part_left_out_is_dropped_by_everyone_and_nobody_is_banned(who):
    """Being late cannot be proven, so a member a reducer did not count makes everyone drop that part
    (whatever the reducer aggregated without it is never applied) and nobody is banned."""

    async def main():
        leave_out = _LeaveOutOne()
        behaviors = [None, None, None, leave_out if who.startswith("reducer") else None]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            reducer, victim = peers[3], peers[0]
            leave_out.victim = victim.peer_id
            if who.startswith("member"):
                _late_to(victim, {reducer.peer_id}, seconds=6.0)
            outcomes = await run_round(peers, inputs(4))
            members = outcomes[0].group.members
            at = members.index(reducer.peer_id)
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == set()
                assert outcome.verdict.disputed == {at}
                assert outcome.verdict.bad_parts == set(outcome.result.missing_parts) == {at}
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())


def test_a_member_most_reducers_left_out_is_banned_and_drops_nothing():
    """A member that delivers its parts to no reducer in time, then says each of them left it out,
    is the one that failed (an honest majority of reducers counts every part that came in time)."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            late = peers[3]
            _late_to(late, {p.peer_id for p in peers[:3]}, seconds=6.0)
            outcomes = await run_round(peers, inputs(4))
            members = outcomes[0].group.members
            at = members.index(late.peer_id)
            # whatever it says it never got (relays are rationed), or was left out of, settles nothing
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {late.peer_id}
                assert outcome.verdict.disputed == set()
                assert outcome.verdict.bad_parts == {at}
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())


def test_an_aggregate_that_cannot_be_checked_is_not_applied(monkeypatch):
    """A wrong aggregate passes no check if one of its contributors withholds its report and the reducer,
    which alone holds that contributor's part, does not show the true one: it must not be applied."""
    from phalanx.protocol.adversary import WrongAggregate
    from phalanx.protocol.btard.reports import Reporter

    class Mute(Behavior):  # commits, sends its parts, reveals, then says nothing more
        name = "mute"

        def speaks(self, phase):
            return phase not in ("report", "accuse")

    reducer_checks = Reporter.check_as_reducer
    colluder = WrongAggregate()

    def checks(self, reports, own_received, truth):
        if self.vr.behavior is not colluder:  # the colluding reducer does not accuse its silent partner
            reducer_checks(self, reports, own_received, truth)

    monkeypatch.setattr(Reporter, "check_as_reducer", checks)

    async def main():
        async with open_swarm(5, CONFIG, behaviors=[None, None, None, colluder, Mute()]) as peers:
            reducer, mute = peers[3].peer_id, peers[4].peer_id
            outcomes = await run_round(peers, inputs(5))
            members = outcomes[0].group.members
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert mute in outcome.verdict.banned and not outcome.verdict.banned & {p.peer_id for p in peers[:3]}
                assert outcome.verdict.bad_parts == set(outcome.result.missing_parts)
                assert members.index(reducer) in outcome.verdict.bad_parts
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())


def test_an_aggregate_with_malformed_contributors_is_refused():
    """Contributors must be member indices in increasing order that include the reducer itself."""
    from phalanx.security.commitments import AggregateBody

    def body(contributors):
        return AggregateBody(part=1, hash=bytes(32), contributors=contributors)

    assert body([0, 1, 3]).well_formed(4)
    assert not body([0, 3]).well_formed(4)  # its own part missing
    assert not body([1, 1, 2]).well_formed(4)  # a part twice
    assert not body([2, 1]).well_formed(4)
    assert not body([1, 4]).well_formed(4)  # no such member
    assert body([0, 3]).well_formed(4, sits_out=True)  # a reducer that sat out counts everyone but itself
    assert not body([0, 1, 3]).well_formed(4, sits_out=True)


def test_a_report_kept_from_one_reducer_gets_nobody_banned_and_changes_nothing():
    """A member that sends its report to everyone but one reducer makes that reducer accuse it of not
    reporting while the others hold the report: unprovable either way, so the accusation is dismissed;
    everyone takes the report from the echoes and applies the same aggregates."""

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["withhold_report"]()]) as peers:
            outcomes = await run_round(peers, inputs(4))
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == set() and outcome.verdict.bad_parts == set()
                assert outcome.verdict.accusations >= 1  # the reducer did accuse
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())
