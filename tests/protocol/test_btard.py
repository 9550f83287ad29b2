"""Verified rounds (BTARD) with real peers on loopback: honest rounds pass, each protocol attack
gets exactly its attacker banned by every honest member, and a banned peer is refused."""

import asyncio
import dataclasses
import math
import os

import pytest
import torch

from phalanx.aggregation.centered_clip import centered_clip
from phalanx.aggregation.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.adversary import PROTOCOL_ATTACKS, Behavior
from phalanx.protocol.config import Codec, MatchmakingConfig, RoundConfig, verify_config_for
from phalanx.protocol.engine import Averaged
from phalanx.protocol.partition import partition_bounds
from swarm_fixture import close_peer, open_peer, open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PARAMS = (("tau", 1.0),)
CONFIG = RoundConfig(
    aggregator="centered_clip",
    aggregator_params=PARAMS,
    verify=verify_config_for("centered_clip", PARAMS, phase_timeout_s=3.0),
    allreduce_timeout_s=5.0,
    matchmaking=MatchmakingConfig(matchmaking_timeout_s=3.0, join_timeout_s=60.0),
)
NUMEL = 40_000


def _inputs(n):
    g = torch.Generator().manual_seed(1)
    common = torch.randn(NUMEL, generator=g)
    return [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(n)]


async def _round(peers, xs):
    for peer in peers:
        peer.engine.set_state(b"v0", 0)
    return await asyncio.gather(*[p.engine.run_round(x) for p, x in zip(peers, xs)], return_exceptions=True)


def test_honest_verified_round_equals_centered_clip_per_part():
    async def main():
        async with open_swarm(4, CONFIG) as peers:
            xs = _inputs(4)
            outcomes = await _round(peers, xs)
            members = outcomes[0].group.members
            by_member = {p.peer_id: x for p, x in zip(peers, xs)}
            stacked = torch.stack([by_member[m] for m in members])
            expected = torch.cat(
                [centered_clip(stacked[:, a:b], tau=1.0, max_iter=100_000).value for a, b in partition_bounds(NUMEL, 4)]
            )
            for peer, outcome in zip(peers, outcomes):
                assert isinstance(outcome, Averaged)
                assert outcome.verdict.banned == set() and outcome.verdict.bad_parts == set()
                assert torch.allclose(outcome.result.vector, expected, atol=1e-6)
                # a round every member called clean needs no evidence: the parts are let go for the next round
                assert outcome.verdict.clean and not peer.engine.btard.holds(outcome.group.round_id)
                assert outcome.result.own_rows is None
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())


def test_no_member_reveals_before_it_holds_every_aggregate_statement(monkeypatch):
    """The reveal overlaps the gather (it starts on the aggregates' signed headers, before their bytes),
    but the seed must stay unknown until every reducer is bound to its aggregate, and every reducer
    must hold its parts by then (the validator, who starts with the seed, may ask for them)."""
    from phalanx.protocol.btard import VerifiedRound

    seen = []
    reveal = VerifiedRound._reveal

    async def recording(self):
        bound = self.expected is not None and self.expected <= set(self.aggregates)
        seen.append((self.identity.peer_id, bound, self.service.holds(self.round_id)))
        return await reveal(self)

    monkeypatch.setattr(VerifiedRound, "_reveal", recording)

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            numel = 2_000_000  # 2 MB parts: the aggregates take the direct path, header first
            xs = [torch.full((numel,), float(i)) + torch.randn(numel) for i in range(4)]
            outcomes = await _round(peers, xs)
            assert all(isinstance(o, Averaged) and o.verdict.clean for o in outcomes), outcomes
            assert all(p.transport.stats.direct_calls > 0 for p in peers)
        assert sorted(seen) == sorted((p.peer_id, True, True) for p in peers)

    asyncio.run(main())


def test_honest_verified_round_with_the_plain_mean_is_clean():
    """--aggregator mean --verify checks the mean as CenteredClip with τ = ∞."""

    async def main():
        config = dataclasses.replace(
            CONFIG, aggregator="mean", aggregator_params=(), verify=verify_config_for("mean", (), phase_timeout_s=3.0)
        )
        async with open_swarm(4, config) as peers:
            xs = _inputs(4)
            outcomes = await _round(peers, xs)
            expected = torch.stack(xs).mean(0)
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.clean and outcome.verdict.banned == set()
                assert (outcome.result.vector - expected).abs().max() < 1e-5

    asyncio.run(main())


