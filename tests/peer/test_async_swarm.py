"""A 3-peer LASGD swarm and a 4-peer gossip swarm train digits for real: exchanges complete while
local steps go on, and the swarm reaches the target accuracy."""

import asyncio

import pytest

from peer.swarm import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("mode, peers", [("lasgd", 3), ("gossip", 4)])
def test_async_swarm_converges(mode, peers, tmp_path):
    args = [
        "--mode", mode, "--steps", "3000", "--target-accuracy", "0.95", "--eval-every", "10",
        "--sync-every", "5", "--wait-for-peers", str(peers),
        "--slowdown", "const:0.01",  # a step takes some time, as on a GPU: exchanges overlap with training
    ]  # fmt: skip
    swarm = Swarm(peers, args, target_accuracy=0.95, workdir=tmp_path / mode, live=False)
    result = asyncio.run(swarm.run())
    assert result.reached_target
    exchanged = [v.report["rounds_ok"] + v.report["rounds_partial"] for v in result.peers if v.report]
    assert len(exchanged) == peers and all(n > 0 for n in exchanged), exchanged
