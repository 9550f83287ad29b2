"""What every verified-round test shares: a 4-peer config with short phases and seeded inputs."""

import asyncio

import torch

from phalanx.protocol.config import MatchmakingConfig, RoundConfig, verify_config_for
from phalanx.protocol.engine import RoundRequest

PARAMS = (("tau", 1.0),)
CONFIG = RoundConfig(
    aggregator="centered_clip",
    aggregator_params=PARAMS,
    verify=verify_config_for("centered_clip", PARAMS, phase_timeout_s=3.0),
    allreduce_timeout_s=5.0,
    matchmaking=MatchmakingConfig(matchmaking_timeout_s=3.0, join_timeout_s=60.0),
)
NUMEL = 40_000


def inputs(n):
    g = torch.Generator().manual_seed(1)
    common = torch.randn(NUMEL, generator=g)
    return [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(n)]


async def run_round(peers, xs):
    for peer in peers:
        peer.engine.set_state(b"v0", 0)
    return await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)], return_exceptions=True)
