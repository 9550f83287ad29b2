"""One member's view of a verified round (protocol/btard/round.py) with real peers on loopback: honest
rounds equal CenteredClip part by part, the seed stays unknown until every aggregate is bound, each
protocol attack gets exactly its attacker banned, and commitments are signed once per round id."""

import asyncio
import dataclasses
import math
import os

import pytest
import torch

from phalanx.aggregation.centered_clip import centered_clip
from phalanx.errors import PeerProtocolError
from phalanx.protocol.adversary import PROTOCOL_ATTACKS
from phalanx.protocol.btard.behavior import Behavior
from phalanx.protocol.config import Codec, verify_config_for
from phalanx.protocol.engine import Averaged, RoundRequest, Verification
from phalanx.protocol.partition import partition_bounds
from tests.protocol.btard.btard_rounds import CONFIG, NUMEL, inputs, run_round
from tests.protocol.swarm_fixture import close_peer, open_peer, open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_honest_verified_round_equals_centered_clip_per_part():
    async def main():
        async with open_swarm(4, CONFIG) as peers:
            xs = inputs(4)
            outcomes = await run_round(peers, xs)
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
            outcomes = await run_round(peers, xs)
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
            xs = inputs(4)
            outcomes = await run_round(peers, xs)
            expected = torch.stack(xs).mean(0)
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.clean and outcome.verdict.banned == set()
                assert (outcome.result.vector - expected).abs().max() < 1e-5

    asyncio.run(main())


@pytest.mark.parametrize("codec", [Codec.FP16, Codec.INT8])
def test_honest_verified_round_with_a_lossy_codec_is_clean(codec):
    """Commitments cover the compressed bytes, reports are taken on what the reducers decoded, and the
    fixed-point tolerance allows for the aggregate's rounding by the codec (not more)."""

    async def main():
        config = dataclasses.replace(CONFIG, compression=codec)
        async with open_swarm(4, config) as peers:
            outcomes = await run_round(peers, inputs(4))
            first = outcomes[0]
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.clean and outcome.verdict.banned == set()
                assert torch.equal(outcome.result.vector, first.result.vector)
            assert all(not p.membership.banned for p in peers)

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
            outcomes = await run_round(peers, inputs(4))
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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_a_member_sending_non_finite_or_overflowing_parts_is_banned_alone(value):
    """Parts that CenteredClip cannot use (NaN, Inf, a norm past its limit) are left out by every reducer:
    their sender is banned, and no honest reducer is convicted over a report nobody could check."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            xs = inputs(4)
            xs[3] = torch.full_like(xs[3], value)
            outcomes = await run_round(peers, xs)
            at = outcomes[0].group.members.index(peers[3].peer_id)
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {peers[3].peer_id}
                assert outcome.verdict.bad_parts == {at}
                assert torch.isfinite(outcome.result.vector).all()
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

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
            first = await run_round(peers, inputs(4))
            assert all(isinstance(o, Averaged) for o in first), first
            second = await run_round(peers, inputs(4))
            for outcome in second:
                assert isinstance(outcome, PeerProtocolError) and "reused a round id" in str(outcome), outcome
            for peer in peers:
                mine = [
                    statement for who, round_id, statement in signed if who == peer.peer_id and round_id == b"R" * 16
                ]
                assert len(mine) == 1, "signed two commitments for one round id"
                assert not peer.membership.banned
            # a group statement older than the freshness window is refused too (a leader whose clock is off)
            leader = peers[0].engine.matchmaker.last_leader
            for peer in peers:
                peer.engine.matchmaker.new_round_id = lambda: os.urandom(16)
                if peer.peer_id == leader:
                    peer.engine.matchmaker.wall_clock = lambda: time.time() - 3600
            outcomes = await run_round(peers, inputs(4))
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
            outcomes = await run_round(peers, inputs(4))
            outcome = outcomes[peers.index(restarted)]
            assert isinstance(outcome, PeerProtocolError) and "before this peer started" in str(outcome), outcome
            mine = [
                statement for who, round_id, statement in signed if who == restarted.peer_id and round_id == b"R" * 16
            ]
            assert len(mine) == 1, "signed two commitments for one round id after a restart"

    asyncio.run(main())


@pytest.mark.parametrize("chunk_bytes", [None, 4096], ids=["one-donor", "chunks-from-every-member"])
def test_a_poisoned_state_download_is_refused_by_the_rounds_majority(chunk_bytes, monkeypatch):
    """A peer that must catch up downloads the state its donor kept after a round. In verified runs every
    member of that round keeps its own as a witness, and the recipient compares fingerprints along
    directions it draws after the download: an honest donor's state is taken, a poisoned one refused.
    With small chunks the state comes from every member at once, the attacker's chunks included: they
    fail the honest donor's digests and come again from it."""
    from phalanx.protocol import state_sync
    from phalanx.protocol.engine import Resync
    from phalanx.protocol.matchmaking import Donation

    if chunk_bytes is not None:
        monkeypatch.setattr(state_sync, "CHUNK_BYTES", chunk_bytes)

    async def main():
        async with open_swarm(4, CONFIG, behaviors=[None, None, None, PROTOCOL_ATTACKS["poison_state"]()]) as peers:
            by_id = {p.peer_id: p for p in peers}
            newcomer = await open_peer([str(m) for m in peers[0].dht.get_visible_maddrs()], CONFIG)
            try:
                state = {"w": torch.linspace(-1, 1, 50_000), "b": torch.full((7,), 0.25), "count": torch.tensor([3])}
                template = {k: torch.zeros_like(v) for k, v in state.items()}
                for donor in (peers[1], peers[3]):  # honest, then the attacker
                    outcomes = await run_round(peers, inputs(4))
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
                        if chunk_bytes is not None:  # the attacker's share came again from the donor
                            assert newcomer.engine.state.refetched_chunks > 0
                    else:
                        others = len(group.members) - 1
                        with pytest.raises(
                            PeerProtocolError, match=f"state refused: 0 of the round's {others} other members"
                        ):
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
            xs = inputs(4)
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)], return_exceptions=True)
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged) and liar.peer_id not in outcome.group.members, outcome
            assert isinstance(outcomes[3], Resync) and outcomes[3].donor in {p.peer_id for p in honest}

    asyncio.run(main())


