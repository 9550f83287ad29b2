"""Round engine with real peers on loopback: exact averages, robust rules, a member killed mid-round."""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from phalanx.protocol.config import Codec, MatchmakingConfig, RoundConfig
from phalanx.protocol.engine import Averaged, RoundRequest
from phalanx.protocol.partition import partition_bounds
from tests.procs import script_env
from tests.protocol.swarm_fixture import open_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
HERE = Path(__file__).parent


def _inputs(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=g) * (i + 1) for i in range(n)]


async def _round(peers, xs):
    outcomes = await asyncio.gather(*[p.engine.run_round(RoundRequest(x)) for p, x in zip(peers, xs)])
    for peer, outcome in zip(peers, outcomes):
        assert isinstance(outcome, Averaged), outcome
        await peer.engine.completed(outcome, dict)
    return outcomes


@pytest.mark.parametrize("n, numel", [(3, 1000), (4, 300_000)])  # unary path; sealed direct TCP path
def test_mean_round_equals_true_mean(n, numel):
    async def main():
        async with open_swarm(n, RoundConfig()) as peers:
            xs = _inputs(n, numel)
            outcomes = await _round(peers, xs)
            mean = torch.stack(xs).mean(0)
            for outcome in outcomes:
                assert len(outcome.group.members) == n
                assert outcome.result.missing_parts == () and outcome.result.dropped_senders == ()
                assert (outcome.result.vector - mean).abs().max().item() < 1e-6
            assert len({p.engine.version for p in peers}) == 1  # everyone advanced to the same version

    asyncio.run(main())


def test_centered_clip_round_equals_library_on_each_part():
    from phalanx.aggregation.centered_clip import centered_clip

    config = RoundConfig(aggregator="centered_clip", aggregator_params=(("tau", 1.0),))
    n, numel = 4, 2000

    async def main():
        async with open_swarm(n, config) as peers:
            xs = _inputs(n, numel)
            xs[3] = xs[3] * -1000  # one attacker: clipping has to act
            outcomes = await _round(peers, xs)
            members = outcomes[0].group.members
            by_member = {p.peer_id: x for p, x in zip(peers, xs)}
            stacked = torch.stack([by_member[m] for m in members])  # member order = part order
            expected = torch.cat(
                [centered_clip(stacked[:, a:b], tau=1.0).value for a, b in partition_bounds(numel, n)]
            )
            for outcome in outcomes:
                assert torch.allclose(outcome.result.vector, expected, atol=1e-6)

    asyncio.run(main())


def test_bucketing_round_from_the_command_line_settings():
    """--aggregator bucketing --aggregator-params s=2,inner=median, as `phalanx join` builds it: each
    reducer applies bucketing around the median to its part (one generator per reducer, seeded alike)."""
    from phalanx.aggregation.bucketing import bucketing
    from phalanx.aggregation.coordinatewise import coordinate_median
    from phalanx.peer.config import PeerConfig, load_settings
    from phalanx.peer.plan import make_plan

    settings = load_settings(PeerConfig, {"aggregator": "bucketing", "aggregator_params": "s=2,inner=median,seed=3"})
    n, numel = 5, 2000

    async def main():
        async with open_swarm(n, make_plan(settings).round) as peers:
            xs = _inputs(n, numel)
            xs[4] = xs[4] * -1000  # one attacker: a mean would follow it
            outcomes = await _round(peers, xs)
            members = outcomes[0].group.members
            by_member = {p.peer_id: x for p, x in zip(peers, xs)}
            stacked = torch.stack([by_member[m] for m in members])  # member order = part order
            expected = torch.cat(
                [
                    bucketing(stacked[:, a:b], 2, coordinate_median, generator=torch.Generator().manual_seed(3)).value
                    for a, b in partition_bounds(numel, n)
                ]
            )
            for outcome in outcomes:
                assert torch.allclose(outcome.result.vector, expected, atol=1e-6)
            assert (expected - torch.stack(xs).mean(0)).abs().max() > 10  # not the mean

    asyncio.run(main())


