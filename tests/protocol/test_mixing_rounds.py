"""Mixing rounds (MatchmakingConfig.group_size): a swarm larger than G splits into random groups, each
averaging its members' models besides their vectors, and a part that did not come back leaves this
peer's own model there, never zeros."""

import asyncio

import pytest
import torch

from phalanx.protocol.config import Codec, MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest, _mixed
from phalanx.protocol.matchmaking import GroupSpec
from phalanx.protocol.round_spec import AllReduceResult, RoundSpec
from tests.protocol.swarm_fixture import open_swarm

MEMBERS = [f"12D3KooW{c}" + "x" * 45 for c in "ABC"]


def test_a_missing_part_of_the_model_is_this_peers_own():
    numel = 5  # vector and model: 10 values in 3 parts, [0, 4) [4, 7) [7, 10)
    spec = RoundSpec(round_id=b"r" * 32, members=tuple(MEMBERS), numel=2 * numel, codec=Codec.NONE, deadline=0.0)
    aggregate = torch.cat([torch.full((numel,), 0.5), torch.full((numel,), 2.0)])
    aggregate[4:7] = 0.0  # part 1 did not come back: zeros, as the all-reduce leaves it
    result = AllReduceResult(aggregate, (1,), (), 3, 0, 0, 0.0)
    group = GroupSpec(round_id=b"r" * 32, members=MEMBERS, step=0, version=b"", donations=[], mixing=True)
    own = torch.arange(numel, dtype=torch.float32) + 10
    outcome = _mixed(spec, result, None, group, own)
    assert outcome.result.vector.tolist() == [0.5] * 4 + [0.0]
    assert outcome.model.tolist() == [10.0, 11.0, 2.0, 2.0, 2.0]  # model values 0–1 were in part 1
    assert outcome.result.missing_parts == (1,)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_five_peers_in_groups_of_two_average_vectors_and_models_within_their_groups():
    config = RoundConfig(matchmaking=MatchmakingConfig(group_size=2, matchmaking_timeout_s=20.0, join_timeout_s=60.0))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(300, generator=g) for _ in range(5)]
    models = [torch.randn(300, generator=g) * 10 for _ in range(5)]

    async def main():
        async with open_swarm(5, config) as peers:
            requests = [RoundRequest(x, model=lambda m=m: m) for x, m in zip(xs, models)]
            outcomes = await asyncio.gather(*[p.engine.run_round(r) for p, r in zip(peers, requests)])
            index = {p.peer_id: i for i, p in enumerate(peers)}
            groups = {tuple(sorted(o.group.members)) for o in outcomes}
            assert sorted(len(m) for m in groups) == [1, 2, 2]
            for outcome in outcomes:
                assert isinstance(outcome, Averaged) and outcome.group.mixing
                mine = [index[p] for p in outcome.group.members]
                assert torch.allclose(outcome.result.vector, torch.stack([xs[i] for i in mine]).mean(0), atol=1e-6)
                assert torch.allclose(outcome.model, torch.stack([models[i] for i in mine]).mean(0), atol=1e-5)

    asyncio.run(main())