def test_honest_verified_round_with_fp16_is_clean():
    """Commitments cover the compressed bytes, reports are taken on what the reducers decoded, and the
    fixed-point tolerance allows for the aggregate's fp16 rounding (not more)."""

    async def main():
        config = dataclasses.replace(CONFIG, compression=Codec.FP16)
        async with open_swarm(4, config) as peers:
            outcomes = await _round(peers, _inputs(4))
            first = outcomes[0]
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.clean and outcome.verdict.banned == set()
                assert torch.equal(outcome.result.vector, first.result.vector)
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())


def test_wrong_aggregate_is_caught_through_fp16_rounding():
    async def main():
        config = dataclasses.replace(CONFIG, compression=Codec.FP16)
        behaviors = [None, None, None, PROTOCOL_ATTACKS["wrong_aggregate"]()]
        async with open_swarm(4, config, behaviors=behaviors) as peers:
            # fp16 rounding of honest aggregates widens the tolerance, so one random projection sees this
            # shift with probability ~0.9 instead of ~1: five rounds miss it with probability < 1e-4
            attacker = peers[3].peer_id
            for _ in range(5):
                outcomes = await _round(peers, _inputs(4))
                honest = outcomes[:3]
                assert all(isinstance(o, Averaged) for o in honest), honest
                if honest[0].verdict.banned:
                    break
                assert all(o.verdict.clean for o in honest)  # missed: nobody is blamed instead
            for outcome in honest:
                assert outcome.verdict.banned == {attacker}
                assert outcome.verdict.bad_parts == {outcome.group.members.index(attacker)}

    asyncio.run(main())


# cover_up is caught only in rounds where the public seed makes the attacker the validator's target;
# withhold_report gets nobody banned (who is lying cannot be proven) and changes nothing
# poison_state only touches state downloads (refused, not banned: see its own test)
ONE_ROUND_ATTACKS = sorted(set(PROTOCOL_ATTACKS) - {"cover_up", "withhold_report", "poison_state"})


# phases wait 6 s here, not 3: one full-suite run saw an honest peer banned next to withhold_reveal (which
# makes everyone wait out the reveal), and an honest member stalled past a phase by the loaded machine is
# the likeliest cause; it did not recur in about 25 runs of this test, 13 of them under load
ATTACK_CONFIG = dataclasses.replace(CONFIG, verify=dataclasses.replace(CONFIG.verify, phase_timeout_s=6.0))


@pytest.mark.parametrize("attack", ONE_ROUND_ATTACKS)
def test_each_protocol_attack_bans_exactly_the_attacker(attack):
    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS[attack]()]
        async with open_swarm(4, ATTACK_CONFIG, behaviors=behaviors) as peers:
            attacker = peers[3].peer_id
            outcomes = await _round(peers, _inputs(4))
            honest = list(zip(peers[:3], outcomes[:3]))
            for peer, outcome in honest:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {attacker}
                assert peer.membership.banned == {attacker}
                # a contested round keeps its parts as evidence for judges that are still at it
                assert not outcome.verdict.clean and peer.engine.btard.holds(outcome.group.round_id)
            # honest members agree on what they apply, so they keep one state version
            first = honest[0][1]
            for _, outcome in honest[1:]:
                assert outcome.verdict.bad_parts == first.verdict.bad_parts
                assert torch.equal(outcome.result.vector, first.result.vector)
            assert math.isfinite(float(first.result.vector.abs().sum()))

    asyncio.run(main())


def test_validator_checks_its_target_while_the_gather_runs(monkeypatch):
    """The validator starts as soon as the seed is public (mid-gather): a recomputation that is not
    bit-identical fetches the target's parts from reducers, who hold them from the moment they signed
    their aggregate; an honest target passes, a target that sent another gradient is banned."""
    from phalanx.protocol.btard.validator import Validator

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            ids = [p.peer_id for p in peers]
            target = [ids[1]]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], target[0])])
            numel = 2_000_000  # 2 MB parts: the aggregates take the direct path, so the seed is out before they land
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            honest = {p: x for p, x in zip(ids, xs)}

            async def recompute(peer):  # the same gradient up to float noise from other hardware
                return honest[peer] * (1 + 1e-7)

            async def verified_round(sent):
                for peer in peers:
                    peer.engine.set_state(b"v0", 0)
                return await asyncio.gather(*[p.engine.run_round(x, recompute=recompute) for p, x in zip(peers, sent)])

            outcomes = await verified_round(xs)
            assert all(o.verdict.clean and o.verdict.banned == set() for o in outcomes), [o.verdict for o in outcomes]

            target[0] = ids[3]
            outcomes = await verified_round(xs[:3] + [-xs[3]])  # peer 3 commits to and sends a flipped gradient
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}

    asyncio.run(main())


