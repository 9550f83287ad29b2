"""Rounds of the asynchronous modes on real peers: gossip pairs average exactly, gossip reaches
consensus, and a stale contribution is corrected end to end exactly as aggregation's Gap-Aware says."""

import asyncio

import pytest
import torch

from phalanx.aggregation.staleness import GapAware
from phalanx.peer.local_exchange import BASE_KEY
from phalanx.peer.local_sgd import LocalState, StalenessCorrection
from phalanx.protocol.config import MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.state_sync import StateSnapshot
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _config(target=None):
    return RoundConfig(
        matchmaking=MatchmakingConfig(
            min_group_size=2, target_group_size=target, lockstep=False, window_s=2.0, matchmaking_timeout_s=10.0
        )
    )


def test_gossip_pair_ends_with_the_exact_pair_average():
    async def main():
        async with open_swarm(2, _config(target=2)) as peers:
            xs = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
            for outcome in outcomes:
                assert isinstance(outcome, Averaged) and len(outcome.group.members) == 2
                assert torch.equal(outcome.result.vector, (xs[0] + xs[1]) / 2)

    asyncio.run(main())


def test_four_peer_gossip_reaches_consensus():
    async def main():
        async with open_swarm(4, _config(target=2)) as peers:
            xs = [torch.randn(2000, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(4)]
            mean = torch.stack(xs).mean(0)
            spread0 = max(float((x - mean).norm()) for x in xs)
            for _ in range(12):
                outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
                assert all(len(o.group.members) == 2 for o in outcomes)  # one random peer at a time
                xs = [o.result.vector.clone() for o in outcomes]
            assert torch.allclose(torch.stack(xs).mean(0), mean, atol=1e-5)  # pairwise averaging keeps the mean
            assert max(float((x - mean).norm()) for x in xs) < 0.25 * spread0

    asyncio.run(main())


def test_stale_contribution_is_penalized_end_to_end_as_gap_aware_says():
    g = torch.Generator().manual_seed(3)
    fresh_base, stale_base = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    states = [LocalState(base=fresh_base, version=5), LocalState(base=stale_base, version=2)]
    states[0].snapshot = fresh_base + 0.05 * torch.randn(1000, generator=g)
    states[1].snapshot = stale_base + 0.05 * torch.randn(1000, generator=g)
    steps = [0.2 * torch.randn(1000, generator=g) for _ in range(4)]
    corrections = [StalenessCorrection("gap_aware", lr=0.1) for _ in states]
    reference = GapAware(0.1)
    for step in steps:
        for c in corrections:
            c.observe(step)
        reference.observe(step)

    async def main():
        async with open_swarm(2, _config()) as peers:
            for peer, state in zip(peers, states):
                peer.engine.set_state(b"", state.version)
                snapshot = StateSnapshot(step=state.version, version=b"", tensors={"base": state.base})
                await peer.engine.state.publish(snapshot, BASE_KEY)
            bases = []

            def prepare_for(peer, state, correction):
                async def prepare(group):
                    async def fetch(index):
                        donor = group.members[index]
                        snap = await peer.engine.state.fetch(donor, BASE_KEY, {"base": state.base}, timeout_s=30)
                        return snap.tensors["base"]

                    part = await state.contribution(group.versions, fetch, correction, max_gap=8)
                    bases.append(part.base_ref)
                    return part.update, part.weight

                return prepare

            outcomes = await asyncio.gather(
                *[p.engine.run_round(RoundRequest(prepare=prepare_for(p, s, c))) for p, s, c in zip(peers, states, corrections)]
            )
            fresh_update = states[0].snapshot - fresh_base
            stale_update = states[1].snapshot - stale_base
            expected = (fresh_update + reference.correct(stale_update, fresh_base - stale_base)[0]) / 2
            for outcome in outcomes:
                assert sorted(outcome.group.versions) == [2, 5]
                assert torch.allclose(outcome.result.vector, expected, atol=1e-6)
            assert all(torch.equal(b, fresh_base) for b in bases)  # both merge onto the freshest base
            assert states[1].penalties[-1].gap_versions == 3 and states[1].penalties[-1].mean_divisor > 1

    asyncio.run(main())


def test_clipped_gossip_pair_moves_each_member_at_most_tau_per_part():
    from phalanx.aggregation.gossip import clipped_gossip_update
    from phalanx.protocol.partition import partition_bounds

    config = RoundConfig(
        aggregator="clipped_gossip",
        aggregator_params=(("tau", 0.5),),
        matchmaking=MatchmakingConfig(min_group_size=2, target_group_size=2, lockstep=False, window_s=2.0, matchmaking_timeout_s=10.0),
    )

    async def main():
        async with open_swarm(2, config) as peers:
            xs = [torch.randn(4000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
            xs[1] = xs[1] * 100  # far away: clipping must act
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
            members = outcomes[0].group.members
            by_member = {p.peer_id: x for p, x in zip(peers, xs)}
            for peer, outcome in zip(peers, outcomes):
                mine, other = by_member[peer.peer_id], by_member[[m for m in members if m != peer.peer_id][0]]
                expected = torch.cat([
                    clipped_gossip_update(mine[a:b], other[a:b].reshape(1, -1), torch.tensor([0.5], dtype=torch.float64), 0.5).value
                    for a, b in partition_bounds(4000, 2)
                ])
                assert torch.allclose(outcome.result.vector, expected, atol=1e-5)
                for a, b in partition_bounds(4000, 2):  # each part moved by at most tau / 2
                    assert float((outcome.result.vector[a:b] - mine[a:b]).norm()) <= 0.25 + 1e-5
            total = outcomes[0].result.vector + outcomes[1].result.vector
            assert torch.allclose(total, xs[0] + xs[1], atol=1e-4)  # the pair's sum (and average) is kept

    asyncio.run(main())


def test_sync_policy_sets_the_group_size():
    from phalanx.protocol.sync_policy import parse_sync_policy

    config = RoundConfig(
        matchmaking=MatchmakingConfig(min_group_size=2, lockstep=False, window_s=5.0, matchmaking_timeout_s=20.0)
    )

    async def main():
        async with open_swarm(4, config, sync_policy=lambda: parse_sync_policy("k:2")) as peers:
            xs = [torch.randn(100, generator=torch.Generator().manual_seed(i)) for i in range(4)]
            outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
            for outcome in outcomes:
                assert outcome.group.k == 2 and len(outcome.group.members) == 2  # K = 2: no one waits for more

    asyncio.run(main())


def test_an_asynchronous_group_closes_as_soon_as_every_expected_peer_joined():
    """The window waits for peers that are not ready yet; with all of them in, it would only delay the
    exchange (LASGD merged every ~27 steps instead of every 5 while each group sat out its window)."""
    config = RoundConfig(
        matchmaking=MatchmakingConfig(lockstep=False, window_s=3600.0, matchmaking_timeout_s=7200.0, join_timeout_s=9000.0)
    )

    async def main():
        async with open_swarm(3, config) as peers:
            xs = [torch.full((100,), float(i)) for i in range(3)]
            async with asyncio.timeout(120):  # a hang here is the group sitting out its hour-long window
                outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
            for outcome in outcomes:
                assert isinstance(outcome, Averaged) and len(outcome.group.members) == 3
                assert torch.equal(outcome.result.vector, torch.full((100,), 1.0))

    asyncio.run(main())
