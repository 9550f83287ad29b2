"""Judging and ban votes (protocol/btard/judge.py): a wrong aggregate is caught through fp16 rounding,
a banned peer is refused everywhere, bans by a round's majority reach the swarm while forged groups ban
nobody, and a false accuser costs the judges one download."""

import asyncio
import dataclasses

import pytest

from phalanx.protocol.adversary import PROTOCOL_ATTACKS, Behavior
from phalanx.protocol.config import Codec
from phalanx.protocol.engine import Averaged, RoundRequest
from tests.protocol.btard.btard_rounds import CONFIG, inputs, run_round
from tests.protocol.swarm_fixture import close_peer, open_peer, open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("codec", [Codec.FP16, Codec.INT8])
def test_wrong_aggregate_is_caught_through_the_codecs_rounding(codec):
    async def main():
        config = dataclasses.replace(CONFIG, compression=codec)
        behaviors = [None, None, None, PROTOCOL_ATTACKS["wrong_aggregate"]()]
        async with open_swarm(4, config, behaviors=behaviors) as peers:
            # fp16 rounding of honest aggregates widens the tolerance, so one random projection sees this
            # shift with probability ~0.9 instead of ~1; int8's bound is wider still (it missed 2 of 12 rounds
            # here, and a CI run all of five): up to 20 rounds, the loop ends once the attacker is banned
            attacker = peers[3].peer_id
            for _ in range(20):
                outcomes = await run_round(peers, inputs(4))
                honest = outcomes[:3]
                assert all(isinstance(o, Averaged) for o in honest), honest
                if honest[0].verdict.banned:
                    break
                assert all(o.verdict.clean for o in honest)  # missed: nobody is blamed instead
            for outcome in honest:
                assert outcome.verdict.banned == {attacker}
                assert outcome.verdict.bad_parts == {outcome.group.members.index(attacker)}

    asyncio.run(main())


def test_banned_peer_is_refused_by_matchmaking_and_handlers():
    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS["inflate_weight"]()]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            attacker = peers[3]
            await run_round(peers, inputs(4))
            # the next round forms without it, whatever it tries
            honest = peers[:3]
            for peer in honest:
                peer.engine.set_state(b"v1", 1)
            attacker.engine.set_state(b"v1", 1)
            xs = inputs(4)
            results = await asyncio.gather(
                *[p.engine.run_round(RoundRequest(x)) for p, x in zip(honest, xs)],
                attacker.engine.run_round(RoundRequest(xs[3])),
                return_exceptions=True,
            )
            for outcome in results[:3]:
                assert isinstance(outcome, Averaged) and attacker.peer_id not in outcome.group.members
            # at best it trains alone: no honest peer groups with it
            if isinstance(results[3], Averaged):
                assert results[3].group.members == [attacker.peer_id]
            # and every RPC handler refuses it
            from phalanx.protocol.transport import CallFailed

            with pytest.raises(CallFailed, match="banned"):
                await attacker.transport.call(
                    honest[0].peer_id, "exchange", b"", b"", max_reply_payload=0, timeout_s=10
                )
            # a peer that was in none of these rounds learns the ban from the signed votes in the DHT
            newcomer = await open_peer([str(m) for m in honest[0].dht.get_visible_maddrs()], CONFIG)
            try:
                await newcomer.engine.bans.refresh()
                assert newcomer.membership.banned == {attacker.peer_id}
            finally:
                await close_peer(newcomer)

    asyncio.run(main())


def test_bans_by_majority_reach_the_swarm_and_forged_groups_ban_nobody(tmp_path):
    """A wrong aggregate is judged by the round's majority: its votes carry the leader's group and the
    reducer's own commitment to it, so a peer that was not in the round learns the ban from the DHT.
    Two identities that sign a group of themselves and an honest peer, and vote it out, ban nobody:
    that peer never committed to such a group."""
    from phalanx.protocol.bans import open_vote
    from phalanx.security.commitments import GroupBody
    from phalanx.security.evidence import BanVote, Offense
    from phalanx.security.identity import Identity
    from phalanx.security.statements import sign_statement
    from phalanx.security.wire import pack

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["wrong_aggregate"]()]) as peers:
            attacker, victim = peers[3], peers[0]
            # caught in its first round on an idle machine; in one CI run that round ended with no ban (its
            # log was not kept then; conftest.py keeps it now): a later round must catch it, blaming nobody
            for _ in range(5):
                outcomes = await run_round(peers, inputs(4))
                if outcomes[0].verdict.banned:
                    break
                assert not any(o.verdict.banned for o in outcomes[:3]), [o.verdict for o in outcomes[:3]]
            for outcome in outcomes[:3]:
                assert outcome.verdict.banned == {attacker.peer_id}
            votes = [
                open_vote(pack(v))
                for v in outcomes[0].verdict.votes
                if open_vote(pack(v)).body.accused == attacker.peer_id
            ]
            assert votes and all(v.body.offense is Offense.WRONG_AGGREGATE and len(v.body.evidence) == 2 for v in votes)
            sybils = [Identity.generate_ed25519(tmp_path / f"sybil{i}") for i in range(2)]
            fake_round = b"f" * 16
            fake = sign_statement(
                sybils[0], "group", fake_round, GroupBody(members=[s.peer_id for s in sybils] + [victim.peer_id])
            )
            forged = [
                sign_statement(
                    s,
                    "ban",
                    b"",
                    BanVote(accused=victim.peer_id, offense=Offense.WITHHELD, round_id=fake_round, evidence=[fake]),
                )
                for s in sybils
            ]
            await attacker.engine.bans.publish(forged)  # stored in the DHT under the sybils' own subkeys
            newcomer = await open_peer([str(m) for m in peers[1].dht.get_visible_maddrs()], CONFIG)
            try:
                await newcomer.engine.bans.refresh()
                assert len(newcomer.engine.bans._votes) >= len(votes) + len(forged)  # it read the forged votes too
                assert newcomer.membership.banned == {attacker.peer_id}
                for peer in peers[:3]:
                    await peer.engine.bans.refresh()
                    assert peer.membership.banned == {attacker.peer_id}
            finally:
                await close_peer(newcomer)

    asyncio.run(main())


def test_a_false_accuser_gets_judged_once(monkeypatch):
    """Judging a report accusation downloads the part: an accuser found false once (or one that repeats
    itself) costs the judges no more downloads, however many accusations it sends."""
    from phalanx.protocol.btard import BtardService

    class Flood(Behavior):
        name = "flood"

        def false_accusations(self, vr, reports):
            return sorted(p for p in reports if p != vr.identity.peer_id) * 50

    fetches = []
    fetch = BtardService.fetch_part

    async def counting(self, holder, *args, **kwargs):
        fetches.append((self.transport.peer_id, holder))
        return await fetch(self, holder, *args, **kwargs)

    monkeypatch.setattr(BtardService, "fetch_part", counting)

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, Flood()]) as peers:
            attacker = peers[3].peer_id
            outcomes = await run_round(peers, inputs(4))
            for outcome in outcomes[:3]:
                assert outcome.verdict.banned == {attacker}
            # each honest judge fetched once from the accuser; the other 149 accusations cost nothing
            honest = sorted((judge, holder) for judge, holder in fetches if judge != attacker)
            assert honest == sorted((p.peer_id, attacker) for p in peers[:3])

    asyncio.run(main())