@pytest.mark.parametrize("recomputation", ["bit-identical", "other hardware"])
def test_a_reducer_covering_up_its_aggregate_with_its_own_report_is_caught_by_the_validator(monkeypatch, recomputation):
    """Only a reducer holds its own part, so its report on it is checked by nobody but the validator that
    targets it: a shifted aggregate covered up by that report passes the fixed-point check, and the
    validator (who holds the target's committed parts) proves the lie."""
    from phalanx.protocol.btard.validator import Validator

    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS["cover_up"]()]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            ids = [p.peer_id for p in peers]
            target = [ids[1]]
            monkeypatch.setattr(Validator, "pairs", lambda self, seed: [(ids[0], target[0])])
            xs = _inputs(4)
            committed = dict(zip(ids, xs))
            noise = 1.0 if recomputation == "bit-identical" else 1 + 1e-7

            async def recompute(peer):
                return committed[peer] * noise

            async def verified_round():
                for peer in peers:
                    peer.engine.set_state(b"v0", 0)
                return await asyncio.gather(*[p.engine.run_round(x, recompute=recompute) for p, x in zip(peers, xs)])

            # validating someone else, nobody can tell: the wrong aggregate is applied
            outcomes = await verified_round()
            assert all(o.verdict.clean for o in outcomes), [o.verdict for o in outcomes]

            target[0] = ids[3]
            outcomes = await verified_round()
            at = outcomes[0].group.members.index(ids[3])
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}
                assert outcome.verdict.bad_parts == {at}

    asyncio.run(main())


def test_with_a_validator_per_member_a_cover_up_is_caught_in_its_first_round():
    """`validators` equal to the group size: every member is some validator's target each round, so the
    reducer that covers up its shifted aggregate with its own report is caught whatever the seed."""
    config = dataclasses.replace(CONFIG, verify=dataclasses.replace(CONFIG.verify, validators=4))

    async def main():
        async with open_swarm(4, config, behaviors=[None, None, None, PROTOCOL_ATTACKS["cover_up"]()]) as peers:
            ids = [p.peer_id for p in peers]
            xs = _inputs(4)
            committed = dict(zip(ids, xs))

            async def recompute(peer):
                return committed[peer]

            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            outcomes = await asyncio.gather(*[p.engine.run_round(x, recompute=recompute) for p, x in zip(peers, xs)])
            at = outcomes[0].group.members.index(ids[3])
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert outcome.verdict.banned == {ids[3]} and peer.membership.banned == {ids[3]}
                assert outcome.verdict.bad_parts == {at}

    asyncio.run(main())


class _HoldReply(Exception):
    """Raised from a test behavior's aggregate_reply: the reducer answers that member nothing for a while."""


def _hold_replies(monkeypatch, seconds: float) -> None:
    from phalanx.protocol.allreduce import AllReduceService

    serve = AllReduceService._serve_part

    async def serve_part(self, peer, header, payload):
        try:
            return await serve(self, peer, header, payload)
        except _HoldReply:
            await asyncio.sleep(seconds)
            raise RoundAbortedError("gave up")

    monkeypatch.setattr(AllReduceService, "_serve_part", serve_part)