def test_a_member_that_banned_a_peer_the_leader_has_not_yet_still_takes_part_and_nobody_is_banned():
    """Bans reach peers at different times. A member that already banned a peer its leader put in the
    group used to refuse that peer's calls, fail its own part of the round, and get banned by everyone."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            leader = peers[0].membership.leader()
            member, other = [p for p in peers if p.peer_id != leader][:2]
            member.membership.banned.add(other.peer_id)
            outcomes = await run_round(peers, inputs(4))
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert not outcome.verdict.banned and not outcome.verdict.bad_parts, outcome.verdict
            assert member.membership.banned == {other.peer_id}
            assert all(not p.membership.banned for p in peers if p is not member)
            assert other.peer_id in member.transport.banned  # outside rounds with it, its calls are refused again
            assert not member.transport._in_round

    asyncio.run(main())


def test_a_member_sitting_out_reduces_and_gets_the_aggregate_of_the_others_alone():
    """A DiLoCo validator sits its round out: its parts (zeros) count in no aggregate, every other member's
    do, it still reduces its part and gets every aggregate, and the round is clean for everyone."""

    async def main():
        async with open_swarm(4, CONFIG) as peers:
            xs = inputs(4)
            sitter = peers[1].peer_id
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            requests = [RoundRequest(x, verification=Verification(sit_out=p.peer_id == sitter)) for p, x in zip(peers, xs)]
            outcomes = await asyncio.gather(*[p.engine.run_round(r) for p, r in zip(peers, requests)], return_exceptions=True)
            members = outcomes[0].group.members
            by_member = {p.peer_id: x for p, x in zip(peers, xs)}
            stacked = torch.stack([by_member[m] for m in members if m != sitter])
            expected = torch.cat(
                [centered_clip(stacked[:, a:b], tau=1.0, max_iter=100_000).value for a, b in partition_bounds(NUMEL, 4)]
            )
            for outcome in outcomes:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.clean and outcome.verdict.banned == set() and outcome.verdict.bad_parts == set()
                assert torch.allclose(outcome.result.vector, expected, atol=1e-6)
                assert not outcome.result.missing_parts
            assert all(not p.membership.banned for p in peers)

    asyncio.run(main())


class _CountsTheSitter(Behavior):
    """A reducer that counts a sitter's zeros, dragging its aggregate towards zero."""

    name = "counts_the_sitter"

    def counted(self, vr, received):
        return sorted(set(received) | {vr.members.index(p) for p in vr.sitters})


def test_a_reducer_counting_a_member_that_sat_out_is_banned_and_its_part_dropped():
    async def main():
        async with open_swarm(4, ATTACK_CONFIG, behaviors=[None, None, None, _CountsTheSitter()]) as peers:
            sitter, attacker = peers[1].peer_id, peers[3].peer_id
            for peer in peers:
                peer.engine.set_state(b"v0", 0)
            requests = [RoundRequest(x, verification=Verification(sit_out=p.peer_id == sitter)) for p, x in zip(peers, inputs(4))]
            outcomes = await asyncio.gather(*[p.engine.run_round(r) for p, r in zip(peers, requests)], return_exceptions=True)
            part = outcomes[0].group.members.index(attacker)
            for outcome in outcomes[:3]:
                assert isinstance(outcome, Averaged), outcome
                assert outcome.verdict.banned == {attacker}
                assert part in outcome.verdict.bad_parts
                assert torch.equal(outcome.result.vector, outcomes[0].result.vector)

    asyncio.run(main())