def test_lossy_codec_gives_every_member_the_same_vector():
    async def main():
        async with open_swarm(3, RoundConfig(compression=Codec.FP16)) as peers:
            xs = _inputs(3, 5000)
            outcomes = await _round(peers, xs)
            first = outcomes[0].result.vector
            for outcome in outcomes[1:]:
                assert torch.equal(outcome.result.vector, first)
            assert (first - torch.stack(xs).mean(0)).abs().max().item() < 1e-2

    asyncio.run(main())


@pytest.mark.parametrize(
    "fault, allreduce_timeout_s, part_idle_timeout_s",
    [
        (signal.SIGKILL, 4.0, None),  # dropped at the deadline
        (signal.SIGKILL, 120.0, 2.0),  # dropped because its bytes never came, long before the deadline
        (signal.SIGSTOP, 120.0, 2.0),  # frozen: its sockets stay open, its bytes stop
    ],
    ids=["kill-deadline", "kill-idle", "stop-idle"],
)
def test_member_killed_mid_round_is_dropped_and_the_next_round_proceeds(fault, allreduce_timeout_s, part_idle_timeout_s):
    config = RoundConfig(
        matchmaking=MatchmakingConfig(matchmaking_timeout_s=3.0, join_timeout_s=120.0),
        allreduce_timeout_s=allreduce_timeout_s,
        part_idle_timeout_s=part_idle_timeout_s,
    )

    async def main(scratch: str):
        async with open_swarm(2, config) as peers:
            initial = [str(m) for m in peers[0].dht.get_visible_maddrs()]
            sockets: list[str] = []
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "stalling_peer.py"), *initial],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=HERE,
                # killed, it cannot remove its temporary files: they go where the test removes them
                env=script_env(TMPDIR=scratch),
                start_new_session=True,
            )
            try:
                ready = await asyncio.to_thread(proc.stdout.readline)
                assert ready.startswith("READY "), ready
                stalled, sockets = ready.split()[1], ready.split()[2:]
                for peer in peers:
                    while stalled not in peer.membership.peers():
                        await peer.membership.refresh()
                xs = _inputs(2, 400_000)
                for peer in peers:
                    peer.engine.set_state(b"v0", 0)
                round1 = [asyncio.create_task(p.engine.run_round(RoundRequest(x))) for p, x in zip(peers, xs)]
                proc.stdin.write(f"{len(peers)}\n")  # it joins with them, once it sees them
                proc.stdin.flush()
                line = await asyncio.to_thread(proc.stdout.readline)  # the group formed with all three
                assert line.startswith("IN_GROUP "), line
                round_id = bytes.fromhex(line.split()[1])
                # it may be the leader: kill it only once both others got the group and started the data phase
                async with asyncio.timeout(60):  # a group without them would never start here: fail, not hang
                    while not all(p.engine.allreduce.has_round(round_id) for p in peers):
                        await asyncio.sleep(0.01)
                os.killpg(proc.pid, fault)  # mid-round: it never sends its parts (nor, stopped, answers)
                outcomes = await asyncio.gather(*round1)
                members = outcomes[0].group.members
                dead = members.index(stalled)
                bounds = partition_bounds(400_000, 3)
                survivors_mean = torch.stack(xs).mean(0)
                for peer, outcome in zip(peers, outcomes):
                    assert outcome.result.missing_parts == (dead,)
                    assert outcome.result.dropped_senders == (stalled,)
                    # what ended the wait for it: the idle timeout, or else the deadline
                    idle = part_idle_timeout_s is not None
                    assert outcome.result.idle_senders == ((stalled,) if idle else ())
                    assert outcome.result.late_senders == (() if idle else (stalled,))
                    stats = peer.engine.stats
                    assert (stats.rounds_partial, stats.rounds_failed, stats.rounds_ok) == (1, 0, 0)
                    assert (stats.members_dropped_idle, stats.members_dropped_late) == ((1, 0) if idle else (0, 1))
                    if fault == signal.SIGSTOP:  # its reducer's reply would only have come at the call's timeout
                        assert outcome.result.idle_parts == (dead,) and stats.parts_dropped_idle == 1
                    for j, (a, b) in enumerate(bounds):
                        if j == dead:
                            assert torch.count_nonzero(outcome.result.vector[a:b]) == 0
                        else:
                            assert (outcome.result.vector[a:b] - survivors_mean[a:b]).abs().max() < 1e-6
                    if idle:  # the next group neither waits for it nor has it lead (it may be the lowest ID)
                        assert peer.membership.is_suspect(stalled)
                        assert peer.membership.leader() != stalled
                for peer, outcome in zip(peers, outcomes):
                    await peer.engine.completed(outcome, dict)
                # the next round forms without the dead or frozen peer and completes
                outcomes = await _round(peers, xs)
                for outcome in outcomes:
                    assert sorted(outcome.group.members) == sorted(p.peer_id for p in peers)
                    assert outcome.result.missing_parts == ()
                    assert (outcome.result.vector - survivors_mean).abs().max() < 1e-6
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
                proc.wait()
                for path in sockets:
                    Path(path).unlink(missing_ok=True)

    with tempfile.TemporaryDirectory(prefix="phalanx-test-stalled-") as scratch:
        asyncio.run(main(scratch))