def _holding_back(monkeypatch, how: str, seconds: float = 8.0):
    """A reducer behavior that answers the members in `victims` late (its signed statement, or only the
    bytes after it, `seconds` late) or refuses them at once (`how` = "refused")."""
    from phalanx.protocol.adversary import Behavior
    from phalanx.protocol.channel import Channel

    held_back: set[int] = set()

    class HoldBack(Behavior):
        name = "hold_back"

        def __init__(self, victims: set[str]) -> None:
            self.victims = victims

        def aggregate_reply(self, vr, receiver, header, payload):
            if vr.members[receiver] not in self.victims:
                return header, payload
            if how == "refused":
                raise RoundAbortedError("not for you")
            if how == "statement":
                raise _HoldReply()
            copy = bytearray(payload)  # marks this one reply for the channel below
            held_back.add(id(copy))
            return header, copy

    _hold_replies(monkeypatch, seconds)  # CONFIG's phases wait 3 s; the caller's timeout is 15 s
    send_message = Channel.send_message

    async def send_late(self, head, payload):
        if id(payload) in held_back:
            await self.send_record(head)  # the signed statement goes out on time, the bytes do not
            await asyncio.sleep(seconds)
        await send_message(self, head, payload)

    monkeypatch.setattr(Channel, "send_message", send_late)
    return HoldBack


def _assert_nothing_lost(peers, outcomes, victim, failed_reducers) -> None:
    """Nobody banned, nothing dropped, and only the victim took aggregates (those of `failed_reducers`)
    from other members."""
    assert all(isinstance(o, Averaged) for o in outcomes), outcomes
    members = outcomes[0].group.members
    for peer, outcome in zip(peers, outcomes):
        assert outcome.verdict.banned == set() and not peer.membership.banned
        assert outcome.verdict.bad_parts == outcome.verdict.disputed == set()
        assert outcome.result.missing_parts == ()
        relayed = {members.index(p.peer_id) for p in failed_reducers} if peer is victim else set()
        assert outcome.verdict.relayed == relayed
    for outcome in outcomes[1:]:
        assert torch.equal(outcome.result.vector, outcomes[0].result.vector)


@pytest.mark.parametrize(
    "how, codec", [("statement", Codec.NONE), ("bytes", Codec.NONE), ("refused", Codec.NONE), ("refused", Codec.FP16)]
)
def test_member_a_reducer_fails_takes_the_aggregate_from_the_others(monkeypatch, how, codec):
    """A reducer holds back its aggregate from one member (its signed statement, or the bytes after it,
    past the others' phase deadlines) or refuses it. The victim takes the aggregate from another member
    (checked against the reducer's signed hash) and reports in time: nobody is banned and nothing is
    lost (before relays, the victim was banned for being late, then the part was dropped by all).
    Compressed parts are relayed as the reducer encoded them and decoded by the victim."""
    HoldBack = _holding_back(monkeypatch, how)
    victims: set[str] = set()
    config = dataclasses.replace(CONFIG, compression=codec)

    async def main():
        async with open_swarm(4, config, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.add(peers[0].peer_id)
            numel = 2_000_000  # 2 MB parts: the aggregates take the direct path, statement first
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            _assert_nothing_lost(peers, await _round(peers, xs), peers[0], [peers[3]])

    asyncio.run(main())


def test_two_reducers_holding_back_from_one_member_get_nobody_banned(monkeypatch):
    """Two colluding reducers hold their aggregates' bytes back from the same member: it disputes
    nothing, since the other members relay both (before relays, that member was banned for two disputes)."""
    HoldBack = _holding_back(monkeypatch, "bytes")
    victims: set[str] = set()

    async def main():
        behaviors = [None, None, None, HoldBack(victims), HoldBack(victims)]
        async with open_swarm(5, CONFIG, behaviors=behaviors) as peers:
            victims.add(peers[0].peer_id)
            numel = 2_500_000
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(5)]
            _assert_nothing_lost(peers, await _round(peers, xs), peers[0], peers[3:])

    asyncio.run(main())


def test_reducer_that_withholds_its_aggregate_from_everyone_is_banned(monkeypatch):
    """Statement on time, bytes never (to anyone): no member can relay what none got, so every other
    member disputes the part; a majority disputing a part convicts its reducer."""
    HoldBack = _holding_back(monkeypatch, "bytes")
    victims: set[str] = set()

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.update(p.peer_id for p in peers[:3])
            numel = 2_000_000
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            outcomes = await _round(peers, xs)
            withheld = outcomes[0].group.members.index(peers[3].peer_id)
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {peers[3].peer_id} and peer.membership.banned == {peers[3].peer_id}
                assert outcome.verdict.bad_parts == outcome.verdict.disputed == {withheld}
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())


