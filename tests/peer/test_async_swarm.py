"""A 3-peer LASGD swarm (also sending only the top 10 % of its progress) and a 4-peer gossip swarm train
digits for real: exchanges complete while local steps go on, and the swarm gets above 0.95 test accuracy."""

import asyncio

import pytest

from phalanx.tools.launcher.swarm import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
STEPS = 300


@pytest.mark.parametrize(
    "mode, peers, compression", [("lasgd", 3, "none"), ("gossip", 4, "none"), ("lasgd", 3, "topk:0.1")]
)
def test_async_swarm_converges(mode, peers, compression, tmp_path):
    args = [
        "--mode", mode, "--steps", str(STEPS), "--eval-every", "50", "--sync-every", "5",
        "--wait-for-peers", str(peers), "--compression", compression,
        "--slowdown", "const:0.01",  # a step takes some time, as on a GPU: exchanges overlap with training
    ]  # fmt: skip
    swarm = Swarm(peers, args, workdir=tmp_path / mode, live=False)
    result = asyncio.run(swarm.run())
    reports = [v.report for v in result.peers]
    assert all(r is not None and r["step"] == STEPS for r in reports), reports
    assert all(r["rounds"]["ok"] + r["rounds"]["partial"] > 0 for r in reports), [r["rounds"] for r in reports]
    # The last evaluation of one peer varies by a point or two with how the exchanges fell (timing on
    # a shared machine): the swarm must get above 0.95 in the second half, and no peer may end far off.
    late = [e["accuracy"] for v in result.peers for e in v.events if e.get("event") == "eval" and e["step"] >= STEPS // 2]
    assert max(late) >= 0.95, late
    assert min(r["accuracy"] for r in reports) >= 0.9, [r["accuracy"] for r in reports]