@pytest.mark.parametrize("part_idle_timeout_s", [None, 1.0], ids=["deadline", "idle"])
def test_a_round_in_which_nothing_arrived_before_the_deadline_is_not_applied(part_idle_timeout_s):
    """A peer frozen past the deadline (SIGSTOP, a laptop lid) wakes to a round the others left: its
    "average" would be its own stale part. A member that stopped sending is another matter: dropped
    for idleness, it costs a partial round."""
    from phalanx.errors import RoundAbortedError
    from phalanx.protocol.allreduce import RoundSpec

    async def main():
        async with open_swarm(2, RoundConfig(part_idle_timeout_s=part_idle_timeout_s)) as (awake, absent):
            absent.engine.allreduce.registration_wait_s = 1.0  # it never starts the round: calls to it end soon
            members = (awake.peer_id, absent.peer_id)
            spec = RoundSpec(os.urandom(16), members, 1000, Codec.NONE, deadline=time.monotonic() + 3.0)
            run = awake.engine.allreduce.run(spec, torch.ones(1000), awake.engine.reducer, call_timeout_s=30.0)
            if part_idle_timeout_s is None:
                with pytest.raises(RoundAbortedError, match="no other member's bytes arrived before the deadline"):
                    await run
            else:
                result = await run
                assert result.idle_senders == (absent.peer_id,) and result.late_senders == ()
                assert result.missing_parts == (1,) and result.contributors == 1

    asyncio.run(main())


def test_the_engine_counts_a_failed_round_itself_and_a_cancelled_one_nowhere():
    """Training modes only read `stats`: a round that raises (here: a contribution refused once the
    group is known) is counted by the engine; a round cancelled by a stop is no failure."""
    from phalanx.errors import PeerProtocolError

    async def refuse(group):
        raise PeerProtocolError("contribution refused", peer=group.members[0])

    async def main():
        async with open_swarm(2, RoundConfig()) as peers:
            results = await asyncio.gather(*[p.engine.run_round(RoundRequest(prepare=refuse)) for p in peers], return_exceptions=True)
            assert all(isinstance(r, PeerProtocolError) for r in results), results
            assert [(p.engine.stats.rounds_failed, p.engine.stats.rounds_ok) for p in peers] == [(1, 0), (1, 0)]
            alone = asyncio.create_task(peers[0].engine.run_round(RoundRequest(torch.ones(10))))  # nobody joins it
            await asyncio.sleep(0.5)
            alone.cancel()
            await asyncio.gather(alone, return_exceptions=True)
            assert alone.cancelled()
            assert peers[0].engine.stats.rounds_failed == 1

    asyncio.run(main())