@pytest.mark.parametrize("lie", ["other bytes", "stall"])
def test_a_member_that_relays_wrong_bytes_or_stalls_is_passed_over(monkeypatch, lie):
    """The victim asks the other members for a refused aggregate; the first to answer sends bytes
    other than those the reducer signed, or stalls them past everyone's patience. The victim takes
    the aggregate from the next one in time (a stalling relay would otherwise get it banned)."""
    from phalanx.protocol.btard.relay import AggregateRelay

    HoldBack = _holding_back(monkeypatch, "refused")
    victims: set[str] = set()
    liar: list[str] = []
    lied = asyncio.Event()
    serve = AggregateRelay.serve

    async def lying_relay_for(self, peer, part, payload):
        if self.vr.identity.peer_id != liar[0]:
            await asyncio.wait_for(lied.wait(), timeout=20.0)  # the liar answers first
            return await serve(self, peer, part, payload)
        header, data = await serve(self, peer, part, payload)
        if payload:
            lied.set()
            if lie == "stall":
                await asyncio.sleep(30.0)
            data = bytearray(data)
            data[100] ^= 1
        return header, data

    monkeypatch.setattr(AggregateRelay, "serve", lying_relay_for)

    async def main():
        lied.__init__()  # bound to this test's event loop
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, HoldBack(victims)]) as peers:
            victims.add(peers[0].peer_id)
            liar.append(peers[1].peer_id)
            xs = _inputs(4)
            _assert_nothing_lost(peers, await _round(peers, xs), peers[0], [peers[3]])
            assert lied.is_set()

    asyncio.run(main())


def test_a_member_gets_no_more_relayed_aggregates_than_an_honest_one_needs():
    """Fewer than half the reducers can fail an honest member, so a member serves any one requester
    at most ⌊(n − 1)/2⌋ relayed aggregates a round (else one member could double another's upload),
    and never the requester's own or the server's own part."""
    from phalanx.protocol.btard.messages import RELAY_METHOD, RelayRequest
    from phalanx.protocol.transport import CallFailed
    from phalanx.security.commitments import part_hash
    from phalanx.security.wire import pack

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            server, asker = peers[0], peers[1]
            rounds = asyncio.ensure_future(_round(peers, _inputs(4)))
            while not server.engine.btard.open or asker.peer_id not in next(iter(server.engine.btard.open.values())).commits:
                assert not rounds.done(), "the round ended before the server collected the commitments"
                await asyncio.sleep(0.01)  # until the server's round is open and has the asker's commitment
            vr = next(iter(server.engine.btard.open.values()))
            others = [i for i, p in enumerate(vr.members) if p not in (server.peer_id, asker.peer_id)]

            async def ask(part):
                request = pack(RelayRequest(round_id=vr.round_id, part=part, payload=True))
                return await asker.transport.call(server.peer_id, RELAY_METHOD, request, max_reply_payload=1 << 20, timeout_s=30)

            outcomes = await asyncio.gather(*(ask(i) for i in [*others, vr.members.index(asker.peer_id)]), return_exceptions=True)
            await rounds
            served = [(i, o) for i, o in zip(others, outcomes) if not isinstance(o, BaseException)]
            assert len(served) == 1  # ⌊3/2⌋ = 1 for 4 members
            part, (header, data) = served[0]
            assert part_hash(data) == vr.aggregates[part][1].hash
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(refused) == 2 and all(isinstance(o, CallFailed) for o in refused)
            assert any("more relayed aggregates" in str(o) for o in refused)
            assert any("no relayable part" in str(o) for o in refused)

    asyncio.run(main())


def test_two_reducers_dying_after_commit_get_only_themselves_banned(monkeypatch):
    """Every other member misses both their aggregates, i.e. disputes two parts: that is no offense when
    the reducers themselves fell silent."""
    from phalanx.protocol.adversary import Behavior

    class Dies(Behavior):
        name = "dies_after_commit"

        def speaks(self, phase):
            return phase == "commit"

        def aggregate_reply(self, vr, receiver, header, payload):
            raise _HoldReply()

    _hold_replies(monkeypatch, 20.0)

    async def main():
        async with open_swarm(5, CONFIG, behaviors=[None, None, None, Dies(), Dies()]) as peers:
            dead = {peers[3].peer_id, peers[4].peer_id}
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            xs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(5)]
            outcomes = await asyncio.gather(*[p.engine.run_round(x) for p, x in zip(peers, xs)], return_exceptions=True)
            for peer, outcome in zip(peers[:3], outcomes[:3]):
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == dead and peer.membership.banned == dead

    asyncio.run(main())


@pytest.mark.parametrize("attack", ["false_dispute", "withhold_aggregate"])
def test_a_disputed_part_is_dropped_by_everyone(attack):
    """A minority that says it never got an aggregate the others got (false_dispute), or a reducer
    that withheld its aggregate from everyone: either way every member drops that part."""

    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS[attack]()]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            attacker = peers[3].peer_id
            outcomes = await _round(peers, _inputs(4))
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
            outcomes = await _round(peers, _inputs(4))
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
            outcomes = await _round(peers, _inputs(4))
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
            outcomes = await _round(peers, _inputs(5))
            members = outcomes[0].group.members
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert mute in outcome.verdict.banned and not outcome.verdict.banned & {p.peer_id for p in peers[:3]}
                assert outcome.verdict.bad_parts == set(outcome.result.missing_parts)
                assert members.index(reducer) in outcome.verdict.bad_parts
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_a_member_sending_non_finite_or_overflowing_parts_is_banned_alone(value):
    """Parts that CenteredClip cannot use (NaN, Inf, a norm past its limit) are left out by every reducer:
    their sender is banned, and no honest reducer is convicted over a report nobody could check."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            xs = _inputs(4)
            xs[3] = torch.full_like(xs[3], value)
            outcomes = await _round(peers, xs)
            at = outcomes[0].group.members.index(peers[3].peer_id)
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {peers[3].peer_id}
                assert outcome.verdict.bad_parts == {at}
                assert torch.isfinite(outcome.result.vector).all()
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


def test_banned_peer_is_refused_by_matchmaking_and_handlers():
    async def main():
        behaviors = [None, None, None, PROTOCOL_ATTACKS["inflate_weight"]()]
        async with open_swarm(4, CONFIG, behaviors=behaviors) as peers:
            attacker = peers[3]
            await _round(peers, _inputs(4))
            # the next round forms without it, whatever it tries
            honest = peers[:3]
            for peer in honest:
                peer.engine.set_state(b"v1", 1)
            attacker.engine.set_state(b"v1", 1)
            xs = _inputs(4)
            results = await asyncio.gather(
                *[p.engine.run_round(x) for p, x in zip(honest, xs)], attacker.engine.run_round(xs[3]), return_exceptions=True
            )
            for outcome in results[:3]:
                assert isinstance(outcome, Averaged) and attacker.peer_id not in outcome.group.members
            # at best it trains alone: no honest peer groups with it
            if isinstance(results[3], Averaged):
                assert results[3].group.members == [attacker.peer_id]
            # and every RPC handler refuses it
            from phalanx.protocol.transport import CallFailed

            with pytest.raises(CallFailed, match="banned"):
                await attacker.transport.call(honest[0].peer_id, "exchange", b"", b"", max_reply_payload=0, timeout_s=10)
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
            outcomes = await _round(peers, _inputs(4))
            for outcome in outcomes[:3]:
                assert outcome.verdict.banned == {attacker.peer_id}
            votes = [open_vote(pack(v)) for v in outcomes[0].verdict.votes if open_vote(pack(v)).body.accused == attacker.peer_id]
            assert votes and all(v.body.offense is Offense.WRONG_AGGREGATE and len(v.body.evidence) == 2 for v in votes)
            sybils = [Identity.generate_ed25519(tmp_path / f"sybil{i}") for i in range(2)]
            fake_round = b"f" * 16
            fake = sign_statement(sybils[0], "group", fake_round, GroupBody(members=[s.peer_id for s in sybils] + [victim.peer_id]))
            forged = [
                sign_statement(s, "ban", b"", BanVote(accused=victim.peer_id, offense=Offense.WITHHELD, round_id=fake_round, evidence=[fake]))
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


def test_a_leader_reusing_a_round_id_cannot_make_members_sign_twice_for_one_round(monkeypatch):
    """Two different commitments signed for one round id are proof of equivocation (one vote bans). A
    leader that hands out the same round id again would get every member to sign a second, different
    commitment for it: members refuse a round id they already took part in, and a stale group."""
    import time

    from phalanx.protocol.btard import round as round_module

    signed: list[tuple[str, bytes, object]] = []
    sign = round_module.sign_statement

    def recording(identity, kind, round_id, body):
        statement = sign(identity, kind, round_id, body)
        if kind == "commit":
            signed.append((identity.peer_id, round_id, statement))
        return statement

    monkeypatch.setattr(round_module, "sign_statement", recording)

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            for peer in peers:
                peer.engine.matchmaker.new_round_id = lambda: b"R" * 16
            first = await _round(peers, _inputs(4))
            assert all(isinstance(o, Averaged) for o in first), first
            second = await _round(peers, _inputs(4))
            for outcome in second:
                assert isinstance(outcome, PeerProtocolError) and "reused a round id" in str(outcome), outcome
            for peer in peers:
                mine = [statement for who, round_id, statement in signed if who == peer.peer_id and round_id == b"R" * 16]
                assert len(mine) == 1, "signed two commitments for one round id"
                assert not peer.membership.banned
            # a group statement older than the freshness window is refused too (a leader whose clock is off)
            leader = peers[0].engine.matchmaker.last_leader
            for peer in peers:
                peer.engine.matchmaker.new_round_id = lambda: os.urandom(16)
                if peer.peer_id == leader:
                    peer.engine.matchmaker.wall_clock = lambda: time.time() - 3600
            outcomes = await _round(peers, _inputs(4))
            for peer, outcome in zip(peers, outcomes):
                if peer.peer_id != leader:
                    assert isinstance(outcome, PeerProtocolError) and "group statement issued" in str(outcome), outcome
            # a member restarted under the same identity forgot its round ids: the leader replays the group it
            # signed for in its last life, stamped then, and the member refuses it as older than its process
            restarted = next(p for p in peers if p.peer_id != leader)
            restarted.engine._used_rounds.clear()
            restarted.engine.started_at = time.time()
            for peer in peers:
                peer.engine.matchmaker.new_round_id = lambda: b"R" * 16
                if peer.peer_id == leader:
                    peer.engine.matchmaker.wall_clock = lambda: restarted.engine.started_at - 60
            outcomes = await _round(peers, _inputs(4))
            outcome = outcomes[peers.index(restarted)]
            assert isinstance(outcome, PeerProtocolError) and "before this peer started" in str(outcome), outcome
            mine = [statement for who, round_id, statement in signed if who == restarted.peer_id and round_id == b"R" * 16]
            assert len(mine) == 1, "signed two commitments for one round id after a restart"

    asyncio.run(main())


def test_a_poisoned_state_download_is_refused_by_the_rounds_majority():
    """A peer that must catch up downloads the state its donor kept after a round. In verified runs every
    member of that round keeps its own as a witness, and the recipient compares fingerprints along
    directions it draws after the download: an honest donor's state is taken, a poisoned one refused."""
    from phalanx.protocol.engine import Resync
    from phalanx.protocol.matchmaking import Donation

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["poison_state"]()]) as peers:
            by_id = {p.peer_id: p for p in peers}
            newcomer = await open_peer([str(m) for m in peers[0].dht.get_visible_maddrs()], CONFIG)
            try:
                state = {"w": torch.linspace(-1, 1, 50_000), "b": torch.full((7,), 0.25), "count": torch.tensor([3])}
                template = {k: torch.zeros_like(v) for k, v in state.items()}
                for donor in (peers[1], peers[3]):  # honest, then the attacker
                    outcomes = await _round(peers, _inputs(4))
                    # the newcomer is in everyone's view, so a round may now and then form without a late member
                    averaged = {p.peer_id: o for p, o in zip(peers, outcomes) if isinstance(o, Averaged)}
                    group = averaged[donor.peer_id].group.model_copy(
                        update={"donations": [Donation(recipient=newcomer.peer_id, donor=donor.peer_id)]}
                    )
                    for member in group.members:
                        await by_id[member].engine.completed(
                            dataclasses.replace(averaged[member], group=group), lambda: dict(state)
                        )
                    resync = Resync(group, donor.peer_id)
                    if donor is peers[1]:
                        snapshot = await newcomer.engine.fetch_state(resync, template)
                        assert all(torch.equal(snapshot.tensors[k], v) for k, v in state.items())
                    else:
                        others = len(group.members) - 1
                        with pytest.raises(PeerProtocolError, match=f"state refused: 0 of the round's {others} other members"):
                            await newcomer.engine.fetch_state(resync, template)
            finally:
                await close_peer(newcomer)

    asyncio.run(main())


def test_a_peer_claiming_a_later_step_does_not_become_everyones_donor():
    """The state a round starts from is the one most joiners hold: a peer that claims a step far ahead
    of everyone is told to catch up with them, instead of them all downloading its state."""
    from phalanx.protocol.engine import Resync

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            honest, liar = peers[:3], peers[3]
            for peer in honest:
                peer.engine.set_state(b"v" * 32, 5)
            liar.engine.set_state(b"x" * 32, 10**9)
            xs = _inputs(4)
            outcomes = await asyncio.gather(*[p.engine.run_round(x) for p, x in zip(peers, xs)], return_exceptions=True)
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged) and liar.peer_id not in outcome.group.members, outcome
            assert isinstance(outcomes[3], Resync) and outcomes[3].donor in {p.peer_id for p in honest}

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
            outcomes = await _round(peers, _inputs(4))
            for outcome in outcomes[:3]:
                assert outcome.verdict.banned == {attacker}
            # each honest judge fetched once from the accuser; the other 149 accusations cost nothing
            honest = sorted((judge, holder) for judge, holder in fetches if judge != attacker)
            assert honest == sorted((p.peer_id, attacker) for p in peers[:3])

    asyncio.run(main())


def test_a_report_kept_from_one_reducer_gets_nobody_banned_and_changes_nothing():
    """A member that sends its report to everyone but one reducer makes that reducer accuse it of not
    reporting while the others hold the report: unprovable either way, so the accusation is dismissed;
    everyone takes the report from the echoes and applies the same aggregates."""

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["withhold_report"]()]) as peers:
            outcomes = await _round(peers, _inputs(4))
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == set() and outcome.verdict.bad_parts == set()
                assert outcome.verdict.accusations >= 1  # the reducer did accuse
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())


def test_held_parts_are_served_to_the_rounds_members_only():
    """The parts a reducer keeps as evidence are the contributors' gradients: a peer that was not in the
    round cannot download them (a member can, to judge)."""
    from phalanx.protocol.btard.messages import EVIDENCE_METHOD, EvidenceRequest
    from phalanx.protocol.transport import CallFailed
    from phalanx.security.wire import pack

    async def main():
        # a contested round (the weight is proof on sight), so that the parts are kept for the judges
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["inflate_weight"]()]) as peers:
            outcomes = await _round(peers, _inputs(4))
            group = outcomes[0].group
            reducer, contributor = peers[0], peers[1]
            assert reducer.engine.btard.holds(group.round_id)  # a contested round: kept for the judges
            part = group.members.index(reducer.peer_id)
            request = pack(EvidenceRequest(round_id=group.round_id, part=part, contributor=contributor.peer_id))

            async def ask(peer):
                return await peer.transport.call(reducer.peer_id, EVIDENCE_METHOD, request, b"", max_reply_payload=1 << 20, timeout_s=10)

            _, data = await ask(contributor)
            assert len(data) == 4 * (NUMEL // 4)
            outsider = await open_peer([str(m) for m in reducer.dht.get_visible_maddrs()], CONFIG)
            try:
                with pytest.raises(CallFailed, match="not in"):
                    await ask(outsider)
            finally:
                await close_peer(outsider)

    asyncio.run(main())


def test_a_member_that_banned_a_peer_the_leader_has_not_yet_still_takes_part_and_nobody_is_banned():
    """Bans reach peers at different times. A member that already banned a peer its leader put in the
    group used to refuse that peer's calls, fail its own part of the round, and get banned by everyone."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            leader = peers[0].membership.leader()
            member, other = [p for p in peers if p.peer_id != leader][:2]
            member.membership.banned.add(other.peer_id)
            outcomes = await _round(peers, _inputs(4))
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert not outcome.verdict.banned and not outcome.verdict.bad_parts, outcome.verdict
            assert member.membership.banned == {other.peer_id}
            assert all(not p.membership.banned for p in peers if p is not member)
            assert other.peer_id in member.transport.banned  # outside rounds with it, its calls are refused again
            assert not member.transport._in_round

    asyncio.run(main())
